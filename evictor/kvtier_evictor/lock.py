"""A lock file on the volume so two evictor runs never overlap.

The CronJob's concurrencyPolicy Forbid covers one CronJob; the lock also covers two
CronJobs (or a person) on the same volume. It is created with O_EXCL, which is atomic on
NFS v3+ too, and taken over when older than the stale timeout (a run killed hard leaves
its lock behind).

Taking over is rename-then-verify: the stale lock is renamed aside (of two runs that
found it stale, one rename wins) and the file moved is checked to be the very one judged
stale (inode and mtime). A run that moved a fresh lock instead (another run took over in
between) puts it back and gives up. The holder checks on each refresh that the lock at
the path is still its own, and stops (LockLost) where it is not.

Anyone who can write the volume can leave a file at the lock's name, so a lock counts as
held only while it is fresh by a clock that can be believed: an mtime more than
CLOCK_SKEW_SECONDS in the future is stale (`touch -d 2076-01-01` would otherwise stop
eviction for good), and so is a file older than MALFORMED_GRACE_SECONDS whose body is not
an evictor's (a run writes its body right after creating the file).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time

LOCK_NAME = ".kvtier-evictor.lock"
CLOCK_SKEW_SECONDS = 60.0  # nodes' clocks may differ this much; a later mtime is forged
MALFORMED_GRACE_SECONDS = 10.0  # a new lock's body is written right after its creation
BODY_LIMIT = 4096
BODY_KEYS = frozenset({"pid", "host", "since", "token"})


class LockHeld(RuntimeError):
    def __init__(self, message: str, held_seconds: float | None = None) -> None:
        super().__init__(message)
        self.held_seconds = held_seconds  # since the holder last refreshed, where known


class LockLost(LockHeld):
    """The lock file at the path is no longer the one this run created."""


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_dev, st.st_ino, st.st_mtime_ns


class VolumeLock:
    def __init__(self, root: str, stale_seconds: float) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self.stale_seconds = stale_seconds
        self._held = False
        self._body = b""

    def acquire(self) -> None:
        body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.time(), "token": secrets.token_hex(16)}).encode()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    st = os.stat(self.path, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                age = time.time() - st.st_mtime
                if not self._stale(age):
                    raise LockHeld(
                        f"another evictor run holds {self.path} (refreshed {age:.0f}s ago); "
                        f"it is taken over after {self.stale_seconds:.0f}s",
                        held_seconds=age) from None
                self._take_over(st)
                continue
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            self._body = body
            self._held = True
            return
        raise LockHeld(f"could not take {self.path}")

    def _stale(self, age: float) -> bool:
        """Whether a lock refreshed age seconds ago may be taken over."""
        if age >= self.stale_seconds or age < -CLOCK_SKEW_SECONDS:
            return True
        return age >= MALFORMED_GRACE_SECONDS and not _an_evictors(self.path)

    def _take_over(self, stale: os.stat_result) -> None:
        """Remove the stale lock judged by `stale`, and nothing else."""
        aside = f"{self.path}.{secrets.token_hex(8)}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run moved it first; O_EXCL decides who goes on
        moved = os.stat(aside, follow_symlinks=False)
        if _identity(moved) == _identity(stale):
            os.unlink(aside)
            return
        # Another run took over between our stat and our rename: that fresh lock is
        # theirs. Put it back (link fails where a newer one is there: then its owner
        # finds it lost on its next refresh) and give up.
        try:
            os.link(aside, self.path)
        except FileExistsError:
            pass
        os.unlink(aside)
        raise LockHeld(f"another evictor run took over the stale {self.path} first")

    def refresh(self) -> None:
        """Keep the lock fresh; LockLost where the file at the path is not ours."""
        if not self._held:
            return
        if not self._ours():
            self._held = False
            raise LockLost(f"{self.path} is no longer this run's lock (taken over); "
                           "stopping")
        try:
            os.utime(self.path)
        except OSError:
            pass

    def release(self) -> None:
        if self._held:
            self._held = False
            if self._ours():
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass

    def _ours(self) -> bool:
        """Whether the lock file at the path is the one this run wrote (its token)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            return os.read(fd, len(self._body) + 1) == self._body
        finally:
            os.close(fd)

    def __enter__(self) -> VolumeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _an_evictors(path: str) -> bool:
    """Whether the file at path holds an evictor run's lock body (bounded read, no
    symlink followed, never blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True  # gone or unreadable: judged by its age alone
    try:
        body = os.read(fd, BODY_LIMIT + 1)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        data = json.loads(body) if len(body) <= BODY_LIMIT else None
    except ValueError:
        return False
    return isinstance(data, dict) and BODY_KEYS <= data.keys()
