"""Write admission on its own: the queue's time budget, backoff, the free-space floor."""

from __future__ import annotations

import errno
import os
import time
from types import SimpleNamespace

import pytest

from kvtier_offload import write_admission as admission
from kvtier_offload.write_admission import WriteAdmission

MiB = 1 << 20


def test_a_job_is_refused_where_the_queue_would_take_longer_than_its_budget():
    gate = WriteAdmission("/", queue_seconds=10.0, floor_percent=0)
    assert gate.admit(10**12)  # no rate measured yet: nothing to judge by
    gate.settle(10**12, 0)
    gate.written(100 * MiB, 1.0, blocks=100)  # 100 MiB/s
    assert gate.admit(600 * MiB) and gate.queued_bytes == 600 * MiB
    assert not gate.admit(500 * MiB)  # 1100 MiB queued: 11 s
    assert gate.queued_bytes == 600 * MiB  # a refused job queues nothing
    gate.settle(600 * MiB, 0)
    assert gate.admit(500 * MiB)


def test_the_queue_drains_at_every_writers_rate_together():
    """B2 (#36): the drain rate is one writer's measured rate times the writers, measured
    over every writer's recent batches; a volume that does not scale shows it as slower
    batches when they run at once; batches older than the window drop out."""
    gate = WriteAdmission("/", queue_seconds=10.0, floor_percent=0, writers=8)
    gate.written(32 * MiB, 1.0, blocks=4, now=100.0)  # one writer alone: 32 MiB/s
    assert gate.rate == pytest.approx(256 * MiB)
    for _ in range(8):  # eight at once, each 8 s per 32 MiB: the volume does not scale
        gate.written(32 * MiB, 8.0, blocks=4, now=110.0)
    assert gate.rate == pytest.approx(288 * MiB / 65 * 8)
    gate.written(10 * MiB, 1.0, blocks=1, now=130.0)  # the rest is past the window
    assert gate.rate == pytest.approx(80 * MiB)


@pytest.mark.slow
def test_eight_slow_writers_refuse_nothing_the_aggregate_rate_drains_in_budget(make_store):
    """B2 (#36): 8 write threads at 32 MiB/s each (0.25 s per 8 MiB block) drain 256
    MiB/s together; 60 stores of 8 MiB (480 MiB, under 2 s at that rate) arrive at once
    after a warm-up: none may be refused against write_queue_seconds = 10 (one thread's
    rate refused a third of them), and every refused one would be counted and never
    found by a lookup."""
    from prometheus_client import REGISTRY

    from tests.offload.conftest import keys

    store = make_store(write_threads=8, read_threads=1, io_threads=9, o_direct="off",
                       write_queue_seconds=10.0)
    files = store.files
    batch, single = files.write_batch, files.write

    def slow_batch(*args, **kwargs):
        time.sleep(0.25)
        return batch(*args, **kwargs)

    def slow_single(*args, **kwargs):
        time.sleep(0.25)
        return single(*args, **kwargs)

    files.write_batch, files.write = slow_batch, slow_single
    block = memoryview(bytearray(8 * MiB))
    names = keys(61)

    def refused() -> float:
        return REGISTRY.get_sample_value("kvtier_offload_dropped_writes_total",
                                         {"reason": "queue-full"}) or 0.0

    store.store(0, [(names[0], block)])  # warm-up: the first rate is measured
    assert store.drain(10)
    store.finished()
    before = refused()
    start = time.monotonic()
    for job in range(1, 61):
        store.store(job, [(names[job], block)])
    assert store.drain(30)
    took = time.monotonic() - start
    outcomes = store.finished()
    failed = [o.job_id for o in outcomes if not all(o.ok)]
    assert failed == [] and refused() == before, \
        f"refused {len(failed)} of 60 stores that drained in {took:.1f} s"
    assert took < 10.0
    assert all(store.lookup(k) is not False for k in names[1:])
def test_late_blocks_are_stale_or_backing_off():
    gate = WriteAdmission("/", queue_seconds=5.0, floor_percent=0)
    now = time.monotonic()
    assert gate.late(now - 4.0, now) is None
    assert gate.late(now - 6.0, now) == "stale"
    gate.failed(OSError(errno.ENOSPC, "full"))
    assert gate.late(now, time.monotonic()) == "backoff"
    assert gate.late(now, gate.blocked_until + 0.001) is None


def test_refusals_by_the_volume_back_off_doubling_to_a_minute_and_a_success_resets():
    gate = WriteAdmission("/", queue_seconds=5.0, floor_percent=0)
    gate.failed(OSError(errno.EINVAL, "not the volume's refusal"))
    assert gate.blocked_until == 0.0
    waits = []
    for _ in range(8):
        before = time.monotonic()
        gate.failed(OSError(errno.EDQUOT, "quota"))
        waits.append(round(gate.blocked_until - before))
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60]
    gate.written(1, 1.0, blocks=1)
    before = time.monotonic()
    gate.failed(OSError(errno.EIO, "I/O error"))
    assert round(gate.blocked_until - before) == 1


def fake_volume(monkeypatch, free_blocks: int, total_blocks: int = 1000) -> list[int]:
    """A volume of 4 KiB blocks for statvfs; returns a list counting its calls."""
    calls: list[int] = []
    volume = SimpleNamespace(f_bavail=free_blocks, f_frsize=4096, f_blocks=total_blocks)

    def statvfs(path):
        calls.append(1)
        return volume

    monkeypatch.setattr(admission.os, "statvfs", statvfs)
    return calls


def test_no_floor_never_asks_the_volume(monkeypatch):
    calls = fake_volume(monkeypatch, free_blocks=0)
    assert WriteAdmission("/", 5.0, floor_percent=0).free_space_ok(10**15)
    assert calls == []


def test_far_from_the_floor_the_volume_is_read_at_most_once_a_second(monkeypatch):
    calls = fake_volume(monkeypatch, free_blocks=900)  # floor 10%: 100 blocks
    gate = WriteAdmission("/", 5.0, floor_percent=10.0)
    assert all(gate.free_space_ok(100 * 4096) for _ in range(3))
    assert len(calls) == 1


def test_writes_stop_at_the_floor_and_approved_bytes_count_against_it(monkeypatch):
    fake_volume(monkeypatch, free_blocks=200)  # 20% free; floor 10%: 100 blocks
    gate = WriteAdmission("/", 5.0, floor_percent=10.0)
    assert gate.free_space_ok(60 * 4096)
    gate.reserve(60 * 4096)  # approved, not yet written: statvfs still says 200 free
    assert not gate.free_space_ok(60 * 4096)
    assert gate.free_space_ok(40 * 4096)
    gate.reserve(40 * 4096)
    assert not gate.free_space_ok(1)
    gate.settle(0, 100 * 4096)  # given up: the space is free again
    assert gate.unwritten_bytes == 0
    assert gate.free_space_ok(100 * 4096)


def test_a_volume_that_cannot_say_lets_the_write_find_out(monkeypatch):
    def broken(path):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(admission.os, "statvfs", broken)
    assert WriteAdmission("/", 5.0, floor_percent=10.0).free_space_ok(1)


def test_the_real_volume_is_read(tmp_path):
    st = os.statvfs(tmp_path)
    free_percent = 100 * st.f_bavail / st.f_blocks
    assert WriteAdmission(str(tmp_path), 5.0, floor_percent=100.0).free_space_ok(1) is False
    if free_percent > 2:
        assert WriteAdmission(str(tmp_path), 5.0, floor_percent=1.0).free_space_ok(4096)
