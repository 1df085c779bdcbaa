"""The I/O pool: reads ahead of writes; one thread per core on memory-speed volumes; store
threads of their own at a lower CPU priority (store_nice)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier_offload import iopool
from kvtier_offload import store as store_mod
from kvtier_offload.iopool import IOPool


def test_reads_go_before_queued_writes():
    pool = IOPool(read_threads=1, write_threads=0)
    gate = threading.Event()
    order = []

    def task(name: str, wait: bool = False):
        def run():
            if wait:
                gate.wait(5)
            order.append(name)
        return run

    pool.submit_write(task("blocker", wait=True))
    time.sleep(0.05)  # the blocker holds the only thread
    for i in range(3):
        pool.submit_write(task(f"w{i}"))
    for i in range(3):
        pool.submit_read(task(f"r{i}"))
    gate.set()
    pool.close()
    assert order == ["blocker", "r0", "r1", "r2", "w0", "w1", "w2"], order


def test_a_write_thread_takes_writes_first():
    pool = IOPool(read_threads=1, write_threads=1)
    hold_read, hold_write, done = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    try:
        pool.submit_read(lambda: hold_read.wait(5))
        pool.submit_write(lambda: hold_write.wait(5))
        deadline = time.monotonic() + 5
        while pool.busy() != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        pool.submit_read(lambda: ran.append("read"))
        pool.submit_write(lambda: (ran.append("write"), done.set()))
        hold_write.set()  # only the write thread is free: the write is its own
        assert done.wait(5)
        assert ran[0] == "write"  # (the read may follow on the same thread right after)
    finally:
        hold_read.set()
        hold_write.set()
        pool.close()
    assert ran == ["write", "read"]


def test_pool_runs_tasks_in_parallel():
    pool = IOPool(read_threads=2, write_threads=2)
    barrier = threading.Barrier(4, timeout=5)
    for _ in range(4):
        pool.submit_write(barrier.wait)  # all four must run at once to pass
    pool.close()
    assert not barrier.broken


@pytest.mark.parametrize(("limit", "expected"), [(10.0, True), (0.0, False)])
def test_memory_speed_probe(tmp_path, monkeypatch, limit, expected):
    monkeypatch.setattr(store_mod, "MEMORY_SPEED_SECONDS", limit)
    assert store_mod.probe_memory_speed(str(tmp_path), o_direct=False) is expected
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_memory_speed_probe_on_an_unwritable_volume_keeps_every_thread(tmp_path):
    assert store_mod.probe_memory_speed(str(tmp_path / "missing"), o_direct=False) is False


def test_store_runs_one_reads_first_thread_per_core_on_a_memory_speed_volume(
        tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "probe_memory_speed", lambda d, o: True)
    fast = store_mod.BlockStore(store_mod.StoreConfig(root=str(tmp_path), fingerprint="0" * 16,
                                                      read_threads=8, write_threads=8,
                                                      store_nice=0))
    monkeypatch.setattr(store_mod, "probe_memory_speed", lambda d, o: False)
    slow = store_mod.BlockStore(store_mod.StoreConfig(root=str(tmp_path), fingerprint="0" * 16,
                                                      read_threads=8, write_threads=8,
                                                      store_nice=0))
    pinned = store_mod.BlockStore(store_mod.StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=8, write_threads=8,
        io_threads=3, store_nice=0))
    try:
        cores = len(os.sched_getaffinity(0))
        assert fast.pool.threads == min(cores, 16)
        assert fast.pool.write_threads == 0  # every thread takes loads first
        assert (slow.pool.threads, slow.pool.write_threads) == (16, 8)
        assert (pinned.pool.threads, pinned.pool.write_threads) == (3, 0)
    finally:
        fast.close()
        slow.close()
        pinned.close()


def wait_busy(pool: IOPool, reads: int, writes: int) -> None:
    deadline = time.monotonic() + 5
    while pool.busy() != (reads, writes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.busy() == (reads, writes)


def test_spare_threads_for_reads_and_for_writes():
    pool = IOPool(read_threads=2, write_threads=2)
    gate = threading.Event()
    try:
        assert pool.spare(reads=True) == pool.spare(reads=False) == 4
        for _ in range(3):
            pool.submit_write(lambda: gate.wait(5))
        wait_busy(pool, reads=0, writes=3)
        # A write waits for those; a read takes the threads they free before queued writes.
        assert (pool.spare(reads=False), pool.spare(reads=True)) == (1, 4)
        pool.submit_read(lambda: gate.wait(5))
        wait_busy(pool, reads=1, writes=3)
        pool.submit_read(lambda: gate.wait(5))  # queued: every thread is taken
        pool.submit_write(lambda: gate.wait(5))
        assert (pool.spare(reads=False), pool.spare(reads=True)) == (0, 2)
    finally:
        gate.set()
        pool.close()
    assert pool.busy() == (0, 0)  # all done: every thread free again


def test_a_job_spreads_over_spare_threads_and_goes_whole_under_a_backlog():
    block = 256 << 10
    assert [len(b) for b in store_mod.split_job(16, block, spare=8)] == [2] * 8
    assert [len(b) for b in store_mod.split_job(16, block, spare=0)] == [16]
    assert [len(b) for b in store_mod.split_job(3, block, spare=8)] == [1, 1, 1]
    big = store_mod.split_job(100, block, spare=0)  # never more than BATCH_BYTES a task
    assert [len(b) for b in big] == [32, 32, 32, 4]
    assert [i for b in big for i in b] == list(range(100))


class CountingPool(IOPool):
    """An I/O pool that counts the tasks each kind of job was split into."""

    def __init__(self, reads: int, writes: int) -> None:
        super().__init__(reads, writes)
        self.tasks = {"read": 0, "write": 0}

    def submit_read(self, task, urgent=False):
        self.tasks["read"] += 1
        super().submit_read(task, urgent)

    def submit_write(self, task):
        self.tasks["write"] += 1
        super().submit_write(task)


def test_the_store_splits_a_job_by_the_threads_its_pool_has_spare(tmp_path):
    from tests.offload.conftest import keys, rows

    pool = CountingPool(4, 4)
    store = store_mod.BlockStore(store_mod.StoreConfig(root=str(tmp_path), fingerprint="0" * 16),
                                 pool=pool)
    gate = threading.Event()
    try:
        if not store.batch_io:
            pytest.skip("the batch path is off here: one block per task regardless")
        assert store.pool is pool
        ks, src = keys(16), rows(16, 64 << 10, seed=1)
        store.store(1, list(zip(ks, src)))  # a lone job: every thread at once
        assert store.drain(30) and pool.tasks["write"] == 8
        for _ in range(8):
            pool.submit_write(lambda: gate.wait(5))
        pool.tasks["write"] = 0
        store.store(2, list(zip(keys(16), src)))  # behind a backlog: one task
        # A load still spreads, to take each thread the writes free.
        store.load(3, list(zip(ks, rows(16, 64 << 10))))
        assert pool.tasks == {"read": 8, "write": 1}
        gate.set()
        assert store.drain(30)
        assert all(outcome.success for outcome in store.finished())
    finally:
        gate.set()
        store.close()
    assert pool.busy() == (0, 0)


def test_an_urgent_read_goes_before_queued_reads():
    """vLLM 0.33's expedited (sync) loads: the engine waits for them within its step."""
    pool = IOPool(read_threads=1, write_threads=0)
    gate = threading.Event()
    order = []

    def task(name: str, wait: bool = False):
        def run():
            if wait:
                gate.wait(5)
            order.append(name)
        return run

    pool.submit_read(task("blocker", wait=True))
    time.sleep(0.05)  # the blocker holds the only thread
    pool.submit_read(task("r0"))
    pool.submit_read(task("r1"))
    pool.submit_read(task("u0"), urgent=True)
    gate.set()
    pool.close()
    assert order == ["blocker", "u0", "r0", "r1"], order


