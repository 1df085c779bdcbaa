"""What every worker process the operator spawns does first (the admission lanes'
workers, the observation's reading process): run at a lower CPU priority, so on a busy
node the webhook and the handlers come first, and exit when the operator dies without
closing the pool (SIGKILL, OOM): a ProcessPoolExecutor's queues hold both pipe ends in
the worker, so no EOF would ever tell it, and it would outlive the operator.

Two strengths of "lower". Nice lowers a worker's share of a busy CPU, but not how soon a
waking thread gets the CPU back from it: under the kernel's fair scheduler (EEVDF) a
waking task may wait out the running task's slice, a few milliseconds, even at nice 19.
A worker whose work can wait (the observation's reads) runs SCHED_IDLE instead: the
kernel preempts an idle-policy task as soon as any normal task wakes on its CPU (the
operator's or another pod's), so an admission does not wait out its slice. It gets the cycles
nothing else on its CPU wants; on a busy node that can be less than a niced process
would get (its pod's weight on that CPU follows its runnable tasks' load). An admission
worker must not wait behind a busy node, so it only takes nice.
"""

from __future__ import annotations

import os
import threading
import time

PARENT_CHECK_SECONDS = 1.0


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(0)  # the operator is gone: nobody reads what this worker would send


def init_worker(niceness: int, idle: bool = False) -> None:
    """A ProcessPoolExecutor initializer: `niceness` added to the priority (where
    allowed), SCHED_IDLE where `idle` (where allowed; nice alone otherwise), and a daemon
    thread that ends the process once its parent is gone."""
    try:
        os.nice(niceness)
    except OSError:  # not permitted here: run at the operator's priority
        pass
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # a seccomp profile that refuses it: nice alone
            pass
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True,
                     name="kvtier-parent-watch").start()
