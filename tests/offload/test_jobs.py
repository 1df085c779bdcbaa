"""The job table on its own: outcomes block by block, the queue-depth gauge, bounded waits."""

from __future__ import annotations

import logging
import threading
import time

from kvtier_offload.jobs import JobOutcome, JobTable


class Gauge:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount


def table() -> tuple[JobTable, dict[str, Gauge]]:
    depth = {"store": Gauge(), "load": Gauge()}
    return JobTable(depth), depth


KEYS = [bytes([i]) * 8 for i in range(3)]


def test_a_job_finishes_with_its_last_block_and_counts_only_bytes_that_moved():
    jobs, _ = table()
    job = jobs.start(7, "load", KEYS)
    jobs.report(job, [(2, True, 100), (0, False, 100)])
    assert jobs.finished() == [] and jobs.pending() == 1
    jobs.report(job, [(1, True, 100)])
    (outcome,) = jobs.finished()
    assert (outcome.job_id, outcome.kind, outcome.ok, outcome.nbytes) == (
        7, "load", [False, True, True], 200)
    assert outcome.seconds >= 0 and jobs.pending() == 0
    assert jobs.finished() == []  # taken once


def test_a_job_of_no_blocks_is_finished_at_once():
    jobs, _ = table()
    jobs.start(1, "store", [])
    assert [o.job_id for o in jobs.finished()] == [1]
    assert jobs.wait(0) is True


def test_queue_depth_counts_blocks_submitted_and_not_reported():
    jobs, depth = table()
    job = jobs.start(1, "store", KEYS)
    jobs.start(2, "load", KEYS[:1])
    assert (depth["store"].value, depth["load"].value) == (3, 1)
    jobs.report(job, [(0, True, 1), (1, True, 1)])
    assert depth["store"].value == 1
    jobs.report(job, [])  # nothing reported: nothing moves, nothing finishes
    assert depth["store"].value == 1 and jobs.pending() == 2


def test_wait_returns_when_the_last_job_finishes_elsewhere():
    jobs, _ = table()
    job = jobs.start(1, "load", KEYS[:1])
    timer = threading.Timer(0.1, lambda: jobs.report(job, [(0, True, 1)]))
    timer.start()
    started = time.monotonic()
    assert jobs.wait(10) is True
    assert time.monotonic() - started < 5


def test_wait_is_bounded_and_warns_at_most_once_a_minute(caplog):
    jobs, _ = table()
    jobs.start(1, "load", KEYS)
    with caplog.at_level(logging.WARNING, logger="kvtier_offload"):
        started = time.monotonic()
        assert jobs.wait(0.1) is False
        assert 0.09 < time.monotonic() - started < 5
        assert jobs.wait(0.01) is False
    assert caplog.text.count("1 job(s) still unfinished") == 1


def test_ok_prefix_ends_at_the_first_failure():
    outcome = JobOutcome(1, "load", KEYS, [True, False, True])
    assert outcome.ok_prefix == KEYS[:1] and not outcome.success
