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


def test_the_rate_moves_a_fifth_of_the_way_per_block():
    gate = WriteAdmission("/", queue_seconds=10.0, floor_percent=0)
    gate.written(100, 1.0, blocks=1)
    assert gate.rate == 100
    gate.written(200, 1.0, blocks=1)
    assert gate.rate == pytest.approx(120)
    gate.written(200, 1.0, blocks=2)
    assert gate.rate == pytest.approx(0.64 * 120 + 0.36 * 200)


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
