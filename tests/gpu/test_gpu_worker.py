"""On a CUDA GPU: bit-identical GPU -> file -> GPU round trips for each layout and dtype,
concurrent store and load, and throughput against pinned-memory DMA. Skipped cleanly
where there is no CUDA device (CI never has one)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from tests.offload.worker_cases import DTYPES, finish, kv_caches, round_trip  # noqa: E402


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["per-layer-kv", "packed-cross-layer"])
def test_gpu_round_trip_is_bit_identical(tmp_path, layout, dtype):
    round_trip(tmp_path, layout, DTYPES[dtype], "cuda")


def test_gpu_concurrent_store_and_load(tmp_path):
    import threading

    errors = []

    def one(i):
        try:
            round_trip(tmp_path / str(i), "per-layer-kv", DTYPES["bf16"], "cuda")
        except Exception as err:  # collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_gpu_throughput_against_pinned_dma(tmp_path, capsys):
    """Prints GPU -> file -> GPU GB/s next to plain pinned-memory DMA (not a pass bar)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec, KvtierOffloadingWorker

    caches = kv_caches("packed-cross-layer", DTYPES["bf16"], "cuda", num_blocks=512)
    worker = KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16)), caches, blocks_per_chunk=1)
    blocks = list(range(256))
    keys = [i.to_bytes(36, "big") for i in blocks]
    nbytes = len(blocks) * caches.tensors[0].page_size_bytes
    start = time.perf_counter()
    worker.submit_store(1, GPULoadStoreSpec(blocks, [256], [0]), KvtierLoadStoreSpec(keys))
    finish(worker, {1})
    store_s = time.perf_counter() - start
    start = time.perf_counter()
    worker.submit_load(2, KvtierLoadStoreSpec(keys),
                       GPULoadStoreSpec([b + 256 for b in blocks], [256], [0]))
    finish(worker, {2})
    load_s = time.perf_counter() - start
    src = caches.tensors[0].tensor[:256]
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    pinned.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - start
    start = time.perf_counter()
    src.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    h2d = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n{torch.cuda.get_device_name()}: GPU->file {nbytes / store_s / 1e9:.2f} GB/s, "
              f"file->GPU {nbytes / load_s / 1e9:.2f} GB/s; pinned DMA D2H "
              f"{nbytes / d2h / 1e9:.2f} GB/s, H2D {nbytes / h2d / 1e9:.2f} GB/s")
