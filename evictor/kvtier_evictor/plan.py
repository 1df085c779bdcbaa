"""Free space in the fewest files: how many of the least-recently-used files must go
when a directory the run empties goes with them.

Removing a cache file whose directory then stands empty frees the directory too (its
blocks and its inode), and so on up the fan-out. Counting that, the oldest files reach
the target sooner than their own bytes say; deleting by file bytes alone removes up to
twice as many files as needed on a tree of small files.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from kvtier_evictor.scan import Candidate, DirInfo


class DirTally:
    """What is left in each removable directory the scan saw, as this run deletes: a
    directory stands empty (as far as the scan knows) when its count reaches zero, and
    may then be removed if it was old before the run. Shared by the deleting threads."""

    def __init__(self, directories: dict[str, DirInfo]) -> None:
        self.directories = directories
        self._left = {path: info.entries for path, info in directories.items()}
        self._lock = threading.Lock()

    def removed_from(self, directory: str, count: int = 1) -> bool:
        """Count names removed from a directory; True where it now stands empty and
        may go (a removable level, untouched for the guard before the scan)."""
        with self._lock:
            left = self._left.get(directory)
            if left is None:
                return False
            self._left[directory] = left = left - count
        return left <= 0 and self.directories[directory].old

    def fewest(self, oldest_first: Sequence[Candidate], want_bytes: int, want_inodes: int,
               dir_bytes: bool = True) -> int:
        """How many of the oldest candidates reach want_bytes and want_inodes, counting
        each directory they empty (its bytes where dir_bytes, its inode always); all of
        them where even that falls short. Called between deletions, not during them."""
        if want_bytes <= 0 and want_inodes <= 0:
            return 0
        base = self._left
        left: dict[str, int] = {}  # this plan's view, over what is left now
        freed_bytes = freed_inodes = 0
        for n, cand in enumerate(oldest_first, 1):
            freed_bytes += cand.size
            freed_inodes += 1
            directory = os.path.dirname(cand.path)
            while directory in base:
                count = left.get(directory, base[directory]) - 1
                left[directory] = count
                info = self.directories[directory]
                if count != 0 or not info.old:
                    break
                freed_bytes += info.bytes if dir_bytes else 0
                freed_inodes += 1
                directory = os.path.dirname(directory)
            if freed_bytes >= want_bytes and freed_inodes >= want_inodes:
                return n
        return len(oldest_first)
