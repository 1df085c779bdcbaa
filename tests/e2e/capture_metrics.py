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
again (`cpu-tier-c-hit`). Then the same under vLLM's TieringOffloadingSpec with kvtier's
storage tier as the operator renders it (`cpu-storage-t-*`: on 0.33 its
`vllm:kv_offload_config_info` has a series per tier, by the `tier` label). Takes a few
minutes on 2 cores; --cpu-only skips the GPU-direct servers.
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
    tiering_config,
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
        # the HBM prefix cache reset, the prompt again: a CPU-tier hit. Alone, then with
        # kvtier's storage tier behind it.
        for name, kv in (("cpu-tier-c", cpu_tier_config()),
                         ("cpu-storage-t", tiering_config(Path(tmp) / "T"))):
            with api_server(model, None, Path(tmp) / f"{name}.log", kv=kv) as url:
                pages = {f"{name}-idle": metrics_page(url)}
                complete(url)
                time.sleep(2)
                reset_hbm_prefix_cache(url)
                complete(url)
                pages[f"{name}-hit"] = metrics_page(url, settle_s=3)
            for label, page in pages.items():
                path = out / f"vllm-{version}-{label}.txt"
                path.write_text(page)
                written.append(path)
    return written


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--cpu-only"]
    for p in capture(Path(args[0]) if args else OUT, only_cpu="--cpu-only" in sys.argv):
        print(p)
