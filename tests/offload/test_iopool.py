"""The I/O pool: reads ahead of writes; one thread per core on memory-speed volumes."""

from __future__ import annotations

import os
import threading
import time

import pytest

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
                                                      read_threads=8, write_threads=8))
    monkeypatch.setattr(store_mod, "probe_memory_speed", lambda d, o: False)
    slow = store_mod.BlockStore(store_mod.StoreConfig(root=str(tmp_path), fingerprint="0" * 16,
                                                      read_threads=8, write_threads=8))
    pinned = store_mod.BlockStore(store_mod.StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=8, write_threads=8,
        io_threads=3))
    try:
        cores = len(os.sched_getaffinity(0))
        assert fast._pool.threads == min(cores, 16)
        assert all(t.name.startswith("kvtier-io-r") for t in fast._pool._threads)
        assert slow._pool.threads == 16
        assert pinned._pool.threads == 3
    finally:
        fast.close()
        slow.close()
        pinned.close()
