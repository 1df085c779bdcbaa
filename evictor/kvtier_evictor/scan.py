"""Parallel scan of a cache layout: LRU candidates in a bounded heap, stale temp files,
old empty directories, and what each removable directory held before this run deleted
anything (so a directory the run empties can go in the same run).

Memory stays bounded whatever the tree: the heap keeps only the oldest files whose sizes
add up to the bytes (and count up to the inodes) to free, and never more than its
max_files (the run then frees in passes, each scanning again); a leaf directory's names
are streamed and offered in slices of OFFER_SLICE, never listed whole; stale temp files
and empty directories kept for one pass are capped too (MAX_LEFTOVERS).
"""

from __future__ import annotations

import errno
import heapq
import os
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier_evictor.layouts import Layout

OFFER_SLICE = 4096  # a unit's files are offered to the selection this many at a time
MAX_LEFTOVERS = 100_000  # stale temp files, and empty directories, kept for one pass


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

    def __init__(self, bytes_needed: int, files_needed: int,
                 max_files: int | None = None) -> None:
        self.bytes_needed = max(bytes_needed, 0)
        self.files_needed = max(files_needed, 0)
        self.max_files = max_files  # the memory bound: past it the newest kept file goes
        self.capped = False  # whether the bound dropped a file the targets still needed
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
                    elif self.max_files is not None and len(heap) > self.max_files:
                        heapq.heappop(heap)  # still needed, but past the bound: next pass
                        self._bytes -= top_size
                        self.capped = True
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


# Every directory below the root is opened relative to its parent without following a
# symlink (a symlink or a file in a directory's place: ELOOP or ENOTDIR, left alone), read
# through that fd, and its files stat'ed by name relative to it (fstatat): no path is
# walked, so no directory swapped for a symlink can lead the scan outside the tree, and a
# file costs one short lookup instead of a walk of every directory above it. The root
# itself is opened as given (see anchored.py).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_BELOW_FLAGS = _DIR_FLAGS | os.O_NOFOLLOW
_REPLACED = frozenset({errno.ELOOP, errno.ENOTDIR})


