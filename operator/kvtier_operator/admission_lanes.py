"""Where admissions run: never on the event loop, and never without a bound.

Two lanes, chosen by the size of the request body:

- quick: bodies up to LaneLimits.small_body (64 KiB; a real pod is a few KiB) run in a
  small thread pool. Their work is small, so the threads only briefly compete with the
  event loop for the GIL, and a slow one (a bug, or a pathological small input) delays
  the others by the interpreter's switch interval, not by its own length.
- bulk: larger bodies run in one worker process. The costly parts of an admission over a
  large body are C calls that hold the GIL from start to end (json over megabytes, a
  regex search over a 2.5 MB script took 0.7 s), so in a thread they would stall the event
  loop as surely as on it. In a process they cost the loop nothing but the copy of the
  body and of the answer; one worker leaves the other core to the loop.

Each lane admits at most `*_pending` requests at a time (running or queued). Past that a
request is answered at once with HTTP 503 and a JSON error: the API server then applies
the webhook's failurePolicy (pods: admitted without injection, which the reconciler reports
as pending; TieredPrefixCaches: refused, to be retried). Each admission also has a
deadline, below the API server's webhook timeout (5 s in the chart): past it the answer is
a 503 too. Work cannot be stopped from outside a thread, so an admission past its deadline
keeps its lane slot until it ends; the pending bound therefore holds at all times.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from kvtier_operator.admission import Outcome, admit
from kvtier_operator.cache_registry import CacheRegistry
from kvtier_operator.context import RenderContext
from kvtier_operator.worker_process import init_worker

log = logging.getLogger("kvtier_operator.webhook")
BUSY_LOG_INTERVAL = 60.0  # seconds between "busy" warnings (each counts the 503s since)


@dataclass(frozen=True)
class LaneLimits:
    small_body: int = 64 * 1024  # bytes; larger bodies go to the bulk lane
    quick_workers: int = 4
    quick_pending: int = 64
    bulk_workers: int = 1
    bulk_pending: int = 2
    deadline: float = 4.0  # seconds per admission, under the chart's webhook timeout


WORKER_NICENESS = 10  # the bulk worker yields the CPU to the event loop's process


def spawn_pool(workers: int) -> Executor:
    """Worker processes started fresh (spawn): the operator process runs threads (kopf,
    the API client), which fork would copy in whatever state they were in. They run at a
    lower CPU priority, so on a small node a large admission slows the small ones less."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=init_worker, initargs=(WORKER_NICENESS,))


def _ready() -> bool:
    return True


class _Lane:
    def __init__(self, name: str, make: Callable[[], Executor], pending: int) -> None:
        self.name, self._make, self.pending = name, make, pending
        self._executor: Executor | None = None
        self._lock = threading.Lock()
        self.in_flight = 0
        self.busy_answers = 0  # 503s since the last "busy" warning (rate-limited)
        self.busy_logged: float | None = None

    def executor(self) -> Executor:
        if self._executor is None:
            self._executor = self._make()
        return self._executor

    def try_submit(self, fn: Callable[..., Outcome], *args: object) -> Future[Outcome] | None:
        with self._lock:
            if self.in_flight >= self.pending:
                return None
            self.in_flight += 1
        try:
            try:
                future = self.executor().submit(fn, *args)
            except BrokenProcessPool:
                self.reset()
                future = self.executor().submit(fn, *args)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return future

    def _release(self, _: object) -> None:
        with self._lock:
            self.in_flight -= 1

    def reset(self) -> None:
        """Drop a broken executor (a worker process died); the next request makes one."""
        broken, self._executor = self._executor, None
        if broken is not None:
            broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class AdmissionLanes:
    """Runs `admission.admit` off the event loop, bounded per lane and per request."""

    def __init__(self, limits: LaneLimits | None = None,
                 bulk_pool: Callable[[int], Executor] = spawn_pool) -> None:
        self.limits = limits = limits or LaneLimits()
        self.quick = _Lane("quick", lambda: ThreadPoolExecutor(
            limits.quick_workers, thread_name_prefix="kvtier-admission"), limits.quick_pending)
        self.bulk = _Lane("bulk", lambda: bulk_pool(limits.bulk_workers), limits.bulk_pending)

    async def warm(self) -> None:
        """Start the bulk worker process now rather than on the first large request."""
        await asyncio.wrap_future(self.bulk.executor().submit(_ready))

    async def admit(self, path: str, body: bytes, caches: CacheRegistry,
                    ctx: RenderContext) -> Outcome:
        if len(body) > self.limits.small_body:
            lane, future = self.bulk, self.bulk.try_submit(admit, path, body, caches.view(), ctx)
        else:
            lane, future = self.quick, self.quick.try_submit(admit, path, body, caches, ctx)
        if future is None:
            lane.busy_answers += 1
            now = time.monotonic()
            if lane.busy_logged is None or now - lane.busy_logged >= BUSY_LOG_INTERVAL:
                log.warning("admission webhook busy: %d request(s) answered 503 since the last "
                            "such warning (%s lane full: %d admissions in progress)",
                            lane.busy_answers, lane.name, lane.in_flight)
                lane.busy_logged, lane.busy_answers = now, 0
            return Outcome.error(503, f"the kvtier webhook is busy ({lane.name} lane full); "
                                      "retry later")
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.limits.deadline)
        except TimeoutError:
            log.warning("a %d-byte admission to %s took over %.1f s; answered 503",
                        len(body), path, self.limits.deadline)
            return Outcome.error(503, f"admission took over {self.limits.deadline:g} s; "
                                      "retry later")
        except BrokenProcessPool:
            lane.reset()
            log.warning("the admission worker process died; starting a new one")
            return Outcome.error(503, "the kvtier webhook's worker failed; retry later")

    def close(self) -> None:
        self.quick.close()
        self.bulk.close()
