"""One evictor run: measure, scan, choose least-recently-used files, re-check, delete."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

from kvtier_evictor.anchored import REPLACED, DirChain, Root
from kvtier_evictor.layouts import Layout
from kvtier_evictor.lock import LockHeld, VolumeLock
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
BATCH = 4096


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
        selection = LruSelection(want_bytes, want_inodes)
        totals = scan(cfg.root, cfg.layout, self._rules(), selection, cfg.threads)
        self.report.files_scanned = totals.files
        self.report.skipped_recent = totals.skipped_recent
        for message in totals.errors:
            self._error(message)
        log.info("scanned %d block files with %d thread(s); %d used within minIdle; %d "
                 "candidates; %d stale temp files", totals.files, totals.threads,
                 totals.skipped_recent, len(selection), len(totals.stale_temps))
        with Root(cfg.root) as root:  # every deletion goes through directory fds below it
            self._root = root
            try:
                self._reap_temps(totals.stale_temps)
                self._delete(selection.oldest_first(), lock, totals.threads)
                self._remove_dirs(totals.empty_dirs)
            finally:
                self._root = None
        if cfg.capacity_bytes is not None:
            self._budget_bytes = max(self._budget_bytes - self.report.bytes_freed, 0)
        after = self.usage()
        self.report.usage_after = after
        if self.report.errors and not (self.report.files_deleted or
                                       self.report.temp_files_reaped):
            self.report.outcome = ERROR
        elif self._over_low(after) and not cfg.dry_run:
            self.report.outcome = ABOVE_LOW_WATERMARK
        else:
            self.report.outcome = FREED
        log.info("deleted %d files (%d bytes), reaped %d temp files and %d directories; "
                 "usage now %.1f%% bytes, %.1f%% inodes", self.report.files_deleted,
                 self.report.bytes_freed, self.report.temp_files_reaped,
                 self.report.dirs_removed, after.percent, after.inode_percent)

    # ----------------------------------------------------------- actions
    # Everything is deleted relative to directories opened below the root without
    # following symlinks (anchored.py), and only where the name still holds the regular
    # file the scan saw: a directory swapped for a symlink since the scan, or a file
    # replaced, is left alone (skipped_changed), never followed.

    def _chain(self) -> DirChain:
        if self._root is None:
            raise RuntimeError("the volume root is not open")
        return DirChain(self._root)

    def _recheck(self, cand: Candidate, chain: DirChain
                 ) -> tuple[int, str, os.stat_result] | bool:
        """(directory fd, name, stat) where the scanned file is still there; False where
        it is gone, True where something else stands on its path now."""
        assert self._root is not None
        try:
            *dirs, name = self._root.names(cand.path)
            dir_fd = chain.open(dirs)
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False  # a writer or another cleaner got there first
        except ValueError as err:
            self._error(str(err))
            return False
        except OSError as err:
            if err.errno in REPLACED:
                return True  # a directory on its path is no directory any more
            self._error(f"stat {cand.path}: {err.strerror or err}")
            return False
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (cand.dev, cand.ino):
            return True  # replaced since the scan (a rewrite, a rename, a swap)
        return dir_fd, name, st

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

    def _reap_temps(self, temps: Iterable[Candidate]) -> None:
        with self._chain() as chain:
            for cand in sorted(temps, key=lambda c: c.path):
                found = self._recheck(cand, chain)
                if isinstance(found, bool):
                    continue
                dir_fd, name, st = found
                if self.clock() - st.st_mtime < self.cfg.temp_guard_seconds:
                    continue  # written to since the scan: its writer is alive
                if self._unlink(dir_fd, name, cand.path):
                    self.report.temp_files_reaped += 1
                    self.report.bytes_freed += st.st_size

    def _delete_one(self, cand: Candidate, chain: DirChain) -> tuple[int, int, int]:
        """(deleted, bytes, changed): re-stat just before unlinking so a file used or
        replaced since the scan is kept."""
        found = self._recheck(cand, chain)
        if isinstance(found, bool):
            return 0, 0, int(found)
        dir_fd, name, st = found
        used = last_use(st)
        if used > cand.last_use or self.clock() - used < self.cfg.min_idle_seconds:
            return 0, 0, 1
        if self._unlink(dir_fd, name, cand.path):
            return 1, cand.size, 0
        return 0, 0, 0

    def _delete_chunk(self, chunk: list[Candidate]) -> tuple[int, int, int]:
        """One worker's share of a batch, in path order: neighbours share the directories
        opened for the one before."""
        deleted = freed = changed = 0
        with self._chain() as chain:
            for cand in sorted(chunk, key=lambda c: c.path):
                d, b, c = self._delete_one(cand, chain)
                deleted, freed, changed = deleted + d, freed + b, changed + c
        return deleted, freed, changed

    def _delete(self, candidates: list[Candidate], lock: VolumeLock, threads: int) -> None:
        """Oldest first, in batches; each worker takes a slice of a batch (one task per
        slice, not per file: thread handoffs cost more than a local unlink)."""
        cfg = self.cfg
        workers = max(1, threads)
        last_progress = self.clock()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for start in range(0, len(candidates), BATCH):
                batch = candidates[start:start + BATCH]
                slices = [batch[i::workers] for i in range(workers) if batch[i::workers]]
                for deleted, size, changed in pool.map(self._delete_chunk, slices):
                    self.report.files_deleted += deleted
                    self.report.bytes_freed += size
                    self.report.skipped_changed += changed
                lock.refresh()
                if cfg.capacity_bytes is None and not cfg.dry_run and not self._over_low(
                    self._statvfs()
                ):
                    break  # below both low watermarks already
                if self.clock() - last_progress >= cfg.progress_seconds:
                    last_progress = self.clock()
                    log.info("progress: %d/%d candidates handled, %d deleted",
                             start + len(batch), len(candidates), self.report.files_deleted)

    def _remove_dirs(self, paths: Iterable[str]) -> None:
        if self.cfg.dry_run:
            return
        assert self._root is not None
        with self._chain() as chain:
            for path in sorted(paths, key=len, reverse=True):  # children before parents
                try:
                    *dirs, name = self._root.names(path)
                    os.rmdir(name, dir_fd=chain.open(dirs))  # a symlink there: ENOTDIR
                    self.report.dirs_removed += 1
                except (OSError, ValueError):
                    pass  # no longer empty (a writer is using it), gone, or replaced


def run(config: Config) -> EvictionReport:
    return Run(config).execute()
