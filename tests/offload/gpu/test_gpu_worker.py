"""On a CUDA GPU: the offload worker keeps vLLM's contract (docs/benchmarks.md says how
to run these; /work reviews name them G1-G14). Skipped cleanly, with the reason, where
there is no CUDA device (CI never has one); the CPU side of each contract runs in CI in
tests/offload/test_vllm_worker.py and test_vllm_worker_contract.py. Without vLLM (torch
alone) the worker's vLLM types come from tests/offload/vllm032.py (conftest.py); `make
gpu-check` runs these and the benchmark and writes one report. Their tmp_path should be
on tmpfs (gpu-check sees to it): G4 and G7 time file I/O against device copies.

- bit-identical GPU -> file -> GPU round trips for vLLM 0.32's layouts (one int8 tensor
  per layer, K and V in the page; the packed cross-layer tensor; strided rows) and dtypes;
- G1 nothing on the submit/poll path synchronises (sync debug mode "error");
- G2 submit and poll return within 5 ms while the GPU is busy;
- G3-G6 ordering against the default stream with 256 MiB+ transfers: store after write
  (RAW), load after zeroing (WAW), completion visible, overwrite after wait (WAR);
- G7 a load does not queue behind a large store (stores keep at most store_device_bytes
  of copies on the device);
- G8 pinned memory stays within max_staging_bytes whatever the job sizes;
- G11 a worker on cuda:1 (two GPUs or more);
- G14 shutdown with transfers in flight.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from tests.offload.worker_cases import (  # noqa: E402
    DTYPES,
    LAYOUTS,
    finish,
    keys_for,
    make_worker,
    round_trip,
)

MiB = 1 << 20


def _caches(num_blocks: int, layers: int, page: int, device: str = "cuda"):
    """vLLM 0.32's per-layer layout: one int8 (num_blocks, page) tensor per layer,
    filled with random bytes."""
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    tensors = []
    for _ in range(layers):
        t = torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, device=device)
        tensors.append(CanonicalKVCacheTensor(t, page))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[[]])


def _spec(blocks: list[int]):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(blocks, [len(blocks)], [0])


def _files(keys: list[bytes]):
    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    return KvtierLoadStoreSpec(keys)


def _rows(caches, blocks: range) -> list[torch.Tensor]:
    return [t.tensor[blocks.start:blocks.stop].clone() for t in caches.tensors]


def _busy(seconds: float = 0.5) -> None:
    """Queue roughly `seconds` of spinning on the default stream (at about 2 GHz)."""
    torch.cuda._sleep(int(seconds * 2e9))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_round_trip_is_bit_identical(tmp_path, layout, dtype):
    round_trip(tmp_path, layout, DTYPES[dtype], "cuda")


def test_g1_submit_and_poll_never_synchronise(tmp_path):
    caches = _caches(64, 4, 64 * 1024)
    worker = make_worker(tmp_path, caches)
    keys = keys_for(list(range(16)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        worker.submit_store(1, _spec(list(range(16))), _files(keys))
        finish(worker, {1})
        worker.submit_load(2, _files(keys), _spec(list(range(32, 48))))
        finish(worker, {2})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    worker.shutdown()


def test_g2_submit_returns_at_once_while_the_gpu_is_busy(tmp_path):
    caches = _caches(64, 4, 64 * 1024)
    worker = make_worker(tmp_path, caches)
    old = keys_for(list(range(8)), salt=1)
    worker.submit_store(1, _spec(list(range(8))), _files(old))
    finish(worker, {1})
    torch.cuda.synchronize()
    _busy(1.0)
    calls = {}
    start = time.perf_counter()
    worker.submit_store(2, _spec(list(range(8, 24))), _files(keys_for(list(range(8, 24)))))
    calls["submit_store"] = time.perf_counter() - start
    start = time.perf_counter()
    worker.submit_load(3, _files(old), _spec(list(range(40, 48))))
    calls["submit_load"] = time.perf_counter() - start
    start = time.perf_counter()
    worker.get_finished()
    calls["get_finished"] = time.perf_counter() - start
    slow = {name: f"{s * 1e3:.1f} ms" for name, s in calls.items() if s > 0.005}
    assert not slow, f"blocked while the GPU was busy: {slow}"
    assert finish(worker, {2, 3}) == {2: True, 3: True}
    worker.shutdown()


def _big(tmp_path, **kwargs):
    """512 blocks of 2 MiB (4 layers of 512 KiB): 128 blocks = 256 MiB per transfer."""
    caches = _caches(512, 4, 512 * 1024)
    return caches, make_worker(tmp_path, caches, threads=8, **kwargs)


def test_g3_a_store_reads_what_the_default_stream_wrote_before_it(tmp_path):
    caches, worker = _big(tmp_path)
    src, dst = range(0, 128), range(256, 384)
    torch.cuda.synchronize()
    _busy(0.5)
    for t in caches.tensors:
        t.tensor[src.start:src.stop].fill_(0x5A)  # queued behind the sleep
    worker.submit_store(1, _spec(list(src)), _files(keys_for(list(src))))  # no sync
    assert finish(worker, {1}) == {1: True}
    worker.submit_load(2, _files(keys_for(list(src))), _spec(list(dst)))
    assert finish(worker, {2}) == {2: True}
    for t in caches.tensors:
        assert bool((t.tensor[dst.start:dst.stop] == 0x5A).all()), "the store read stale KV"
    worker.shutdown()


def test_g4_a_load_lands_after_the_default_stream_zeroed_its_blocks(tmp_path):
    caches, worker = _big(tmp_path)
    src, dst = range(0, 128), range(256, 384)
    want = _rows(caches, src)
    worker.submit_store(1, _spec(list(src)), _files(keys_for(list(src))))
    finish(worker, {1})
    torch.cuda.synchronize()
    _busy(0.5)
    for t in caches.tensors:
        t.tensor[dst.start:dst.stop].zero_()  # queued behind the sleep, before the load
    worker.submit_load(2, _files(keys_for(list(src))), _spec(list(dst)))
    assert finish(worker, {2}) == {2: True}
    for t, w in zip(caches.tensors, want, strict=True):
        assert torch.equal(t.tensor[dst.start:dst.stop], w), "zeroing overwrote the load"
    worker.shutdown()


def test_g5_a_reported_load_is_visible_to_the_next_kernel(tmp_path):
    caches, worker = _big(tmp_path)
    src, dst = range(0, 200), range(256, 456)
    sums = [t.tensor[src.start:src.stop].view(torch.int64).sum() for t in caches.tensors]
    worker.submit_store(1, _spec(list(src)), _files(keys_for(list(src))))
    finish(worker, {1})
    for t in caches.tensors:
        t.tensor[dst.start:dst.stop].zero_()
    worker.submit_load(2, _files(keys_for(list(src))), _spec(list(dst)))
    finish(worker, {2})
    # straight away, on the default stream, as the next forward would
    got = [t.tensor[dst.start:dst.stop].view(torch.int64).sum() for t in caches.tensors]
    assert all(bool(a == b) for a, b in zip(got, sums, strict=True))
    worker.shutdown()


def test_g6_blocks_may_be_overwritten_once_wait_returns(tmp_path):
    caches, worker = _big(tmp_path)
    src, dst = range(0, 128), range(256, 384)
    want = _rows(caches, src)
    worker.submit_store(1, _spec(list(src)), _files(keys_for(list(src))))
    worker.wait({1})
    for t in caches.tensors:
        t.tensor[src.start:src.stop].fill_(-1)  # vLLM reuses the blocks at once
    assert finish(worker, {1}) == {1: True}
    worker.submit_load(2, _files(keys_for(list(src))), _spec(list(dst)))
    assert finish(worker, {2}) == {2: True}
    for t, w in zip(caches.tensors, want, strict=True):
        assert torch.equal(t.tensor[dst.start:dst.stop], w), "the store read overwritten KV"
    worker.shutdown()


def test_g7_a_load_does_not_wait_behind_a_large_store(tmp_path):
    caches = _caches(2304, 4, 512 * 1024)  # 4.5 GiB of KV
    worker = make_worker(tmp_path, caches, threads=8, max_staging_bytes=8 << 30)
    small = list(range(16))
    worker.submit_store(1, _spec(small), _files(keys_for(small)))
    finish(worker, {1})
    big = list(range(16, 2064))  # 4 GiB
    worker.submit_store(2, _spec(big), _files(keys_for(big)))
    worker.submit_load(3, _files(keys_for(small)), _spec(list(range(2100, 2116))))
    done: dict[int, bool] = {}
    deadline = time.monotonic() + 30
    while 3 not in done:
        assert time.monotonic() < deadline
        done |= {r.job_id: r.success for r in worker.get_finished()}
    # the store is reported once its last device copy has fired: still pending here
    assert done[3] and 2 not in done, "the load waited for the store's device copy"
    assert worker._store_rows_on_device * worker.page_total <= 128 * MiB
    done |= finish(worker, {2} - done.keys(), timeout=120)
    worker.shutdown()


def test_g8_pinned_memory_stays_within_max_staging_bytes(tmp_path):
    limit = 256 * MiB
    caches = _caches(3500, 32, 16 * 1024)  # 512 KiB per block
    stats = torch.cuda.host_memory_stats
    before = stats().get("allocated_bytes.current", 0)
    worker = make_worker(tmp_path, caches, threads=8, max_staging_bytes=limit)
    built = stats()
    assert built.get("allocated_bytes.current", 0) - before <= limit
    slowest, first, job = 0.0, 0, 0
    for size in (1, 7, 300, 3000):
        blocks = list(range(first, first + size))
        first += size
        job += 1
        start = time.perf_counter()
        worker.submit_store(job, _spec(blocks), _files(keys_for(blocks)))
        slowest = max(slowest, time.perf_counter() - start)
        finish(worker, {job}, timeout=120)
        job += 1
        start = time.perf_counter()
        worker.submit_load(job, _files(keys_for(blocks)), _spec(blocks))
        slowest = max(slowest, time.perf_counter() - start)
        assert finish(worker, {job}, timeout=120) == {job: True}
    after = stats()
    assert after.get("num_host_alloc", 0) == built.get("num_host_alloc", 0), \
        "pinned memory was allocated after construction"
    assert after.get("allocated_bytes.current", 0) - before <= limit
    assert slowest < 0.02, f"a submit took {slowest * 1e3:.1f} ms"
    worker.shutdown()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs")
def test_g11_a_worker_on_the_second_gpu_leaves_the_first_alone(tmp_path):
    torch.cuda.set_device(0)
    used = torch.cuda.memory_allocated(0)
    round_trip(tmp_path, "per-layer", DTYPES["bf16"], "cuda:1")
    assert torch.cuda.memory_allocated(0) == used


def test_g14_shutdown_with_transfers_in_flight(tmp_path):
    _, worker = _big(tmp_path)
    worker.submit_store(1, _spec(list(range(128))), _files(keys_for(list(range(128)))))
    finish(worker, {1})
    worker.submit_store(2, _spec(list(range(128, 256))), _files(keys_for(list(range(128, 256)))))
    worker.submit_load(3, _files(keys_for(list(range(128)))), _spec(list(range(256, 384))))
    worker.get_finished()
    worker.shutdown()
    assert worker._store_stream.query() and worker._load_stream.query()
    torch.cuda.synchronize()
    round_trip(tmp_path / "again", "per-layer", DTYPES["bf16"], "cuda")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_round_trip_by_address_with_vllms_swap_blocks_batch(tmp_path, layout):
    """R3/R4: pages copied by address on the copy engines (vLLM's swap_blocks_batch, one
    call per piece); needs a CUDA build of vLLM, skipped with the torch-only stand-in."""
    from kvtier_offload.page_copy import vllm_batch_copy

    if vllm_batch_copy() is None:
        pytest.skip("needs vLLM's CUDA ops (swap_blocks_batch)")
    round_trip(tmp_path, layout, DTYPES["bf16"], "cuda", page_copy="addresses")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_round_trip_with_kernels(tmp_path, layout):
    """The gather/scatter kernels, kept as the fallback where no batched copy is found
    (auto now copies by address with vLLM's op or the CUDA runtime's)."""
    round_trip(tmp_path, layout, DTYPES["bf16"], "cuda", page_copy="kernels")


def test_gpu_pages_are_copied_by_address_with_torch_alone(tmp_path):
    """R3/R4 without vLLM: on CUDA 12.8 or later the worker copies pages with the CUDA
    runtime's cudaMemcpyBatchAsync (cudart_copy), one call per piece on the copy engines:
    bit-identical round trips, files of 4 GPU blocks and a load starting mid-file."""
    from kvtier_offload.page_copy import vllm_batch_copy
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker

    major, minor = (int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if (major, minor) < (12, 8):
        pytest.skip(f"cudaMemcpyBatchAsync needs CUDA 12.8+, this torch has {torch.version.cuda}")
    for layout in LAYOUTS:
        round_trip(tmp_path / layout, layout, DTYPES["bf16"], "cuda", page_copy="addresses")
    caches = _caches(64, 4, 64 << 10)
    worker = KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path / "files"), fingerprint="0" * 16)), caches, 4, page_copy="auto")
    assert worker.copier == ("vllm" if vllm_batch_copy() is not None else "cuda-runtime")
    src, dst = list(range(16)), list(range(40, 53))
    want = [t.tensor[3:16].clone() for t in caches.tensors]
    worker.submit_store(1, _spec(src), _files(keys_for([0, 1, 2, 3])))
    assert finish(worker, {1}) == {1: True}
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    worker.submit_load(2, _files(keys_for([0, 1, 2, 3])), GPULoadStoreSpec(dst, [13], [3]))
    assert finish(worker, {2}) == {2: True}
    torch.cuda.synchronize()
    for t, old in zip(caches.tensors, want, strict=True):
        assert torch.equal(t.tensor[40:53], old)
    worker.shutdown()
