"""The operator's worker processes yield the CPU to the webhook and the handlers
(worker_process.init_worker): the observation's reading process runs SCHED_IDLE (the
kernel hands the CPU back the moment a normal task wakes; nice alone left admissions
1.4-1.6x slower at p99 with a round under way, benchmarks/observe.py); an admission
lane's worker takes nice only, since admissions must not wait behind a busy node; and
where the kernel or a seccomp profile refuses SCHED_IDLE the reader is niced and still
reads."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from kvtier_operator.admission_lanes import WORKER_NICENESS, spawn_pool
from kvtier_operator.observe.reading_process import NICENESS, ReadingProcess
from kvtier_operator.worker_process import init_worker


def _priority() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)


def assert_niced_not_idle(pool: ProcessPoolExecutor, niceness: int) -> None:
    """pool's worker runs the normal policy, `niceness` below this process."""
    try:
        policy, nice = pool.submit(_priority).result(60)
    finally:
        pool.shutdown()
    assert policy == os.SCHED_OTHER
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness)


def test_the_reading_process_runs_idle_policy():
    reading = ReadingProcess()
    try:
        pid = asyncio.run(reading.start()).submit(os.getpid).result(30)
        assert pid == reading.pid
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
    finally:
        reading.close()


def test_an_admission_worker_is_niced_but_not_idle():
    pool = spawn_pool(1)
    assert isinstance(pool, ProcessPoolExecutor)
    assert_niced_not_idle(pool, WORKER_NICENESS)


def _refused(*_args: object) -> None:
    raise PermissionError(1, "Operation not permitted")


def _init_refusing_idle(niceness: int) -> None:
    os.sched_setscheduler = _refused  # as a seccomp profile that refuses the call would
    init_worker(niceness, True)


def test_a_refused_idle_policy_leaves_the_reader_niced_and_reading():
    assert_niced_not_idle(ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_refusing_idle,
        initargs=(NICENESS,)), NICENESS)
