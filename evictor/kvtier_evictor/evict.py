"""One evictor run: measure, scan, choose least-recently-used files, re-check, delete."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime

from kvtier_evictor.anchored import REPLACED, DirChain, Root
from kvtier_evictor.layouts import Layout
from kvtier_evictor.lock import LockHeld, VolumeLock
from kvtier_evictor.plan import DirTally
from kvtier_evictor.report import (
    ABOVE_LOW_WATERMARK,
    ERROR,
    FREED,
    NOTHING_TO_DO,
    EvictionReport,
    Usage,
)
from kvtier_evictor.scan import Candidate, LruSelection, ScanRules, last_use, scan
from kvtier_evictor.usage import over, statvfs_usage, to_free

log = logging.getLogger("kvtier_evictor")
MAX_ERROR_MESSAGES = 20
PIECE = 64  # directories per task handed to a deleting thread
CHECK_SECONDS = 1.0  # how often deletion refreshes the lock and re-reads the usage
# A volume may free more per file than the file's allocated bytes (GlusterFS: the brick's
# xattr blocks and gfid link, ~35 KB per 8 KiB file) or less. A plan sized on the files'
# bytes alone is then too long, and deletion, in path order, stops at the low watermark
# part way: the files left behind are not the newest (LRU 0.61 on GlusterFS at 100k
# files). So the oldest 1/CALIBRATE of a plan (at most CALIBRATE_MAX files) is deleted on
# its own, what the volume freed for it is measured, and the rest is planned at that
# rate: at the largest rate taken (8x) the slice is still half of what is needed. Only a
# volume that frees more than counted shortens the plan: one that seems to free less is
# most likely late to say so (ext4 returns blocks at its journal commit), and a longer
# plan would delete more than needed. A plan under CALIBRATE_FILES files is deleted
# whole (in about the time deletion takes to re-read the usage, CHECK_SECONDS).
CALIBRATE = 16
CALIBRATE_MAX = 512
CALIBRATE_FILES = 1000


@dataclass
class Config:
    root: str
    layout: Layout
    high_watermark: float = 85
    low_watermark: float = 70
    inode_high_watermark: float = 90
    inode_low_watermark: float = 80
    min_idle_seconds: float = 600
    temp_guard_seconds: float = 3600
    dir_guard_seconds: float = 600
    capacity_bytes: int | None = None  # budget mode: usage = cache bytes / capacity
    threads: int = 0  # 0: decide from how fast the filesystem answers (see scan.scan)
    dry_run: bool = False
    lock_stale_seconds: float = 3600
    progress_seconds: float = 10
    # The most LRU candidates held at once (about 350 bytes each: 500k is ~170 MiB, within
    # the CronJob's 512Mi with the scan's other state); a run that must free more frees in
    # passes, scanning again for each, so its memory never grows with the tree.
    max_candidates: int = 500_000
    max_passes: int = 64
    # Called with each deleted block file's path, from the deleting threads (events.py).
    on_removed: Callable[[str], None] | None = None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class Run:
    def __init__(self, config: Config, clock: Callable[[], float] = time.time,
                 usage_source: Callable[[], Usage] | None = None) -> None:
        self.cfg = config
        self.clock = clock
        self.report = EvictionReport(layout=config.layout.name, dry_run=config.dry_run)
        self._statvfs = usage_source or (lambda: statvfs_usage(config.root))
        self._budget_bytes = 0  # cache bytes found by the last full scan (budget mode)
        self._errors_lock = threading.Lock()  # _error runs on the delete pool's threads
        self._root: Root | None = None  # open while files are deleted
        self._tally = DirTally({})  # what is left in each directory the scan saw
        self._budget_start = 0  # budget mode: cache bytes before anything was deleted
        self._stop = threading.Event()  # deletion reached the low watermarks early

    # ------------------------------------------------------------- usage

    def usage(self) -> Usage:
        fs = self._statvfs()
        if self.cfg.capacity_bytes is None:
            return fs
        return Usage(used_bytes=self._budget_bytes, capacity_bytes=self.cfg.capacity_bytes,
                     used_inodes=fs.used_inodes, capacity_inodes=fs.capacity_inodes)

    def _over_high(self, usage: Usage) -> bool:
        return over(usage, self.cfg.high_watermark, self.cfg.inode_high_watermark)

    def _over_low(self, usage: Usage) -> bool:
        return over(usage, self.cfg.low_watermark, self.cfg.inode_low_watermark)

    def _error(self, message: str) -> None:
        with self._errors_lock:
            self.report.errors += 1
            if len(self.report.error_messages) < MAX_ERROR_MESSAGES:
                self.report.error_messages.append(message)
        log.warning("%s", message)

    # --------------------------------------------------------------- run

    def execute(self) -> EvictionReport:
        started = self.clock()
        self.report.started_at = _iso(started)
        self.report.usage_source = "budget" if self.cfg.capacity_bytes else "statvfs"
        try:
            with VolumeLock(self.cfg.root, self.cfg.lock_stale_seconds) as lock:
                self._execute(lock)
        except LockHeld as err:
            self._error(str(err))
            self.report.outcome = ERROR
            if err.held_seconds is not None:
                self.report.lock_held_seconds = round(err.held_seconds, 1)
        except OSError as err:
            self._error(f"{err.filename or self.cfg.root}: {err.strerror or err}")
            self.report.outcome = ERROR
        finished = self.clock()
        self.report.finished_at = _iso(finished)
        self.report.duration_seconds = round(finished - started, 3)
        return self.report

    def _rules(self) -> ScanRules:
        return ScanRules(now=self.clock(), min_idle_seconds=self.cfg.min_idle_seconds,
                         temp_guard_seconds=self.cfg.temp_guard_seconds,
                         dir_guard_seconds=self.cfg.dir_guard_seconds)

    def _execute(self, lock: VolumeLock) -> None:
        cfg = self.cfg
        if cfg.capacity_bytes is not None:
            # Budget mode: statvfs says nothing about our share, so measure it first.
            totals = scan(cfg.root, cfg.layout, self._rules(), None, cfg.threads)
            self._budget_bytes = totals.block_bytes + totals.temp_bytes
            self._budget_start = self._budget_bytes
        before = self.usage()
        self.report.usage_before = before
        self.report.usage_after = before
        if not self._over_high(before):
            log.info("usage %.1f%% bytes, %.1f%% inodes: below the high watermarks, nothing "
                     "to do", before.percent, before.inode_percent)
            self.report.outcome = NOTHING_TO_DO
            return
        want_bytes, want_inodes = to_free(before, cfg.low_watermark, cfg.inode_low_watermark)
        log.info("usage %.1f%% bytes, %.1f%% inodes: freeing %d bytes and %d files",
                 before.percent, before.inode_percent, want_bytes, want_inodes)
        for n in range(1, cfg.max_passes + 1):
            capped = self._pass(lock, want_bytes, want_inodes, first=n == 1)
            self.report.passes = n
            if not capped or cfg.dry_run:
                break
            usage = self.usage()
            if not self._over_low(usage):
                break
            want_bytes, want_inodes = to_free(usage, cfg.low_watermark,
                                              cfg.inode_low_watermark)
            log.info("pass %d held its %d candidates and usage is %.1f%%: scanning again",
                     n, cfg.max_candidates, usage.percent)
        after = self.usage()
        self.report.usage_after = after
        if self.report.errors and not (self.report.files_deleted or
                                       self.report.temp_files_reaped):
            self.report.outcome = ERROR
        elif self._over_low(after) and not cfg.dry_run:
            self.report.outcome = ABOVE_LOW_WATERMARK
        else:
            self.report.outcome = FREED
        log.info("deleted %d files (the fewest that reach the target: %d), reaped %d temp "
                 "files and removed %d directories, %d bytes freed; usage now %.1f%% bytes, "
                 "%.1f%% inodes", self.report.files_deleted, self.report.files_minimum,
                 self.report.temp_files_reaped, self.report.dirs_removed,
                 self.report.bytes_freed, after.percent, after.inode_percent)

    def _pass(self, lock: VolumeLock, want_bytes: int, want_inodes: int,
              first: bool) -> bool:
        """Scan once and free the oldest files toward the target; True where the
        candidate bound dropped files the target still needed (another pass can go on)."""
        cfg = self.cfg
        selection = LruSelection(want_bytes, want_inodes, cfg.max_candidates)
        scan_started = time.perf_counter()
        totals = scan(cfg.root, cfg.layout, self._rules(), selection, cfg.threads)
        self.report.scan_seconds = round(self.report.scan_seconds
                                         + time.perf_counter() - scan_started, 3)
        self.report.threads = totals.threads
        if first:  # what the tree held: the first scan's view, before any deletion
            self.report.files_scanned = totals.files
            self.report.skipped_recent = totals.skipped_recent
        for message in totals.errors:
            self._error(message)
        log.info("scanned %d block files with %d thread(s) in %.1fs; %d used within "
                 "minIdle; %d candidates; %d stale temp files", totals.files, totals.threads,
                 self.report.scan_seconds, totals.skipped_recent, len(selection),
                 len(totals.stale_temps))
        self._tally = DirTally(totals.directories)
        report = self.report
        before = (report.bytes_freed, report.dir_bytes_freed, report.temp_files_reaped,
                  report.dirs_removed)
        with Root(cfg.root) as root:  # every deletion goes through directory fds below it
            self._root = root
            try:
                self._reap_temps(totals.stale_temps)
                self._remove_dirs(totals.empty_dirs)
                # what reaping temp files and empty directories freed in this pass
                want_bytes -= report.bytes_freed - before[0]
                if cfg.capacity_bytes is not None:  # a budget counts the cache's files only
                    want_bytes += report.dir_bytes_freed - before[1]
                want_inodes -= (report.temp_files_reaped - before[2]
                                + report.dirs_removed - before[3])
                self._free(selection.oldest_first(), lock, totals.threads, want_bytes,
                           want_inodes)
            finally:
                self._root = None
        return selection.capped

    # ----------------------------------------------------------- actions
    # Everything is deleted relative to directories opened below the root without
    # following symlinks (anchored.py), and only where the name still holds the regular
    # file the scan saw: a directory swapped for a symlink since the scan, or a file
    # replaced, is left alone (skipped_changed), never followed.

    def _chain(self) -> DirChain:
        if self._root is None:
            raise RuntimeError("the volume root is not open")
        return DirChain(self._root)

    def _names(self, path: str) -> list[str] | None:
        assert self._root is not None
        try:
            return self._root.names(path)
        except ValueError as err:
            self._error(str(err))
            return None

    def _open_dir(self, names: list[str], path: str, chain: DirChain) -> int | bool:
        """The directory's fd; False where it is gone (or unreadable: an error), True
        where something else stands on its path now."""
        try:
            return chain.open(names)
        except FileNotFoundError:
            return False  # a writer or another cleaner got there first
        except OSError as err:
            if err.errno in REPLACED:
                return True  # a directory on its path is no directory any more
            self._error(f"open {path}: {err.strerror or err}")
            return False

    def _recheck(self, cand: Candidate, dir_fd: int, name: str
                 ) -> os.stat_result | bool:
        """The file's stat where the scanned file is still there; False where it is
        gone, True where something else stands in its place now."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False  # a writer or another cleaner got there first
        except OSError as err:
            self._error(f"stat {cand.path}: {err.strerror or err}")
            return False
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (cand.dev, cand.ino):
            return True  # replaced since the scan (a rewrite, a rename, a swap)
        return st

    def _unlink(self, dir_fd: int, name: str, path: str) -> bool:
        if self.cfg.dry_run:
            return True
        try:
            os.unlink(name, dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return False  # a writer or another cleaner got there first
        except OSError as err:
            self._error(f"unlink {path}: {err.strerror or err}")
            return False

    def _remove_up(self, directory: str, chain: DirChain) -> Freed:
        """Remove a directory the tally says stands empty, then each parent it leaves
        empty (when old before the run). A writer racing this gets ENOTEMPTY here (it
        stays), or a store that fails or recreates the directory: no data lost."""
        freed = Freed()
        while not self.cfg.dry_run:
            names = self._names(directory)
            if names is None:
                break
            parent_fd = self._open_dir(names[:-1], directory, chain)
            if isinstance(parent_fd, bool):
                break
            try:
                os.rmdir(names[-1], dir_fd=parent_fd)  # a symlink there: ENOTDIR
            except OSError:
                break  # no longer empty (a writer is using it), gone, or replaced
            freed.dirs += 1
            freed.dir_bytes += self._tally.directories[directory].bytes
            directory = os.path.dirname(directory)
            if not self._tally.removed_from(directory):
                break
        return freed

    def _reap_temps(self, temps: Iterable[Candidate]) -> None:
        freed = Freed()
        with self._chain() as chain:
            for cand in sorted(temps, key=lambda c: c.path):
                directory, name = os.path.split(cand.path)
                names = self._names(directory)
                if names is None:
                    continue
                dir_fd = self._open_dir(names, directory, chain)
                if isinstance(dir_fd, bool):
                    continue
                st = self._recheck(cand, dir_fd, name)
                if isinstance(st, bool):
                    continue
                if self.clock() - st.st_mtime < self.cfg.temp_guard_seconds:
                    continue  # written to since the scan: its writer is alive
                if self._unlink(dir_fd, name, cand.path):
                    self.report.temp_files_reaped += 1
                    self.report.bytes_freed += st.st_size
                    if self._tally.removed_from(directory):
                        freed.add(self._remove_up(directory, chain))
        self._count(freed)

    def _remove_dirs(self, paths: Iterable[str]) -> None:
        """Directories the scan found empty and old (and each parent that leaves empty)."""
        freed = Freed()
        with self._chain() as chain:
            for path in sorted(paths, key=len, reverse=True):  # children before parents
                freed.add(self._remove_up(path, chain))
        self._count(freed)

    def _count(self, freed: Freed) -> None:
        report = self.report
        report.files_deleted += freed.files
        report.bytes_freed += freed.file_bytes + freed.dir_bytes
        report.dir_bytes_freed += freed.dir_bytes
        report.dirs_removed += freed.dirs
        report.skipped_changed += freed.changed
        if self.cfg.capacity_bytes is not None:  # the budget counts the cache's files only
            self._budget_bytes = max(self._budget_start - report.bytes_freed
                                     + report.dir_bytes_freed, 0)

    # ---------------------------------------------------------- deletion

    def _free(self, oldest_first: list[Candidate], lock: VolumeLock, threads: int,
              want_bytes: int, want_inodes: int) -> None:
        """Delete the fewest of the oldest files that reach the target (what the pass set
        out to free, less what reaping temp files and empty directories freed), counting
        the directories they empty; where the volume is still above a low watermark after
        that (files used again since the scan were kept, writers kept writing), the next
        oldest for what is still missing, until below or out of candidates."""
        cfg = self.cfg
        report = self.report
        dir_bytes = cfg.capacity_bytes is None  # a budget counts the cache's files only
        n = self._tally.fewest(oldest_first, want_bytes, want_inodes, dir_bytes)
        report.files_minimum += n
        # What the volume frees per byte the plan counts (statvfs mode): measured on the
        # plan's first files (CALIBRATE), then the rest is planned at that rate.
        calibrate = dir_bytes and not cfg.dry_run and n >= CALIBRATE_FILES
        scale = 1.0
        rest = oldest_first
        while n:
            batch = max(1, min(n // CALIBRATE, CALIBRATE_MAX)) if calibrate else n
            before, counted = self.usage().used_bytes, self._counted_bytes()
            self._delete(rest[:batch], lock, threads)
            rest = rest[batch:]
            if cfg.dry_run or not rest:
                break  # a dry run changed nothing on the volume: the plan is the answer
            usage = self.usage()
            if not self._over_low(usage):
                break
            if calibrate:
                scale = _freed_per_counted(before - usage.used_bytes,
                                           self._counted_bytes() - counted, scale)
                calibrate = False
            want_bytes, want_inodes = to_free(usage, cfg.low_watermark,
                                              cfg.inode_low_watermark)
            n = self._tally.fewest(rest, int(want_bytes / scale), want_inodes, dir_bytes)

    def _counted_bytes(self) -> int:
        """What the plan counted as freed so far (files and the directories they emptied)."""
        return self.report.bytes_freed

    def _delete(self, candidates: list[Candidate], lock: VolumeLock, threads: int) -> None:
        """Directory by directory, in path order: each directory is opened once (its
        chain shared with the one before) for all its files, and removed once they
        leave it empty. Threads take pieces of consecutive directories."""
        by_dir: dict[str, list[Candidate]] = {}
        for cand in candidates:
            by_dir.setdefault(os.path.dirname(cand.path), []).append(cand)
        dirs = sorted(by_dir)
        pieces = [[(d, by_dir[d]) for d in dirs[i:i + PIECE]]
                  for i in range(0, len(dirs), PIECE)]
        self._stop.clear()
        last_check = time.monotonic()
        last_progress = self.clock()
        done = 0

        def between_pieces() -> None:
            nonlocal last_check, last_progress
            if time.monotonic() - last_check < CHECK_SECONDS:
                return
            last_check = time.monotonic()
            lock.refresh()
            if (self.cfg.capacity_bytes is None and not self.cfg.dry_run
                    and not self._over_low(self._statvfs())):
                self._stop.set()  # below both low watermarks already
            if self.clock() - last_progress >= self.cfg.progress_seconds:
                last_progress = self.clock()
                log.info("progress: %d/%d directories handled, %d files deleted", done,
                         len(dirs), self.report.files_deleted)

        if threads <= 1:
            for piece in pieces:
                self._count(self._delete_piece(piece))
                done += len(piece)
                between_pieces()
                if self._stop.is_set():
                    break
            return
        with ThreadPoolExecutor(max_workers=threads) as pool:
            pending: set[Future[Freed]] = {pool.submit(self._delete_piece, piece)
                                           for piece in pieces}
            while pending:
                finished, pending = wait(pending, timeout=CHECK_SECONDS,
                                         return_when=FIRST_COMPLETED)
                for future in finished:
                    if future.cancelled():
                        continue
                    self._count(future.result())
                    done += PIECE
                between_pieces()
                if self._stop.is_set():
                    for future in pending:
                        future.cancel()  # those not started; the rest see the flag

    def _delete_piece(self, piece: list[tuple[str, list[Candidate]]]) -> Freed:
        freed = Freed()
        with self._chain() as chain:
            for directory, cands in piece:
                if self._stop.is_set():
                    break
                freed.add(self._delete_in(directory, cands, chain))
        return freed

    def _delete_in(self, directory: str, cands: list[Candidate], chain: DirChain) -> Freed:
        """One directory's candidates: re-stat each just before unlinking so a file used
        or replaced since the scan is kept; then the directory if that emptied it."""
        freed = Freed()
        names = self._names(directory)
        if names is None:
            return freed
        dir_fd = self._open_dir(names, directory, chain)
        if isinstance(dir_fd, bool):
            freed.changed = len(cands) if dir_fd else 0
            return freed
        for cand in cands:
            name = os.path.basename(cand.path)
            st = self._recheck(cand, dir_fd, name)
            if isinstance(st, bool):
                freed.changed += st
                continue
            used = last_use(st)
            if used > cand.last_use or self.clock() - used < self.cfg.min_idle_seconds:
                freed.changed += 1
                continue
            if self._unlink(dir_fd, name, cand.path):
                freed.files += 1
                freed.file_bytes += cand.size
                if self.cfg.on_removed is not None:
                    self.cfg.on_removed(cand.path)
        if freed.files and self._tally.removed_from(directory, freed.files):
            freed.add(self._remove_up(directory, chain))
        return freed


@dataclass
class Freed:
    """What one step of deletion did (summed into the report on the main thread)."""
    files: int = 0
    file_bytes: int = 0
    dirs: int = 0
    dir_bytes: int = 0
    changed: int = 0  # kept: used again or replaced since the scan

    def add(self, other: Freed) -> None:
        self.files += other.files
        self.file_bytes += other.file_bytes
        self.dirs += other.dirs
        self.dir_bytes += other.dir_bytes
        self.changed += other.changed


def _freed_per_counted(freed: int, counted: int, previous: float) -> float:
    """What the volume freed per byte the plan counted, within 1..8 (CALIBRATE); the
    previous figure where the measure says nothing (no bytes counted, or usage grew
    meanwhile: writers)."""
    if counted <= 0 or freed <= 0:
        return previous
    return min(8.0, max(1.0, freed / counted))


def run(config: Config) -> EvictionReport:
    return Run(config).execute()
