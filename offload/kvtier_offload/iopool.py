"""A bounded pool of I/O threads with two queues: reads ahead of writes.

Read-preferring threads take loads first (a load blocks a request); write-preferring
threads take stores first; each steals from the other queue when its own is empty.

With a store priority (store_nice > 0) the two kinds of thread stop sharing: stores run
only on the write threads, each lowered by store_nice at its start (a thread's nice value
is its own on Linux), so that on a starved host the engine's prefill goes ahead of the
copies and digests of background stores; loads run only on the read threads, at the
priority of the thread that made the pool (a load is on a request's critical path). A
thread's nice can be raised without privilege but not lowered again (RLIMIT_NICE, no
CAP_SYS_NICE in a default container), so one thread cannot switch between the two kinds.

Many threads pay off where each file waits on a device or a network; where files complete
at memory speed the work is CPU, and the store starts one read-preferring thread per core
instead (more only trade the GIL back and forth). The pool says how many threads a new
job could use right now (`spare`), so the store splits a job only as far as that.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

Task = Callable[[], None]
log = logging.getLogger(__name__)
MAX_NICE = 19  # the lowest priority a nice value gives on Linux


def lower_priority(by: int) -> int:
    """Lower the calling thread's CPU priority: its nice value raised by `by` (at most to
    19); returns the new nice value. OSError where this platform or process cannot."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        raise OSError("this platform has no per-thread setpriority")
    tid = threading.get_native_id()
    nice = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + by)
    os.setpriority(os.PRIO_PROCESS, tid, nice)
    return nice


class IOPool:
    def __init__(self, read_threads: int, write_threads: int, name: str = "kvtier-io",
                 store_nice: int = 0) -> None:
        """store_nice: 0, every thread takes either kind of task; more, each kind has its
        own threads and the write threads run this much nicer (needs a write thread)."""
        self._reads: deque[Task] = deque()
        self._writes: deque[Task] = deque()
        self.write_threads = max(write_threads, 0)  # take stores first; the rest loads
        self.read_threads = max(read_threads, 1)
        self.store_nice = max(store_nice, 0) if self.write_threads else 0
        lock = threading.Lock()
        if self.store_nice:  # each kind of thread waits for its own kind of task
            self._cv = {True: threading.Condition(lock), False: threading.Condition(lock)}
        else:
            shared = threading.Condition(lock)
            self._cv = {True: shared, False: shared}
        self._lock = lock
        self._closed = False
        self._priority_logged = False
        self._busy = {True: 0, False: 0}  # threads running a read (True) or write task
        self._threads = [
            threading.Thread(target=self._work, args=(prefer_reads,), daemon=True,
                             name=f"{name}-{'r' if prefer_reads else 'w'}{i}")
            for prefer_reads, count in ((True, self.read_threads),
                                        (False, self.write_threads))
            for i in range(count)
        ]
        for t in self._threads:
            t.start()

    def submit_read(self, task: Task, urgent: bool = False) -> None:
        """Queue a read; an urgent one goes ahead of every queued read (one the engine
        waits for in its step)."""
        with self._lock:
            if urgent:
                self._reads.appendleft(task)
            else:
                self._reads.append(task)
            self._cv[True].notify()

    def submit_write(self, task: Task) -> None:
        with self._lock:
            self._writes.append(task)
            self._cv[False].notify()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def busy(self) -> tuple[int, int]:
        """How many threads run a read task and a write task right now."""
        with self._lock:
            return self._busy[True], self._busy[False]

    def spare(self, reads: bool) -> int:
        """How many more tasks of a new job could start at once right now (0 or more):
        threads not running nor spoken for by a queued task. A read waits only for other
        reads (it goes ahead of queued writes, and takes the next thread a write frees);
        a write waits for everything. With a store priority each kind has its own
        threads and waits only for its own kind."""
        with self._lock:
            if self.store_nice:
                own = self.read_threads if reads else self.write_threads
                queued = self._reads if reads else self._writes
                return max(0, own - self._busy[reads] - len(queued))
            taken = self._busy[True] + len(self._reads)
            if not reads:
                taken += self._busy[False] + len(self._writes)
            return max(0, len(self._threads) - taken)

    def _next(self, prefer_reads: bool) -> tuple[Task, bool] | None:
        steals = not self.store_nice
        cv = self._cv[prefer_reads]
        with cv:
            while True:
                own, other = ((self._reads, self._writes) if prefer_reads
                              else (self._writes, self._reads))
                if own or (steals and other):
                    break
                if self._closed:
                    return None
                cv.wait()
            is_read = bool(self._reads) and (prefer_reads or not self._writes)
            self._busy[is_read] += 1
            return (self._reads if is_read else self._writes).popleft(), is_read

    def _lower_priority(self) -> None:
        try:
            nice = lower_priority(self.store_nice)
        except OSError as err:
            with self._lock:
                first, self._priority_logged = not self._priority_logged, True
            if first:
                log.warning("kvtier store threads keep the process's CPU priority "
                            "(store_nice %d not applied: %s); stores compete with the "
                            "engine for the CPU", self.store_nice, err)
            return
        log.debug("kvtier store thread %s at nice %s", threading.current_thread().name,
                  nice)

    def _work(self, prefer_reads: bool) -> None:
        if self.store_nice and not prefer_reads:
            self._lower_priority()
        while (taken := self._next(prefer_reads)) is not None:
            task, is_read = taken
            try:
                task()  # tasks handle their own errors; the pool must never lose a thread
            finally:
                with self._lock:
                    self._busy[is_read] -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then stop the threads, within timeout seconds (None: as
        long as it takes). False where time ran out: tasks not started by then are
        dropped and never run; a thread stuck in a task is left behind (daemon)."""
        with self._lock:
            self._closed = True
            self._cv[True].notify_all()
            self._cv[False].notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            return True
        with self._lock:
            self._reads.clear()
            self._writes.clear()
        return False