def _open_below(name: str, parent_fd: int, path: str, totals: ScanTotals) -> int | None:
    """An fd of the directory `name` in parent_fd; None where it is gone, is no directory
    (a file or a symlink stands there) or cannot be opened (an error)."""
    try:
        return os.open(name, _BELOW_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return None  # removed under us by a writer's cleanup or another tool
    except OSError as err:
        if err.errno not in _REPLACED:
            totals.errors.append(f"open {path}: {err.strerror or err}")
        return None


def _listdir(fd: int, path: str, totals: ScanTotals) -> list[str] | None:
    """The names in the directory open as fd; None where it cannot be read."""
    try:
        with os.scandir(fd) as it:
            return [entry.name for entry in it]
    except FileNotFoundError:
        return None
    except OSError as err:
        totals.errors.append(f"scandir {path}: {err.strerror or err}")
        return None


def units(root: str, layout: Layout) -> Iterator[tuple[str, int, tuple[str, ...]]]:
    """Directories at the layout's parallel level (or above it where the tree is short):
    (path, level, names below the root)."""
    totals = ScanTotals()  # errors here show again when the unit is scanned

    def descend(fd: int, path: str, level: int, names: tuple[str, ...]
                ) -> Iterator[tuple[str, int, tuple[str, ...]]]:
        matches = layout.dir_levels[level].fullmatch
        for name in sorted(_listdir(fd, path, totals) or ()):
            if matches(name) is None:
                continue
            child_path = os.path.join(path, name)
            if level + 1 == layout.parallel_level:
                yield child_path, level + 1, (*names, name)  # opened by scan_unit
                continue
            child = _open_below(name, fd, child_path, totals)
            if child is None:
                continue
            try:
                yield from descend(child, child_path, level + 1, (*names, name))
            finally:
                os.close(child)

    if layout.parallel_level == 0:
        yield root, 0, ()
        return
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return  # scan_unit reports it
    try:
        yield from descend(root_fd, root, 0, ())
    finally:
        os.close(root_fd)


@dataclass
class ScanRules:
    now: float
    min_idle_seconds: float
    temp_guard_seconds: float
    dir_guard_seconds: float


def _open_unit(root: str, names: tuple[str, ...], totals: ScanTotals) -> int | None:
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as err:
        totals.errors.append(f"open {root}: {err.strerror or err}")
        return None
    path = root
    for name in names:
        path = os.path.join(path, name)
        try:
            child = _open_below(name, fd, path, totals)
        finally:
            os.close(fd)
        if child is None:
            return None
        fd = child
    return fd


def scan_unit(path: str, level: int, layout: Layout, rules: ScanRules,
              selection: LruSelection | None, root: str | None = None,
              names: tuple[str, ...] = ()) -> ScanTotals:
    """Walk one unit's subtree; `level` is the index of the pattern its children match.
    The unit is opened from `root` down through `names` (default: `path` itself is the
    root), one directory at a time without following symlinks."""
    totals = ScanTotals()
    first_removable = layout.first_removable_level
    leaf_level = len(layout.dir_levels)
    block_file = layout.block_file.fullmatch
    temp_file = layout.temp_file.fullmatch if layout.temp_file is not None else None
    now = rules.now
    min_idle, temp_guard = rules.min_idle_seconds, rules.temp_guard_seconds
    dir_guard = rules.dir_guard_seconds
    fstatat = os.stat
    is_reg = stat.S_ISREG

    def leftover(items: list, item: object) -> None:
        if len(items) < MAX_LEFTOVERS:
            items.append(item)

    # The unit's LRU offers, gathered across its leaf directories (most hold a file or
    # two) and handed over OFFER_SLICE at a time: one lock round trip per slice.
    offers: list[tuple[float, int, str, int, int]] = []
    scandir = os.scandir

    def walk(fd: int, directory: str, lvl: int) -> None:
        nonlocal offers
        removable = lvl > first_removable  # lvl: its children's level
        if removable:  # its age and size before anything here is deleted
            try:
                dir_st = os.fstat(fd)
            except OSError:
                removable = False  # unreadable: nothing to remove
        totals.dirs += 2  # calls to time (thread choice): its lookup (open) and its read
        prefix = directory if directory.endswith("/") else directory + "/"
        if lvl != leaf_level:
            names = _listdir(fd, directory, totals)
            if names is None:
                return
            count = len(names)
            if removable:
                note(directory, dir_st, count)
            matches = layout.dir_levels[lvl].fullmatch
            for name in names:
                if matches(name) is None:
                    continue
                child_path = prefix + name
                child = _open_below(name, fd, child_path, totals)
                if child is None:
                    continue
                try:
                    walk(child, child_path, lvl + 1)
                finally:
                    os.close(child)
            return
        count = files = block_bytes = skipped = 0
        try:  # the names are streamed: a directory of millions is never listed whole
            with scandir(fd) as it:
                for entry in it:
                    count += 1
                    name = entry.name
                    block = block_file(name) is not None
                    if not block and (temp_file is None or temp_file(name) is None):
                        continue
                    try:
                        st = fstatat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    except OSError as err:
                        totals.errors.append(f"stat {prefix}{name}: {err.strerror or err}")
                        continue
                    if not is_reg(st.st_mode):
                        continue  # a symlink, a directory, a fifo...: not a cache file
                    blocks = st.st_blocks
                    size = blocks * 512 if blocks > 0 else st.st_size
                    if not block:
                        totals.temp_bytes += size
                        if now - st.st_mtime >= temp_guard:
                            leftover(totals.stale_temps, Candidate(
                                st.st_mtime, size, prefix + name, st.st_dev, st.st_ino))
                        continue
                    files += 1
                    block_bytes += size
                    atime, mtime = st.st_atime, st.st_mtime
                    used = atime if atime > mtime else mtime
                    if now - used < min_idle:
                        skipped += 1
                    elif selection is not None:
                        offers.append((used, size, prefix + name, st.st_dev, st.st_ino))
                        if len(offers) >= OFFER_SLICE:
                            selection.offer_many(offers)
                            offers = []
        except FileNotFoundError:
            pass  # removed under us by a writer's cleanup or another tool
        except OSError as err:
            totals.errors.append(f"scandir {directory}: {err.strerror or err}")
        if removable:
            note(directory, dir_st, count)
        totals.files += files
        totals.block_bytes += block_bytes
        totals.skipped_recent += skipped

    def note(directory: str, dir_st: os.stat_result, count: int) -> None:
        old = now - dir_st.st_mtime >= dir_guard
        totals.directories[directory] = DirInfo(dir_st.st_blocks * 512, count, old)
        if not count and old:
            leftover(totals.empty_dirs, directory)

    fd = _open_unit(root if root is not None else path, names, totals)
    if fd is not None:
        try:
            walk(fd, path, level)
        finally:
            os.close(fd)
    if selection is not None:
        selection.offer_many(offers)
    return totals


# Above this many seconds per metadata call (a stat or a directory read) spent blocked,
# calls are waiting on a server (NFS, Lustre, CephFS, EFS) and threads overlap the waits.
# Below it the filesystem is local and fast, and Python threads only add GIL handoffs.
SLOW_SECONDS_PER_CALL = 100e-6
AUTO_THREADS = 16


def _thread_clock() -> tuple[float, float]:
    """(seconds this thread has run on a CPU, seconds it has waited runnable for one),
    from the kernel's schedstat; where that is missing (not Linux), the thread's CPU time
    and no wait."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0


def blocked_seconds(wall_start: float, clock_start: tuple[float, float]) -> float:
    """Seconds since (wall_start, clock_start) that this thread spent neither on a CPU
    nor waiting for one: blocked in the kernel, on a disk or a server. A node busy with
    other work makes a call take longer on the wall clock but not blocked: that is no
    slow volume, and more threads would not help it."""
    wall = time.perf_counter() - wall_start
    on_cpu, waiting = _thread_clock()
    return max(0.0, wall - (on_cpu - clock_start[0]) - (waiting - clock_start[1]))


def scan(root: str, layout: Layout, rules: ScanRules, selection: LruSelection | None,
         threads: int) -> ScanTotals:
    """Scan every unit; threads <= 0 picks 1 or AUTO_THREADS from how long the first
    units' calls spent blocked (waiting on the volume, not for a CPU). The choice is
    returned in totals.threads."""
    totals = ScanTotals()
    work = list(units(root, layout))
    if threads <= 0:
        start, clock = time.perf_counter(), _thread_clock()
        while work and totals.calls < 512:  # time enough calls to judge the filesystem
            path, lvl, names = work.pop(0)
            totals.add(scan_unit(path, lvl, layout, rules, selection, root, names))
        per_call = blocked_seconds(start, clock) / max(totals.calls, 1)
        threads = AUTO_THREADS if per_call > SLOW_SECONDS_PER_CALL else 1
    totals.threads = threads
    if threads == 1:
        for path, lvl, names in work:
            totals.add(scan_unit(path, lvl, layout, rules, selection, root, names))
        return totals
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(scan_unit, path, lvl, layout, rules, selection, root, names)
                   for path, lvl, names in work]
        for future in futures:
            totals.add(future.result())
    return totals
