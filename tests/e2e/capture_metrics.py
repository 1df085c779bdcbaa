"""Recapture the /metrics fixtures in tests/fixtures/metrics/ from real vLLM API servers
(never write them by hand):

    .venv/bin/python -m tests.e2e.capture_metrics [--cpu-only] [OUT_DIR]

Two servers, one after the other, on the tiny model and one shared root, with kvtier's
GPU-direct OffloadingSpec as the operator renders it: A answers the e2e prompt twice
(stores its blocks; the second time hits its own HBM), B (a cold process) answers it
once and loads the blocks from the files. Saves each server's page before its first
request (`-idle`, what the operator's first read sees) and after, the installed vLLM's
version in the file name. Then vLLM's own CPU tier (its worker replaced by one that moves
no data, tests/e2e/noop_cpu_spec.py): the prompt, the HBM prefix cache reset, the prompt
again (`cpu-tier-c-hit`). Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.engine import make_model
from tests.e2e.observe_server import (
    api_server,
    complete,
    cpu_tier_config,
    metrics_page,
    reset_hbm_prefix_cache,
)
from tests.helpers import ROOT

OUT = ROOT / "tests" / "fixtures" / "metrics"


def capture(out: Path, only_cpu: bool = False) -> list[Path]:
    import vllm

    version = ".".join(vllm.__version__.split(".")[:2])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        model, root = Path(tmp) / "model", Path(tmp) / "D"
        make_model(str(model))
        for name, asks in () if only_cpu else (("a-stored", 2), ("b-loaded", 1)):
            with api_server(model, root, Path(tmp) / f"{name}.log") as url:
                pages = {f"{name[0]}-idle": metrics_page(url)}
                for _ in range(asks):
                    complete(url)
                pages[name] = metrics_page(url, settle_s=3)
            for label, page in pages.items():
                path = out / f"vllm-{version}-gpu-direct-{label}.txt"
                path.write_text(page)
                written.append(path)
        # vLLM's own CPU tier, its worker a no-op (it cannot run on CPU): the prompt,
        # the HBM prefix cache reset, the prompt again: a CPU-tier hit.
        with api_server(model, None, Path(tmp) / "cpu.log", kv=cpu_tier_config()) as url:
            pages = {"c-idle": metrics_page(url)}
            complete(url)
            time.sleep(2)
            reset_hbm_prefix_cache(url)
            complete(url)
            pages["c-hit"] = metrics_page(url, settle_s=3)
        for label, page in pages.items():
            path = out / f"vllm-{version}-cpu-tier-{label}.txt"
            path.write_text(page)
            written.append(path)
    return written


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--cpu-only"]
    for p in capture(Path(args[0]) if args else OUT, only_cpu="--cpu-only" in sys.argv):
        print(p)
