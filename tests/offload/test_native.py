"""The C extension: built here, on the stable ABI, cheap to import, visible in logs and
metrics, and held to the Python path (same files, same outcomes: test_store.py,
test_hostile_files.py and test_batchio.py run both)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier_offload import native
from kvtier_offload.metrics import Metrics, Recorder
from kvtier_offload.store import hot_path
from tests.offload.conftest import FP

# What every vLLM process has loaded before it loads a KV connector or tier: the backend's
# own cost is what comes on top of these.
VLLM_HAS_LOADED = "import numpy, prometheus_client"
COST = f"""
import time
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
{VLLM_HAS_LOADED}
before, began = rss_mb(), time.perf_counter()
import kvtier_offload.store, kvtier_offload.batchio, kvtier_offload.digest
print(time.perf_counter() - began, rss_mb() - before)
"""


def test_the_extension_is_built_here():
    # `make test` builds it (pyproject ext-modules, build_ext --inplace); a missing or
    # stale build would quietly test the Python path twice.
    if os.environ.get(native.ENV, "1") in {"0", "off", "false", "no"}:
        pytest.skip(f"{native.ENV} turns it off")
    assert native.AVAILABLE, native.REASON
    assert native.module.__file__.endswith(".abi3.so")  # stable ABI: one build per platform


@pytest.mark.slow
def test_importing_the_backend_costs_under_half_a_second_and_20_mb():
    # numba used to compile the batch path at import: 6-7 s of CPU and ~110 MB per
    # vLLM process. Best of three runs: the machine is shared.
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", COST], capture_output=True, text=True,
                             check=True)
        runs.append(tuple(float(x) for x in out.stdout.split()))
    assert min(s for s, _ in runs) < 0.5, runs
    assert min(mb for _, mb in runs) < 20, runs


@pytest.mark.parametrize("batch_io", [True, False])
def test_the_store_says_once_which_path_it_runs_and_exports_it(tmp_path, caplog, batch_io):
    from kvtier_offload.store import BlockStore, StoreConfig

    recorder = Recorder()
    with caplog.at_level("INFO", logger="kvtier_offload"):
        store = BlockStore(StoreConfig(root=str(tmp_path), fingerprint=FP,
                                       batch_io=batch_io), Metrics(recorder))
    store.close()
    code, why = hot_path(batch_io)
    lines = [r for r in caplog.records if "kvtier block store" in r.getMessage()]
    assert len(lines) == 1
    if code == "ok":
        assert lines[0].levelname == "INFO" and "native path" in lines[0].getMessage()
    else:
        assert lines[0].levelname == "WARNING" and why in lines[0].getMessage()
    gauges = recorder.take()[1]
    assert gauges[("kvtier_offload_native", ("storage", code))] == (1 if code == "ok" else 0)


def test_hot_path_reasons():
    code, why = hot_path(False)
    assert code in {"batch-io-off", "turned-off", "not-built", "wrong-build", "no-digest"}
    assert why
    if native.AVAILABLE:
        assert hot_path(True) == ("ok", "")
