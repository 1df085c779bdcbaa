"""Parallel scan of a cache layout: LRU candidates in a bounded heap, stale temp files,
old empty directories, and what each removable directory held before this run deleted
anything (so a directory the run empties can go in the same run).

Memory stays bounded by what must be freed: the heap keeps only the oldest files whose
sizes add up to the bytes (and count up to the inodes) to free, never a list of every
file.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier_evictor.layouts import Kind, Layout


class Candidate(NamedTuple):
    last_use: float
    size: int
    path: str
    # Which file the scan saw there: deletion re-checks that the name still holds it.
    dev: int = 0
    ino: int = 0


def last_use(st: os.stat_result) -> float:
    """The later of atime and mtime: the backend refreshes atime on hits, and mtime is
    the write time on noatime mounts."""
    return max(st.st_atime, st.st_mtime)


def disk_bytes(st: os.stat_result) -> int:
    allocated = getattr(st, "st_blocks", 0) * 512
    return allocated if allocated > 0 else st.st_size


class LruSelection:
    """The oldest files covering `bytes_needed` bytes and `files_needed` files.

    A max-heap on last use: while the newest kept file is not needed to reach either
    target, it is dropped, so the heap never holds more than the targets require.
    """

    def __init__(self, bytes_needed: int, files_needed: int) -> None:
        self.bytes_needed = max(bytes_needed, 0)
        self.files_needed = max(files_needed, 0)
        self._heap: list[tuple[float, int, str, int, int]] = []  # (-last_use, size, path,
        # dev, ino)
        self._bytes = 0
        self._lock = threading.Lock()

    def offer(self, when: float, size: int, path: str, dev: int = 0, ino: int = 0) -> None:
        self.offer_many([(when, size, path, dev, ino)])

    def offer_many(self, items: list[tuple[float, int, str, int, int]]) -> None:
        """Offer one directory's files at once: one lock round trip, not one per file."""
        if not items or (self.bytes_needed == 0 and self.files_needed == 0):
            return
        with self._lock:
            heap = self._heap
            for when, size, path, dev, ino in items:
                if heap and self._satisfied(0) and -heap[0][0] <= when:
                    continue  # newer than everything kept, and we already have enough
                heapq.heappush(heap, (-when, size, path, dev, ino))
                self._bytes += size
                while heap:
                    top_size = heap[0][1]
                    if (self._bytes - top_size >= self.bytes_needed
                            and len(heap) - 1 >= self.files_needed):
                        heapq.heappop(heap)
                        self._bytes -= top_size
                    else:
                        break

    def _satisfied(self, extra: int) -> bool:
        return self._bytes + extra >= self.bytes_needed and len(self._heap) >= self.files_needed

    def __len__(self) -> int:
        return len(self._heap)

    def oldest_first(self) -> list[Candidate]:
        return [Candidate(-neg, size, path, dev, ino)
                for neg, size, path, dev, ino in sorted(self._heap, reverse=True)]


class DirInfo(NamedTuple):
    """A removable cache directory as the scan found it, before this run's deletions
    (which bump its mtime)."""
    bytes: int  # allocated: what removing it frees
    entries: int  # names in it: it stands empty once as many are gone
    old: bool  # untouched by any writer for dir_guard_seconds before the scan


@dataclass
class ScanTotals:
    files: int = 0
    block_bytes: int = 0
    temp_bytes: int = 0
    skipped_recent: int = 0
    stale_temps: list[Candidate] = field(default_factory=list)  # last_use: the mtime
    empty_dirs: list[str] = field(default_factory=list)
    directories: dict[str, DirInfo] = field(default_factory=dict)  # removable levels only
    errors: list[str] = field(default_factory=list)
    threads: int = 1  # how many threads the scan chose (deletion uses as many)
    dirs: int = 0

    @property
    def calls(self) -> int:
        return self.files + self.dirs

    def add(self, other: ScanTotals) -> None:
        self.files += other.files
        self.dirs += other.dirs
        self.block_bytes += other.block_bytes
        self.temp_bytes += other.temp_bytes
        self.skipped_recent += other.skipped_recent
        self.stale_temps += other.stale_temps
        self.empty_dirs += other.empty_dirs
        self.directories.update(other.directories)
        self.errors += other.errors


def _scandir(path: str, totals: ScanTotals) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []  # removed under us by a writer's cleanup or another tool
    except OSError as err:
        totals.errors.append(f"scandir {path}: {err.strerror or err}")
        return []


