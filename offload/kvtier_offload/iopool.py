"""A bounded pool of I/O threads with two queues: reads ahead of writes.

Read-preferring threads take loads first (a load blocks a request); write-preferring
threads take stores first; each steals from the other queue when its own is empty.

Many threads pay off where each file waits on a device or a network; where files complete
at memory speed the work is CPU, and the store starts one read-preferring thread per core
instead (more only trade the GIL back and forth). The pool says how many threads a new
job could use right now (`spare`), so the store splits a job only as far as that.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

Task = Callable[[], None]


class IOPool:
    def __init__(self, read_threads: int, write_threads: int, name: str = "kvtier-io") -> None:
        self._reads: deque[Task] = deque()
        self._writes: deque[Task] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._busy = {True: 0, False: 0}  # threads running a read (True) or write task
        self.write_threads = max(write_threads, 0)  # take stores first; the rest loads
        self._threads = [
            threading.Thread(target=self._work, args=(prefer_reads,), daemon=True,
                             name=f"{name}-{'r' if prefer_reads else 'w'}{i}")
            for prefer_reads, count in ((True, read_threads), (False, write_threads))
            for i in range(max(count, 1 if prefer_reads else 0))
        ]
        for t in self._threads:
            t.start()

    def submit_read(self, task: Task, urgent: bool = False) -> None:
        """Queue a read; an urgent one goes ahead of every queued read (one the engine
        waits for in its step)."""
        with self._cv:
            if urgent:
                self._reads.appendleft(task)
            else:
                self._reads.append(task)
            self._cv.notify()

    def submit_write(self, task: Task) -> None:
        with self._cv:
            self._writes.append(task)
            self._cv.notify()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def busy(self) -> tuple[int, int]:
        """How many threads run a read task and a write task right now."""
        with self._cv:
            return self._busy[True], self._busy[False]

    def spare(self, reads: bool) -> int:
        """How many more tasks of a new job could start at once right now (0 or more):
        threads not running nor spoken for by a queued task. A read waits only for other
        reads (it goes ahead of queued writes, and takes the next thread a write frees);
        a write waits for everything."""
        with self._cv:
            taken = self._busy[True] + len(self._reads)
            if not reads:
                taken += self._busy[False] + len(self._writes)
            return max(0, len(self._threads) - taken)

    def _next(self, prefer_reads: bool) -> tuple[Task, bool] | None:
        with self._cv:
            while not self._reads and not self._writes:
                if self._closed:
                    return None
                self._cv.wait()
            is_read = bool(self._reads) and (prefer_reads or not self._writes)
            self._busy[is_read] += 1
            return (self._reads if is_read else self._writes).popleft(), is_read

    def _work(self, prefer_reads: bool) -> None:
        while (taken := self._next(prefer_reads)) is not None:
            task, is_read = taken
            try:
                task()  # tasks handle their own errors; the pool must never lose a thread
            finally:
                with self._cv:
                    self._busy[is_read] -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then stop the threads, within timeout seconds (None: as
        long as it takes). False where time ran out: tasks not started by then are
        dropped and never run; a thread stuck in a task is left behind (daemon)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            return True
        with self._cv:
            self._reads.clear()
            self._writes.clear()
        return False
