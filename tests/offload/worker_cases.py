"""KV layouts and dtypes for worker round trips (shared by the CPU and GPU tests).

The layouts are the ones vLLM 0.32's OffloadingConnector hands a worker
(`offloading/worker.py`): int8 `(num_blocks, page)` views of the attention tensors.
"""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}

# layers, tokens per block, kv heads, head dim
LAYERS, TOKENS, HEADS, DIM = 2, 16, 2, 64
LAYOUTS = ["per-layer", "packed-cross-layer", "strided-rows"]
STRIDE_PAD = 6  # bytes after each strided row's page (not a multiple of 8 on purpose)


def kv_caches(layout: str, dtype: torch.dtype, device: str, num_blocks: int = 24):
    """vLLM-style CanonicalKVCaches:
    - per-layer: one tensor per layer, K and V inside each block's page (LBHNC);
    - packed-cross-layer: one tensor whose page is the whole block row (all layers);
    - strided-rows: one view per layer with rows farther apart than the page, the
      padding between them belonging to someone else (hisparse-style)."""
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    gen = torch.Generator(device="cpu").manual_seed(0)
    elems = 2 * TOKENS * HEADS * DIM  # K and V of one layer's block

    def typed(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).clamp(-4, 4).to(dtype).to(device)

    size = torch.empty((), dtype=dtype).element_size()
    page = elems * size
    tensors = []
    if layout == "per-layer":
        for _layer in range(LAYERS):
            flat = typed(num_blocks, 2, TOKENS, HEADS, DIM).view(torch.int8).view(num_blocks, -1)
            tensors.append(CanonicalKVCacheTensor(flat, page))
    elif layout == "packed-cross-layer":
        flat = typed(num_blocks, LAYERS * elems).view(torch.int8).view(num_blocks, -1)
        tensors.append(CanonicalKVCacheTensor(flat, flat.shape[1]))
    elif layout == "strided-rows":
        stride = page + STRIDE_PAD
        for _layer in range(LAYERS):
            base = torch.randint(-128, 128, (num_blocks * stride,), generator=gen,
                                 dtype=torch.int8).to(device)
            view = base.as_strided((num_blocks, page), (stride, 1))
            tensors.append(CanonicalKVCacheTensor(view, page))
    else:
        raise ValueError(layout)
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[[]])


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Every byte of the storage under a canonical view (padding included), as int8."""
    return torch.tensor([], dtype=torch.int8, device=tensor.device).set_(
        tensor.untyped_storage()).clone()


def make_worker(tmp_path, caches, **kwargs):
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker

    threads = kwargs.pop("threads", 2)
    return KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=threads,
        write_threads=threads)), caches, blocks_per_chunk=1, **kwargs)


def finish(worker, job_ids: set[int], timeout: float = 30.0,
           written: bool = True) -> dict[int, bool]:
    """Poll get_finished() as vLLM does each step until the jobs are reported, and (with
    written) until every acknowledged store's file writes have returned: a store is
    reported at its device fence, before its files exist."""
    import time

    results: dict[int, bool] = {}
    deadline = time.monotonic() + timeout
    while not job_ids <= results.keys() or (written and worker.writes_in_flight):
        assert time.monotonic() < deadline, \
            f"jobs {job_ids - results.keys()} never finished, or their writes never returned"
        results |= {r.job_id: r.success for r in worker.get_finished()}
        time.sleep(0.001)
    return results


def keys_for(blocks: list[int], salt: int = 0) -> list[bytes]:
    return [salt.to_bytes(4, "big") + b.to_bytes(32, "big") for b in blocks]


def round_trip(tmp_path, layout: str, dtype: torch.dtype, device: str,
               src: list[int] | None = None, dst: list[int] | None = None,
               num_blocks: int = 24, **worker_kwargs) -> None:
    """Store src, zero it, load into dst: dst's pages equal src's old pages bit for bit,
    and no other byte of any storage changed (strided padding included)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches(layout, dtype, device, num_blocks)
    worker = make_worker(tmp_path, caches, **worker_kwargs)
    src = src if src is not None else [3, 7, 11, 12]
    dst = dst if dst is not None else [20, 21, 22, 23]
    keys = keys_for(src)
    before = [storage_bytes(t.tensor) for t in caches.tensors]
    assert worker.submit_store(1, GPULoadStoreSpec(src, [len(src)], [0]),
                               KvtierLoadStoreSpec(keys))
    worker.wait({1})  # the source pages are copied: vLLM may reuse the blocks now
    for t in caches.tensors:
        t.tensor[torch.tensor(src, device=device)] = 0
    results = finish(worker, {1})
    assert worker.submit_load(2, KvtierLoadStoreSpec(keys),
                              GPULoadStoreSpec(dst, [len(dst)], [0]))
    results |= finish(worker, {2})
    assert results == {1: True, 2: True}
    assert worker.take_load_errors() == {}
    for t, old in zip(caches.tensors, before, strict=True):
        # what the storage must hold: src pages zeroed, dst pages = src's old pages
        want = old.clone()
        view = want.as_strided(t.tensor.shape, t.tensor.stride(), t.tensor.storage_offset())
        page = t.page_size_bytes
        old_view = old.as_strided(t.tensor.shape, t.tensor.stride(), t.tensor.storage_offset())
        view[torch.tensor(src, device=device), :page] = 0
        view[torch.tensor(dst, device=device), :page] = \
            old_view[torch.tensor(src, device=device), :page]
        assert torch.equal(storage_bytes(t.tensor).cpu(), want.cpu()), \
            "round trip is not bit-identical, or bytes outside the pages changed"
    worker.shutdown()


def config_info_series(extra_config: dict, series: list[dict]) -> dict[tuple, float] | None:
    """What vLLM 0.33's API server publishes as vllm:kv_offload_config_info for these
    manager config_info() series, declared from extra_config's spec (the scheduler's stats
    payload, through OffloadPromMetrics): {sorted label items: value}. None on a vLLM
    without the metric (0.32)."""
    import functools
    import pickle
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics

    if not hasattr(metrics, "KV_OFFLOAD_CONFIG_INFO"):
        return None
    stats = metrics.OffloadingConnectorStats()
    stats.set_info(series)
    payload = pickle.loads(pickle.dumps(stats.data))  # as it crosses processes
    registry = CollectorRegistry()
    kinds = {kind: functools.partial(kind, registry=registry)
             for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config=extra_config))
    prom = metrics.OffloadPromMetrics(config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(metrics.OffloadingConnectorStats(data=payload).data, 0)
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in registry.collect() if family.name == metrics.KV_OFFLOAD_CONFIG_INFO
            for sample in family.samples}
