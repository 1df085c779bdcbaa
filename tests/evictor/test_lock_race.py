"""Two evictor runs that find the same stale lock: exactly one ends up holding it."""

from __future__ import annotations

import os
import time

import pytest

from kvtier_evictor import lock as lock_module
from kvtier_evictor.lock import LOCK_NAME, LockHeld, VolumeLock


def stale_lock(root) -> str:
    path = os.path.join(root, LOCK_NAME)
    with open(path, "w") as f:
        f.write("{}")
    old = time.time() - 7200
    os.utime(path, (old, old))
    return path


def test_two_runs_taking_over_the_same_stale_lock_do_not_both_hold_it(tmp_path,
                                                                      monkeypatch):
    """Run B judges the lock stale; before it acts, run A takes the same stale lock over
    and holds a fresh one. B must not delete A's fresh lock."""
    path = stale_lock(tmp_path)
    a, b = VolumeLock(str(tmp_path), 3600), VolumeLock(str(tmp_path), 3600)
    real_stat = os.stat
    armed = [True]

    def stat(p, *args, **kw):
        result = real_stat(p, *args, **kw)
        if armed[0] and os.fspath(p) == path:
            armed[0] = False
            a.acquire()  # A wins the takeover between B's stat and B's next step
        return result

    monkeypatch.setattr(lock_module.os, "stat", stat)
    with pytest.raises(LockHeld):
        b.acquire()
    monkeypatch.setattr(lock_module.os, "stat", real_stat)
    a_inode = real_stat(path).st_ino
    a.refresh()  # A still holds the lock at the path: no LockLost
    assert real_stat(path).st_ino == a_inode
    assert [n for n in os.listdir(tmp_path) if n != LOCK_NAME] == []  # nothing aside
    a.release()
    assert not os.path.exists(path)


def test_a_run_whose_lock_was_taken_over_stops(tmp_path):
    from kvtier_evictor.lock import LockLost

    a = VolumeLock(str(tmp_path), 3600)
    a.acquire()
    os.unlink(a.path)  # taken over: someone else's lock now stands there
    b = VolumeLock(str(tmp_path), 3600)
    b.acquire()
    with pytest.raises(LockLost):
        a.refresh()
    a.release()  # must not remove b's lock
    assert os.path.exists(b.path)
    b.release()


def test_a_stale_lock_alone_is_taken_over(tmp_path):
    stale_lock(tmp_path)
    run = VolumeLock(str(tmp_path), 3600)
    run.acquire()
    run.refresh()
    assert time.time() - os.stat(run.path).st_mtime < 60
    assert os.listdir(tmp_path) == [LOCK_NAME]
    run.release()
