"""A lock file on the volume so two evictor runs never overlap.

The CronJob's concurrencyPolicy Forbid covers one CronJob; the lock also covers two
CronJobs (or a person) on the same volume. It is created with O_EXCL, which is atomic on
NFS v3+ too, and taken over when older than the stale timeout (a run killed hard leaves
its lock behind).
"""

from __future__ import annotations

import json
import os
import socket
import time

LOCK_NAME = ".kvtier-evictor.lock"


class LockHeld(RuntimeError):
    pass


class VolumeLock:
    def __init__(self, root: str, stale_seconds: float) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self.stale_seconds = stale_seconds
        self._held = False

    def acquire(self) -> None:
        body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.time()}).encode()
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    age = time.time() - os.stat(self.path).st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                if age < self.stale_seconds:
                    raise LockHeld(
                        f"another evictor run holds {self.path} (refreshed {age:.0f}s ago); "
                        f"it is taken over after {self.stale_seconds:.0f}s"
                    ) from None
                os.unlink(self.path)
                continue
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            self._held = True
            return
        raise LockHeld(f"could not take {self.path}")

    def refresh(self) -> None:
        if self._held:
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if self._held:
            self._held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> VolumeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