def units(root: str, layout: Layout) -> Iterator[tuple[str, int]]:
    """Directories at the layout's parallel level (or above it where the tree is short)."""

    def descend(path: str, level: int) -> Iterator[tuple[str, int]]:
        if level == layout.parallel_level:
            yield path, level
            return
        for entry in _scandir(path, ScanTotals()):
            if layout.dir_matches(level, entry.name) and entry.is_dir(follow_symlinks=False):
                yield from descend(entry.path, level + 1)

    if layout.parallel_level == 0:
        yield root, 0
    else:
        yield from descend(root, 0)


@dataclass
class ScanRules:
    now: float
    min_idle_seconds: float
    temp_guard_seconds: float
    dir_guard_seconds: float


def scan_unit(path: str, level: int, layout: Layout, rules: ScanRules,
              selection: LruSelection | None) -> ScanTotals:
    """Walk one unit's subtree; `level` is the index of the pattern its children match."""
    totals = ScanTotals()

    def walk(directory: str, lvl: int) -> None:
        removable = lvl > layout.first_removable_level  # lvl: its children's level
        if removable:  # its age and size before anything here is deleted
            totals.dirs += 1  # one more call to time (scan's thread choice)
            try:
                dir_st = os.stat(directory, follow_symlinks=False)
            except OSError:
                removable = False  # gone or unreadable: nothing to remove
        entries = _scandir(directory, totals)
        totals.dirs += 1
        if removable:
            old = rules.now - dir_st.st_mtime >= rules.dir_guard_seconds
            totals.directories[directory] = DirInfo(dir_st.st_blocks * 512, len(entries), old)
            if not entries and old:
                totals.empty_dirs.append(directory)
        if not entries:
            return
        at_leaf = lvl == len(layout.dir_levels)
        offers: list[tuple[float, int, str, int, int]] = []
        for entry in entries:
            if not at_leaf:
                if layout.dir_matches(lvl, entry.name) and entry.is_dir(follow_symlinks=False):
                    walk(entry.path, lvl + 1)
                continue
            kind = layout.classify(entry.name)
            if kind is None:
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as err:
                totals.errors.append(f"stat {entry.path}: {err.strerror or err}")
                continue
            size = disk_bytes(st)
            if kind is Kind.TEMP:
                totals.temp_bytes += size
                if rules.now - st.st_mtime >= rules.temp_guard_seconds:
                    totals.stale_temps.append(Candidate(st.st_mtime, size, entry.path,
                                                        st.st_dev, st.st_ino))
                continue
            totals.files += 1
            totals.block_bytes += size
            used = last_use(st)
            if rules.now - used < rules.min_idle_seconds:
                totals.skipped_recent += 1
            elif selection is not None:
                offers.append((used, size, entry.path, st.st_dev, st.st_ino))
        if selection is not None:
            selection.offer_many(offers)

    walk(path, level)
    return totals


# Above this many seconds of wall time per metadata call (a stat or a directory read),
# calls are waiting on a server (NFS, Lustre, CephFS, EFS) and threads overlap the waits.
# Below it the filesystem is local and fast, and Python threads only add GIL handoffs.
SLOW_SECONDS_PER_CALL = 100e-6
AUTO_THREADS = 16


def scan(root: str, layout: Layout, rules: ScanRules, selection: LruSelection | None,
         threads: int) -> ScanTotals:
    """Scan every unit; threads <= 0 picks 1 or AUTO_THREADS from how long the first
    unit took per file. The choice is returned in totals.threads."""
    totals = ScanTotals()
    work = list(units(root, layout))
    if threads <= 0:
        start = time.perf_counter()
        while work and totals.calls < 512:  # time enough calls to judge the filesystem
            path, lvl = work.pop(0)
            totals.add(scan_unit(path, lvl, layout, rules, selection))
        per_call = (time.perf_counter() - start) / max(totals.calls, 1)
        threads = AUTO_THREADS if per_call > SLOW_SECONDS_PER_CALL else 1
    totals.threads = threads
    if threads == 1:
        for path, lvl in work:
            totals.add(scan_unit(path, lvl, layout, rules, selection))
        return totals
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(scan_unit, path, lvl, layout, rules, selection)
                   for path, lvl in work]
        for future in futures:
            totals.add(future.result())
    return totals
