"""What every worker process the operator spawns does first (the admission lanes'
workers, the observation's reading process): run at a lower CPU priority, so on a busy
node the webhook and the handlers come first, and exit when the operator dies without
closing the pool (SIGKILL, OOM): a ProcessPoolExecutor's queues hold both pipe ends in
the worker, so no EOF would ever tell it, and it would outlive the operator.
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


def init_worker(niceness: int) -> None:
    """A ProcessPoolExecutor initializer: `niceness` added to the priority (where
    allowed), and a daemon thread that ends the process once its parent is gone."""
    try:
        os.nice(niceness)
    except OSError:  # not permitted here: run at the operator's priority
        pass
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True,
                     name="kvtier-parent-watch").start()