def thread_nice(tid: int) -> int:
    """A thread's nice value as the kernel reports it (field 19 of its stat)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        stat = f.read()
    return int(stat.rsplit(")", 1)[1].split()[16])  # fields 3.. follow the name


def nice_of_tasks(pool: IOPool) -> dict[str, int]:
    """The nice value each kind of task runs at on pool: one read and one write task
    record their thread's."""
    seen: dict[str, int] = {}
    done = threading.Event()

    def record(kind: str):
        def run():
            seen[kind] = thread_nice(threading.get_native_id())
            if len(seen) == 2:
                done.set()
        return run

    pool.submit_read(record("load"))
    pool.submit_write(record("store"))
    assert done.wait(5)
    return seen


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_stores_run_at_the_configured_nice_value_and_loads_at_the_process_s(tmp_path):
    own = thread_nice(threading.get_native_id())
    store = store_mod.BlockStore(store_mod.StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=2, write_threads=2,
        store_nice=7))
    try:
        for _ in range(5):  # whichever threads take them
            assert nice_of_tasks(store.pool) == {"load": own, "store": min(19, own + 7)}
        # Loads never wait on the store threads, nor stores on the load threads; loads
        # keep the 2 + 2 threads they could take from a shared pool. (Once the threads
        # are idle: a task's thread counts as busy until just after the task returns.)
        wait_busy(store.pool, reads=0, writes=0)
        assert (store.pool.spare(reads=True), store.pool.spare(reads=False)) == (4, 2)
    finally:
        store.close()
    shared = store_mod.BlockStore(store_mod.StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=2, write_threads=2,
        store_nice=0))
    try:
        assert nice_of_tasks(shared.pool) == {"load": own, "store": own}
    finally:
        shared.close()


