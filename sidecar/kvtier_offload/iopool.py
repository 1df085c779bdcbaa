"""A bounded pool of I/O threads with two queues: reads ahead of writes.

Read-preferring threads take loads first (a load blocks a request); write-preferring
threads take stores first; each steals from the other queue when its own is empty.

Many threads pay off where each file waits on a device or a network; where files complete
at memory speed the work is CPU, and the store starts one read-preferring thread per core
instead (more only trade the GIL back and forth).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

Task = Callable[[], None]


class IOPool:
    def __init__(self, read_threads: int, write_threads: int, name: str = "kvtier-io") -> None:
        self._reads: deque[Task] = deque()
        self._writes: deque[Task] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(prefer_reads,), daemon=True,
                             name=f"{name}-{'r' if prefer_reads else 'w'}{i}")
            for prefer_reads, count in ((True, read_threads), (False, write_threads))
            for i in range(max(count, 1 if prefer_reads else 0))
        ]
        for t in self._threads:
            t.start()

    def submit_read(self, task: Task) -> None:
        with self._cv:
            self._reads.append(task)
            self._cv.notify()

    def submit_write(self, task: Task) -> None:
        with self._cv:
            self._writes.append(task)
            self._cv.notify()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def _next(self, prefer_reads: bool) -> Task | None:
        first, second = (self._reads, self._writes) if prefer_reads else (
            self._writes, self._reads)
        with self._cv:
            while not first and not second:
                if self._closed:
                    return None
                self._cv.wait()
            return (first or second).popleft()

    def _work(self, prefer_reads: bool) -> None:
        while (task := self._next(prefer_reads)) is not None:
            task()  # tasks handle their own errors; the pool must never lose a thread

    def close(self) -> None:
        """Finish what is queued, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
