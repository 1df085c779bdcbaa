"""Jobs: a load or store of many blocks, submitted at once, finished block by block on
the I/O threads, its outcome kept until the caller takes it.

`JobTable` is thread-safe: the I/O threads report results, the caller polls finished()
and may wait for every job to finish (bounded: a thread stuck on a hung mount must not
hang the caller for good).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvtier_offload")

Result = tuple[int, bool, int]  # (block index in its job, ok, bytes moved)


@dataclass
class JobOutcome:
    job_id: int
    kind: str  # "store" or "load"
    keys: list[bytes]
    ok: list[bool]
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def success(self) -> bool:
        return all(self.ok)

    @property
    def ok_prefix(self) -> list[bytes]:
        """Keys loaded before the first failure: a prefix is what a cache can use."""
        out = []
        for key, ok in zip(self.keys, self.ok, strict=True):
            if not ok:
                break
            out.append(key)
        return out


@dataclass
class Job:
    outcome: JobOutcome
    remaining: int  # blocks not yet reported
    started: float = field(default_factory=time.monotonic)


def time_left(deadline: float | None) -> float | None:
    """Seconds until deadline (monotonic), at least 0; None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class JobTable:
    """Unfinished jobs and the outcomes of finished ones not yet taken.

    depth: a gauge per kind ("store", "load") counting blocks submitted and not yet
    reported (metrics.Metrics.in_queue). `lock` guards the table and `outcomes`."""

    def __init__(self, depth: Mapping[str, Any]) -> None:
        self._depth = depth
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self._jobs: dict[int, Job] = {}
        self.outcomes: deque[JobOutcome] = deque()
        self._unfinished_logged = -math.inf  # when wait() last warned (monotonic)

    def start(self, job_id: int, kind: str, keys: list[bytes]) -> Job:
        """A new job of len(keys) blocks, every one failed until reported otherwise; a job
        of no blocks is finished at once."""
        job = Job(JobOutcome(job_id, kind, keys, [False] * len(keys)), remaining=len(keys))
        with self.lock:
            self._jobs[job_id] = job
        self._depth[kind].inc(len(keys))
        if not keys:
            self._finish(job)
        return job

    def report(self, job: Job, results: Sequence[Result]) -> None:
        """Record results of a job's blocks (each block once); the last one finishes it."""
        if not results:
            return  # finished already, or not yet: nothing here may finish it again
        with self.lock:
            for index, ok, nbytes in results:
                job.outcome.ok[index] = ok
                job.outcome.nbytes += nbytes if ok else 0
            job.remaining -= len(results)
            last = job.remaining == 0
        self._depth[job.outcome.kind].dec(len(results))
        if last:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        job.outcome.seconds = time.monotonic() - job.started
        with self.lock:
            self._jobs.pop(job.outcome.job_id, None)
            self.outcomes.append(job.outcome)
            self._idle.notify_all()

    def finished(self) -> list[JobOutcome]:
        """Outcomes of the jobs finished since the last call."""
        with self.lock:
            out = list(self.outcomes)
            self.outcomes.clear()
        return out

    def pending(self) -> int:
        with self.lock:
            return len(self._jobs)

    def wait(self, timeout: float | None) -> bool:
        """Wait until every job started has finished, at most timeout seconds (None: as
        long as it takes). False where some were still unfinished then, logged at most
        once a minute (a caller may poll)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self._jobs:
                left = time_left(deadline)
                if left is not None and left <= 0:
                    unfinished = len(self._jobs)
                    break
                self._idle.wait(left)
            else:
                return True
            now = time.monotonic()
            warn = timeout and now - self._unfinished_logged >= 60.0
            if warn:
                self._unfinished_logged = now
        if warn:
            log.warning("kvtier: %d job(s) still unfinished after waiting %.1fs; an I/O "
                        "thread may be stuck on the volume", unfinished, timeout)
        return False