def test_with_a_store_priority_each_kind_of_task_waits_only_for_its_own_threads():
    pool = IOPool(read_threads=1, write_threads=1, store_nice=5)
    gate = threading.Event()
    ran = threading.Event()
    try:
        pool.submit_write(lambda: gate.wait(5))
        pool.submit_write(lambda: gate.wait(5))  # queued behind the one store thread
        wait_busy(pool, reads=0, writes=1)
        assert (pool.spare(reads=True), pool.spare(reads=False)) == (1, 0)
        pool.submit_read(ran.set)  # the load thread never took the queued store
        assert ran.wait(5)
        assert pool.busy() == (0, 1)
    finally:
        gate.set()
        assert pool.close(10)  # every queued store still runs before the threads stop


def test_the_store_threads_keep_working_where_the_priority_cannot_be_lowered(
        tmp_path, monkeypatch, caplog):
    def refuse(by: int) -> int:
        raise PermissionError("not permitted")

    monkeypatch.setattr(iopool, "lower_priority", refuse)
    from tests.offload.conftest import keys, rows

    with caplog.at_level("WARNING", logger=iopool.__name__):
        store = store_mod.BlockStore(store_mod.StoreConfig(
            root=str(tmp_path), fingerprint="0" * 16, read_threads=1, write_threads=3,
            store_nice=10))
        try:
            ks = keys(6)
            store.store(1, list(zip(ks, rows(6, 64 << 10, seed=2))))
            assert store.drain(30)
            assert all(outcome.success for outcome in store.finished())
        finally:
            store.close()
    said = [r for r in caplog.records if "keep the process's CPU priority" in r.getMessage()]
    assert len(said) == 1  # once for the pool, not once per thread


def test_the_pool_shape_with_store_threads_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "probe_memory_speed", lambda d, o: True)
    fast = store_mod.BlockStore(store_mod.StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=8, write_threads=8))
    pinned = store_mod.BlockStore(store_mod.StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=8, write_threads=8,
        io_threads=3))
    lookups_only = store_mod.BlockStore(store_mod.StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=1, write_threads=0))
    try:
        cores = min(len(os.sched_getaffinity(0)), 8)
        assert store_mod.StoreConfig(root="", fingerprint="").store_nice == 10
        assert (fast.pool.threads, fast.pool.write_threads) == (2 * cores, cores)
        assert (pinned.pool.threads, pinned.pool.write_threads) == (6, 3)
        assert (lookups_only.pool.threads, lookups_only.pool.store_nice) == (1, 0)
    finally:
        fast.close()
        pinned.close()
        lookups_only.close()
