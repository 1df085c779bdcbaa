"""The process the observation's reads run in (reads.read_round), off the operator's
event loop and its GIL.

Reading a thousand pages is CPU work (HTTP, prometheus_client's parser, the engines'
readers): on the operator's own loop it made admissions measurably slower while a round
ran (benchmarks/observe.py). Here it runs in one worker process of a
concurrent.futures.ProcessPoolExecutor (started with "spawn": the operator's process has
threads, which fork would copy mid-state; under SCHED_IDLE, so that the webhook and the
handlers get the CPU back from it the moment they wake: worker_process.py). What comes
back is one small ReadResult per pod, packed on its own (reads.read_round).

Bounded like everything read from pods: each pod's read has its deadline and caps inside
the worker, and the round as a whole has one here (`round_deadline`). A worker that
misses it, or dies (out of memory, a crash in a parser), is killed and replaced at the
next round; that round's pods each get the reason as their problem, never a figure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import signal
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from kvtier_operator.observe.reads import ReadJob, ReadResult, ReadSettings, pack, read_round
from kvtier_operator.worker_process import init_worker

log = logging.getLogger("kvtier_operator.observe")
NICENESS = 10  # the worker's, added to the operator's (where SCHED_IDLE is refused)
# SCHED_IDLE: with nice alone (10 or 19) admissions measured 1.24-1.82x slower at p99
# while a round ran (an older method); with it, within the intervals of a process that
# only burns CPU at that priority (benchmarks/observe.py, docs/benchmarks.md).
IDLE = True
START_SECONDS = 60.0  # a new worker's start (imports) on a busy node
SLACK_SECONDS = 30.0  # parsing and the readers, beyond the reads' own deadlines
PARSE_SHARE = 0.7  # of the round's deadline, after which the worker parses no more pages


def round_deadline(jobs: int, settings: ReadSettings) -> float:
    """The most a round of `jobs` reads may take: each batch of `concurrency` reads takes
    at most the per-pod timeout, twice over for slack, plus the parsing."""
    batches = math.ceil(jobs / max(1, settings.concurrency))
    return 2 * batches * settings.timeout + SLACK_SECONDS


def _log_priority(pid: int, idle: bool) -> None:
    """Say at what priority the worker runs: where SCHED_IDLE was refused (a seccomp
    profile, gVisor), admissions may wait on a round as they did with nice alone."""
    try:
        policy = os.sched_getscheduler(pid)
    except OSError:
        return
    if idle and policy != os.SCHED_IDLE:
        log.warning("the observation's reading process (pid %d) could not run SCHED_IDLE "
                    "here; it runs niced (+%d) instead, and admissions may wait behind a "
                    "round's reads", pid, NICENESS)
    else:
        log.info("the observation's reading process (pid %d) runs %s", pid,
                 "SCHED_IDLE" if policy == os.SCHED_IDLE else f"niced (+{NICENESS})")


class ReadingProcess:
    """One worker process, started at the first round, replaced when it fails. `idle`:
    SCHED_IDLE (the default, IDLE) or nice alone."""

    def __init__(self, idle: bool = IDLE) -> None:
        self.idle = idle
        self._pool: ProcessPoolExecutor | None = None
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    async def start(self) -> ProcessPoolExecutor:
        """The worker, started (imports take a second or two) where it is not yet."""
        if self._pool is None:
            pool = ProcessPoolExecutor(max_workers=1,
                                       mp_context=multiprocessing.get_context("spawn"),
                                       initializer=init_worker,
                                       initargs=(NICENESS, self.idle))
            try:
                self._pid = await asyncio.wait_for(
                    asyncio.wrap_future(pool.submit(os.getpid)), START_SECONDS)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            self._pool = pool
            _log_priority(self._pid, self.idle)
        return self._pool

    async def read(self, jobs: Sequence[ReadJob], settings: ReadSettings) -> list[bytes]:
        """Every job's result, in order, packed (reads.unpack); a failed worker's round:
        each job's problem."""
        if not jobs:
            return []
        deadline = round_deadline(len(jobs), settings)
        future: Future[list[bytes]] | None = None
        try:
            pool = await self.start()
            # Parses stop at PARSE_SHARE of the deadline inside the round (reads.LATE for
            # the rest): the deadline here is for a worker that hangs or dies.
            future = pool.submit(read_round, list(jobs), settings, PARSE_SHARE * deadline)
            return await asyncio.wait_for(asyncio.wrap_future(future), deadline)
        except TimeoutError:
            why = (f"the observation's reading process did not finish the round within "
                   f"{deadline:g} s; it was restarted")
        except (BrokenProcessPool, OSError, RuntimeError) as err:
            why = f"the observation's reading process failed ({err!r}); it was restarted"
        log.warning("%s", why)
        self.close()
        return [pack(ReadResult(problem=why))] * len(jobs)

    def close(self) -> None:
        """Stop the worker now (a round in flight ends with it)."""
        pool, pid = self._pool, self._pid
        self._pool = self._pid = None
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
