"""Which stores may be written: a time budget for the write queue, backoff after the
volume refused a write, and a free-space floor.

- The queue: a store job is refused at submit where the bytes queued before it, at the
  measured aggregate drain rate, would take longer than queue_seconds; a block that
  waited longer than that by the time a thread takes it is dropped (stale). Dropped
  blocks are never reported stored. The queue drains at the rate of all `writers`
  threads together: each writer's measured rate (the bytes of the recent batches over
  the seconds they took) times the writers. A volume that does not scale with threads
  shows it in that per-writer rate, which falls as more of them write at once; one
  thread's own rate against the whole queue refused stores N_threads times too early.
- Backoff: a write failing with ENOSPC, EDQUOT, EIO, EACCES, EROFS or EPERM stops every
  writer for 1 s, doubling per failure up to 60 s; any write that succeeds resets it.
- The floor: no write that would leave less than floor_percent of the volume free.
  statvfs is re-read at most once a second, or every time near the floor; bytes approved
  since are reserved against it (statvfs cannot see bytes approved but not yet written,
  and a batch approves all its blocks first), so a burst cannot overshoot.

Thread-safe; one lock of its own.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque

BACKOFF_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EACCES, errno.EROFS,
                            errno.EPERM})
MAX_BACKOFF_SECONDS = 60.0
RATE_WINDOW_SECONDS = 10.0  # batches older than this no longer count toward the rate
RATE_BATCHES = 512  # at most this many recent batches are kept for it


class WriteAdmission:
    def __init__(self, directory: str, queue_seconds: float, floor_percent: float,
                 writers: int = 1) -> None:
        self._directory = directory  # statvfs'ed for the floor
        self.queue_seconds = queue_seconds
        self.writers = max(1, writers)  # threads that drain the queue together
        self.floor_percent = floor_percent
        self._lock = threading.Lock()
        self.rate = 0.0  # aggregate drain rate, bytes/s (0: not measured yet)
        self._batches: deque[tuple[float, float, int]] = deque(maxlen=RATE_BATCHES)
        self.queued_bytes = 0  # admitted, not yet settled
        self.unwritten_bytes = 0  # reserved against the floor, not yet settled
        self.blocked_until = 0.0  # monotonic; writers back off until then
        self._backoff = 0.0
        self._free_checked = (0.0, 0, 0)  # (when, free bytes left, floor bytes)

    def admit(self, nbytes: int) -> bool:
        """Queue a job of nbytes, unless the queue would then take longer than
        queue_seconds to write at the measured rate. Admitted bytes stay queued until
        settle()d."""
        with self._lock:
            if self.rate > 0 and (self.queued_bytes + nbytes) / self.rate > self.queue_seconds:
                return False
            self.queued_bytes += nbytes
        return True

    def late(self, enqueued: float, now: float) -> str | None:
        """Why a block queued at enqueued must not be written now ("stale": queued
        past its budget, "backoff": writers are backing off), or None."""
        if now - enqueued > self.queue_seconds:
            return "stale"
        if now < self.blocked_until:
            return "backoff"
        return None

    def free_space_ok(self, size: int) -> bool:
        """Whether writing size more bytes keeps the volume above its free-space floor;
        where it does, size is counted as taken until the next statvfs."""
        if self.floor_percent <= 0:
            return True  # no floor: the write itself finds out (ENOSPC backs off)
        now = time.monotonic()
        with self._lock:
            checked_at, free, floor = self._free_checked
            stale = now - checked_at >= 1.0 or free - size < 2 * floor
        if stale:
            try:
                st = os.statvfs(self._directory)
            except OSError:
                return True  # cannot tell: let the write itself find out
            with self._lock:
                free = st.f_bavail * st.f_frsize - self.unwritten_bytes
            floor = int(st.f_blocks * st.f_frsize * self.floor_percent / 100)
            checked_at = now
        with self._lock:
            ok = free - size >= floor
            self._free_checked = (checked_at, free - size if ok else free, floor)
        return ok

    def reserve(self, nbytes: int) -> None:
        """Count nbytes approved for writing against the floor until settle()d."""
        with self._lock:
            self.unwritten_bytes += nbytes

    def settle(self, queued: int, reserved: int) -> None:
        """Give back bytes admitted (queued) and reserved, once written or given up."""
        with self._lock:
            self.queued_bytes -= queued
            self.unwritten_bytes -= reserved

    def written(self, nbytes: int, seconds: float, blocks: int,
                now: float | None = None) -> None:
        """A batch of blocks, nbytes in all, was written by one thread in the seconds
        before now: the drain rate is recomputed over every writer's recent batches;
        any backoff ends."""
        self._backoff = 0.0
        end = time.monotonic() if now is None else now
        with self._lock:
            self._batches.append((end - max(seconds, 1e-6), end, nbytes))
            while self._batches and self._batches[0][1] < end - RATE_WINDOW_SECONDS:
                self._batches.popleft()
            total = sum(n for _, _, n in self._batches)
            took = sum(b - a for a, b, _ in self._batches)
            self.rate = total / max(took, 1e-6) * self.writers

    def failed(self, err: OSError) -> None:
        """A write failed: where the volume refused it (full, quota, read-only, I/O
        error, permissions), every writer backs off."""
        if err.errno in BACKOFF_ERRNOS:
            self._backoff = min(max(self._backoff * 2, 1.0), MAX_BACKOFF_SECONDS)
            self.blocked_until = time.monotonic() + self._backoff
