"""The I/O pool: reads ahead of writes, and the cap on tasks running at once."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier_offload import store as store_mod
from kvtier_offload.iopool import IOPool


def test_cap_bounds_running_tasks_and_puts_reads_first():
    pool = IOPool(read_threads=1, write_threads=7, active=1)
    gate = threading.Event()
    lock = threading.Lock()
    running, peak, order = 0, 0, []

    def task(name: str, wait: bool = False):
        def run():
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
            if wait:
                gate.wait(5)
            time.sleep(0.002)
            order.append(name)
            with lock:
                running -= 1
        return run

    pool.submit_write(task("blocker", wait=True))
    time.sleep(0.05)  # the blocker holds the only slot
    for i in range(3):
        pool.submit_write(task(f"w{i}"))
    for i in range(3):
        pool.submit_read(task(f"r{i}"))
    gate.set()
    pool.close()
    assert peak == 1
    assert order[0] == "blocker" and order[1:4] == ["r0", "r1", "r2"], order


def test_every_thread_serves_reads_first_under_a_cap():
    capped, free = IOPool(1, 7, active=2), IOPool(1, 7)
    try:
        assert capped._order(False)[0] is capped._reads  # deques compare by content: use is
        assert free._order(False)[0] is free._writes
        assert free._order(True)[0] is free._reads
    finally:
        capped.close()
        free.close()


def test_uncapped_pool_runs_tasks_in_parallel():
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


def test_store_caps_io_on_a_memory_speed_volume(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "probe_memory_speed", lambda d, o: True)
    fast = store_mod.BlockStore(store_mod.StoreConfig(root=str(tmp_path), fingerprint="0" * 16,
                                                      read_threads=8, write_threads=8))
    monkeypatch.setattr(store_mod, "probe_memory_speed", lambda d, o: False)
    slow = store_mod.BlockStore(store_mod.StoreConfig(root=str(tmp_path), fingerprint="0" * 16,
                                                      read_threads=8, write_threads=8))
    try:
        assert fast._pool.active_limit == len(os.sched_getaffinity(0))
        assert slow._pool.active_limit == 16
    finally:
        fast.close()
        slow.close()
