"""KV layouts and dtypes for worker round trips (shared by the CPU and GPU tests)."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def kv_caches(layout: str, dtype: torch.dtype, device: str, num_blocks: int = 24):
    """vLLM-style CanonicalKVCaches: int8 (num_blocks, page) views of typed tensors."""
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    gen = torch.Generator(device="cpu").manual_seed(0)

    def typed(*shape: int) -> torch.Tensor:
        data = torch.randn(*shape, generator=gen).clamp(-4, 4).to(dtype)
        return data.to(device)

    tensors = []
    if layout == "per-layer-kv":  # FlashAttention style: K and V apart, per layer
        for _layer in range(2):
            for _kv in range(2):
                t = typed(num_blocks, 32, 2, 64)  # block, tokens, kv heads, head dim
                flat = t.view(torch.int8).view(num_blocks, -1)
                tensors.append(CanonicalKVCacheTensor(flat, flat.shape[1]))
    else:  # packed cross-layer blocks, rows strided by a padded block stride
        t = typed(num_blocks, 2 * 2 * 32 * 2 * 64 + 256)
        flat = t.view(torch.int8).view(num_blocks, -1)
        page = 2 * 2 * 32 * 2 * 64 * t.element_size()
        tensors.append(CanonicalKVCacheTensor(flat, page))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[[]])


def finish(worker, job_ids: set[int], timeout: float = 30.0) -> dict[int, bool]:
    """Poll get_finished() as vLLM does each step until the jobs are reported."""
    import time

    results: dict[int, bool] = {}
    deadline = time.monotonic() + timeout
    while not job_ids <= results.keys():
        assert time.monotonic() < deadline, f"jobs {job_ids - results.keys()} never finished"
        results |= {r.job_id: r.success for r in worker.get_finished()}
        time.sleep(0.001)
    return results


def round_trip(tmp_path, layout: str, dtype: torch.dtype, device: str) -> None:
    import numpy as np
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec, KvtierOffloadingWorker

    caches = kv_caches(layout, dtype, device)
    worker = KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=2, write_threads=2)),
        caches, blocks_per_chunk=1)
    src, dst = [3, 7, 11, 12], [20, 21, 22, 23]
    keys = [bytes([b]) * 32 + b"\0\0\0\0" for b in src]
    before = [t.tensor.clone() for t in caches.tensors]
    assert worker.submit_store(1, GPULoadStoreSpec(src, [len(src)], [0]),
                               KvtierLoadStoreSpec(keys))
    worker.wait({1})  # the source pages are copied: vLLM may reuse the blocks now
    for t in caches.tensors:
        t.tensor[np.array(src)] = 0
    results = finish(worker, {1})
    assert worker.submit_load(2, KvtierLoadStoreSpec(keys),
                              GPULoadStoreSpec(dst, [len(dst)], [0]))
    results |= finish(worker, {2})
    assert results == {1: True, 2: True}
    for t, old in zip(caches.tensors, before, strict=True):
        page = t.page_size_bytes
        got = t.tensor[torch.tensor(dst, device=device), :page].cpu()
        want = old[torch.tensor(src, device=device), :page].cpu()
        assert torch.equal(got, want), "round trip is not bit-identical"
        # bytes beyond the page (padding of strided rows) are left alone
        if t.tensor.shape[1] > page:
            assert torch.equal(t.tensor[torch.tensor(dst, device=device), page:].cpu(),
                               old[torch.tensor(dst, device=device), page:].cpu())
    worker.shutdown()
