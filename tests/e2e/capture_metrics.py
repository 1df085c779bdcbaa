"""Recapture the /metrics fixtures in tests/fixtures/metrics/ from real vLLM API servers
(never write them by hand):

    .venv/bin/python -m tests.e2e.capture_metrics [OUT_DIR]

Two servers, one after the other, on the tiny model and one shared root, with kvtier's
GPU-direct OffloadingSpec as the operator renders it: A answers the e2e prompt twice
(stores its blocks; the second time hits its own HBM), B (a cold process) answers it
once and loads the blocks from the files. Saves each server's page before its first
request (`-idle`, what the operator's first read sees) and after, the installed vLLM's
version in the file name. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.e2e.engine import make_model
from tests.e2e.server import api_server, complete, metrics_page
from tests.helpers import ROOT

OUT = ROOT / "tests" / "fixtures" / "metrics"


def capture(out: Path) -> list[Path]:
    import vllm

    version = ".".join(vllm.__version__.split(".")[:2])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        model, root = Path(tmp) / "model", Path(tmp) / "D"
        make_model(str(model))
        for name, asks in (("a-stored", 2), ("b-loaded", 1)):
            with api_server(model, root, Path(tmp) / f"{name}.log") as url:
                pages = {f"{name[0]}-idle": metrics_page(url)}
                for _ in range(asks):
                    complete(url)
                pages[name] = metrics_page(url, settle_s=3)
            for label, page in pages.items():
                path = out / f"vllm-{version}-gpu-direct-{label}.txt"
                path.write_text(page)
                written.append(path)
    return written


if __name__ == "__main__":
    for p in capture(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(p)
