"""The block store: KV blocks as self-describing files on a shared volume.

Safe first: a file becomes visible only complete (temp name, checked close, atomic link),
a load checks everything before it reports success, and a bad file is counted, logged
once, removed and reported as a failure, never served. Then fast: a bounded pool of
I/O threads with reads ahead of writes, O_DIRECT where the filesystem takes it, zero
copies when buffers are aligned, and a write queue with a time budget that drops what it
cannot write in time (counted, never reported stored). Filesystem errors never escape to
vLLM: they fail the job, and ENOSPC/EDQUOT/EIO/EACCES/EROFS back the writers off.

Only regular files are block files. A writer on the shared volume may leave anything at a
block's name: a FIFO, socket, device, directory or symlink is never waited on (opened
O_NONBLOCK, type checked before a read), never followed (O_NOFOLLOW), never a lookup hit
(lstat, S_ISREG), and is a counted miss that the load removes where it can (unlink; rmdir
of an empty directory). kvtier itself never makes symlinks, so refusing them costs nothing
but a recompute where someone linked a copy in by hand; following them would let any
writer on the volume make vLLM open any file or device the pod can reach.
Keys outside the layout's bounds (layout.key_fits) are refused: a miss, a failed block.
Waiting on the I/O threads (drain, close) is bounded: a thread stuck in the kernel on a
hung mount costs the caller at most the timeout, never the engine.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier_offload import batchio, native
from kvtier_offload import digest as payload_digest
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import (
    HEADER_SIZE,
    BadBlock,
    decode_header,
    encode_header,
    header_prefix,
    padded,
)
from kvtier_offload.iopool import IOPool
from kvtier_offload.layout import MAX_KEY_BYTES, MIN_KEY_BYTES, Layout, key_fits
from kvtier_offload.metrics import Metrics, observe_all

log = logging.getLogger("kvtier_offload")

BACKOFF_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EACCES, errno.EROFS,
                  errno.EPERM}
ALIGN = 4096
BATCH_BYTES = 8 << 20  # a batch task moves at most this much (at least one block)
PIECE = 512 << 10  # larger blocks move in pieces of this on memory-speed volumes
# drain() and close() wait at most this long by default: far longer than any healthy
# job (a store waits at most write_queue_seconds to start), short enough that a thread
# stuck on a hung mount does not hang its caller for good.
WAIT_SECONDS = 120.0


def hot_path(batch_io: bool) -> tuple[str, str]:
    """Which path a store with this batch_io setting runs: ("ok", "") for the C
    extension, else a short reason code (the native metric's label) and the reason."""
    if not payload_digest.AVAILABLE:
        return "no-digest", payload_digest.REASON
    if not native.AVAILABLE:
        return native.CODE, native.REASON
    if not batch_io:
        return "batch-io-off", "StoreConfig.batch_io is off"
    return "ok", ""


@dataclass
class StoreConfig:
    root: str
    fingerprint: str
    read_threads: int = 16
    write_threads: int = 16
    o_direct: str = "auto"  # auto: probe once; on; off
    # I/O threads at most: 0 probes the volume (read_threads + write_threads where files
    # wait on a device or network; one per core where they complete at memory speed).
    io_threads: int = 0
    fsync: bool = False  # fdatasync before publishing (durability over throughput)
    # Blocks go through batchio in batches where it is available; off: the Python path
    # for every block (it also takes any block the batch path could not finish).
    batch_io: bool = True
    free_space_floor_percent: float = 2.0  # refuse writes below this much free space; 0: off
    write_queue_seconds: float = 10.0  # drop stores that would wait longer than this
    lookup_hit_ttl: float = 10.0
    lookup_miss_ttl: float = 1.0
    # A key not yet stat'ed by the lookup threads is "ask again" (None) for at most this
    # long, then a miss until they answer (a hung or slow volume costs a recompute, never
    # a request held back for good); capped at half of lookup_hit_ttl, so the hits a
    # request's lookups found are still valid when its last key is answered.
    lookup_pending_seconds: float = 1.0
    lookup_threads: int = 4
    # Keys waiting for a stat at most; past it a new key is a miss at once.
    lookup_queue_limit: int = 65_536
    lookup_cache_entries: int = 500_000
    touch_interval: float = 60.0  # refresh a hit file's atime at most this often


@dataclass
class JobOutcome:
    job_id: int
    kind: str  # "store" or "load"
    keys: list[bytes]
    ok: list[bool]
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def success(self) -> bool:
        return all(self.ok)

    @property
    def ok_prefix(self) -> list[bytes]:
        """Keys loaded before the first failure: a prefix is what a cache can use."""
        out = []
        for key, ok in zip(self.keys, self.ok, strict=True):
            if not ok:
                break
            out.append(key)
        return out


@dataclass
class _BatchProgress:
    settled: set[int] = field(default_factory=set)  # indices reported done
    approved: set[int] = field(default_factory=set)  # indices reserved against the floor


@dataclass
class _Job:
    outcome: JobOutcome
    remaining: int
    started: float = field(default_factory=time.monotonic)


def _left(deadline: float | None) -> float | None:
    """Seconds until deadline (monotonic), at least 0; None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


def _aligned(buf: memoryview) -> bool:
    return len(buf) % ALIGN == 0 and _address(buf) % ALIGN == 0


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes of a scatter/gather list (after a partial readv/writev)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def _odd_kind(mode: int) -> str | None:
    """What a file of this mode is, where it is not a regular file (None where it is)."""
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


class NotAFile(BadBlock):
    """Something other than a regular file at a block's path."""

    def __init__(self, kind: str) -> None:
        super().__init__("not-a-file", f"a {kind} at a block path")
        self.kind = kind


def probe_o_direct(directory: str) -> bool:
    """Whether files in directory accept O_DIRECT I/O (tmpfs, overlayfs and some NFS
    mounts refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".o_direct_probe.{os.getpid()}.tmp")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            return os.write(fd, buf) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass


MEMORY_SPEED_SECONDS = 250e-6  # per 256 KiB file write or read: a RAM-backed volume


def probe_memory_speed(directory: str, o_direct: bool) -> bool:
    """Whether whole 256 KiB files are created, written, read and removed here at memory
    speed (tmpfs, a page-cached mount): then the I/O threads are CPU-bound."""
    buf = mmap.mmap(-1, 256 << 10)
    flag = os.O_DIRECT if o_direct else 0
    paths = [os.path.join(directory, f".speed_probe.{os.getpid()}.{i}.tmp") for i in range(4)]
    try:
        start = time.perf_counter()
        for path in paths:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | flag, 0o600)
            try:
                os.write(fd, buf)
            finally:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY | flag)
            try:
                os.readv(fd, [buf])
            finally:
                os.close(fd)
        return (time.perf_counter() - start) / (2 * len(paths)) < MEMORY_SPEED_SECONDS
    except OSError:
        return False  # cannot tell (read-only, full): keep every thread
    finally:
        buf.close()
        for path in paths:  # the probe's files go whether it finished or not
            try:
                os.unlink(path)
            except OSError:
                pass


class _Buffers:
    """A job's blocks in memory (a load's destinations, a store's sources) as buffer
    objects, one per block."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self._buffers = buffers

    def view(self, index: int) -> memoryview:
        return memoryview(self._buffers[index])

    def size(self, index: int) -> int:
        return len(self._buffers[index])

    def sizes(self, indices: list[int]) -> np.ndarray:
        return np.array([len(self._buffers[i]) for i in indices], dtype=np.int64)

    def total(self) -> int:
        return sum(len(b) for b in self._buffers)

    def batchable(self, batch: range, direct: bool,
                  writes_into: bool = True) -> tuple[list[int], np.ndarray]:
        """The blocks of batch the C extension may take (write into, for a load), and
        their addresses."""
        indices: list[int] = []
        addresses: list[int] = []
        for index in batch:
            dest = self._buffers[index]
            if writes_into and memoryview(dest).readonly:
                continue
            at = batchio.address(dest)
            if batchio.eligible(dest, direct, at):
                indices.append(index)
                addresses.append(at)
        return indices, np.array(addresses, dtype=np.int64)


class _Rows:
    """A job's blocks in memory as rows of one 2-D uint8 array: block i is row ids[i].
    Every row has the same size and alignment, so one check covers all."""

    def __init__(self, rows: np.ndarray, ids: np.ndarray) -> None:
        if rows.ndim != 2 or rows.dtype != np.uint8:
            raise ValueError(f"rows must be a 2-D uint8 array, not {rows.ndim}-D {rows.dtype}")
        if len(ids) and ids.view(np.uint64).max() >= rows.shape[0]:  # negatives wrap: huge
            raise IndexError(f"row ids must lie in [0, {rows.shape[0]})")
        self._rows, self._ids = rows, ids
        self._row = rows.shape[1]
        self._base = int(rows.ctypes.data)
        self._stride = rows.strides[0]
        self._contiguous = rows.strides[1] == 1
        self._writable = bool(rows.flags.writeable)

    def view(self, index: int) -> memoryview:
        return memoryview(self._rows[self._ids[index]])

    def size(self, index: int) -> int:
        return self._row

    def sizes(self, indices: list[int]) -> np.ndarray:
        return np.full(len(indices), self._row, dtype=np.int64)

    def total(self) -> int:
        return len(self._ids) * self._row

    def batchable(self, batch: range, direct: bool,
                  writes_into: bool = True) -> tuple[list[int], np.ndarray]:
        aligned = self._row % 8 == 0 and (not direct or (
            self._row % 4096 == 0 and self._base % 4096 == 0 and self._stride % 4096 == 0))
        usable = self._contiguous and (self._writable or not writes_into)
        if not (usable and aligned and self._row):
            return [], np.zeros(0, dtype=np.int64)
        return list(batch), self._base + self._ids[batch.start:batch.stop] * self._stride


_Dests = _Buffers | _Rows


class BlockStore:
    def __init__(self, config: StoreConfig, metrics: Metrics | None = None) -> None:
        self.cfg = config
        self.layout = Layout(config.root, config.fingerprint)
        self._base_c = os.fsencode(self.layout.base)  # what the batch path builds on
        self._prefix = header_prefix(config.fingerprint)
        self.metrics = metrics or Metrics()
        try:
            self.layout.ensure_dir(self.layout.base)
        except OSError as err:
            # A read-only or full volume must not stop vLLM: stores fail, lookups miss.
            log.warning("kvtier cannot create %s (%s); every store will fail and every "
                        "lookup miss until it can", self.layout.base, err)
        self.batch_io = config.batch_io and batchio.AVAILABLE
        code, why = hot_path(config.batch_io)
        if code == "ok":
            log.info("kvtier block store: native path (C extension, XXH3-64)")
        else:
            log.warning("kvtier block store: Python path, digest by %s (%s)",
                        payload_digest.BACKEND, why)
        self.metrics.native.labels(code).set(1 if code == "ok" else 0)
        if config.o_direct == "auto":
            self.o_direct = probe_o_direct(self.layout.base)
        else:
            self.o_direct = config.o_direct == "on"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: dict[int, _Job] = {}
        self._finished: deque[JobOutcome] = deque()
        self._cache: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._lookup_queue: deque[bytes] = deque()
        self._lookup_pending: dict[bytes, float] = {}  # key -> when first asked
        self._lookup_cv = threading.Condition()
        self._write_bps = 0.0  # EMA of store throughput, bytes/s
        self._queued_write_bytes = 0
        self._unwritten = 0  # bytes approved for writing, not yet written or failed
        self._made_dirs: set[bytes] = set()  # fan-out directories, by a key's first 2 bytes
        self._blocked_until = 0.0
        self._backoff = 0.0
        self._free_checked = (0.0, 0, 0)  # (when, free bytes left, floor bytes)
        self._logged: set[str] = set()
        self._unfinished_logged = -math.inf  # when drain() last warned (monotonic)
        self._closed = False
        memory_speed = probe_memory_speed(self.layout.base, self.o_direct)
        # Where files move at memory speed, large blocks go piece by piece, each hashed
        # while in cache; a device or network wants one large I/O per file instead.
        self._piece = PIECE if memory_speed else 0
        limit = config.io_threads
        if not limit and memory_speed:
            limit = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 1)
        reads, writes = config.read_threads, config.write_threads
        if limit and limit < reads + writes:
            reads, writes = limit, 0  # every thread then takes loads before stores
        self._pool = IOPool(reads, writes)
        self._lookup_threads = [
            threading.Thread(target=self._lookup_loop, daemon=True, name=f"kvtier-lookup-{n}")
            for n in range(max(1, config.lookup_threads))]
        for thread in self._lookup_threads:
            thread.start()

    # ------------------------------------------------------------- helpers

    def _log_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(message + " (logged once; see kvtier_offload_* metrics)", *args)

    def _buffer(self, size: int, name: str = "bounce") -> mmap.mmap:
        """A page-aligned buffer per I/O thread and use, grown on demand."""
        buf: mmap.mmap | None = getattr(self._local, name, None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = mmap.mmap(-1, padded(size))
            setattr(self._local, name, buf)
        return buf

    def _batches(self, count: int, block: int, reads: bool) -> list[range]:
        """Split a job into batch tasks: enough for the I/O threads free for it right
        now, each at most BATCH_BYTES (one block at least); one block per task on the
        Python path. A lone job spreads over every thread (its latency); under a backlog
        a job goes whole, since more pieces would only queue, and every task costs
        interpreter time and GIL hand-offs (16 threads on 1-block tasks: 256 KiB loads at
        1.4 GB/s, 4.7 GB/s split this way on the same 2 cores)."""
        if not self.batch_io:
            return [range(i, i + 1) for i in range(count)]
        ways = max(1, self._pool.spare(reads))
        per_task = max(1, min(-(-count // ways), BATCH_BYTES // max(block, 1)))
        return [range(i, min(i + per_task, count)) for i in range(0, count, per_task)]

    def _remember(self, key: bytes, present: bool) -> None:
        self._remember_all([key], present)

    def _remember_all(self, keys: Sequence[bytes], present: bool) -> None:
        ttl = self.cfg.lookup_hit_ttl if present else self.cfg.lookup_miss_ttl
        entry = (present, time.monotonic() + ttl)
        with self._lock:
            for key in keys:
                self._cache[key] = entry
                self._cache.move_to_end(key)
            while len(self._cache) > self.cfg.lookup_cache_entries:
                self._cache.popitem(last=False)

    def _cached(self, key: bytes) -> bool | None:
        with self._lock:
            entry = self._cache.get(key)
        return self._answer(entry, time.monotonic())

    @staticmethod
    def _answer(entry: tuple[bool, float] | None, now: float) -> bool | None:
        """A lookup-cache entry's answer now: None where there is none or it expired."""
        return None if entry is None or entry[1] < now else entry[0]

    def _touch(self, path: str, st: os.stat_result) -> None:
        """Refresh atime on a hit so the evictor's LRU holds on noatime/relatime mounts;
        at most once per touch_interval per file (its own atime says when)."""
        now = time.time()
        if now - max(st.st_atime, st.st_mtime) < self.cfg.touch_interval:
            return
        try:
            os.utime(path, (now, st.st_mtime))
        except OSError:
            pass  # read-only volume or a file deleted meanwhile: a hit is still a hit

    # -------------------------------------------------------------- lookup

    def _refused(self, key: object, direction: str) -> bool:
        """Whether key is outside the layout (layout.key_fits), or this process has no
        digest to write or verify a block with: counted, logged once."""
        if not payload_digest.AVAILABLE:
            self.metrics.operations.labels(direction, "no-digest").inc()
            self._log_once("no-digest", "kvtier has no block digest (%s); every block is a "
                           "miss, vLLM recomputes", payload_digest.REASON)
            return True
        if key_fits(key):
            return False
        self.metrics.operations.labels(direction, "bad-key").inc()
        self._log_once("bad-key", "kvtier refused a key of %s (a block key is %d to %d "
                       "bytes); a miss, vLLM recomputes",
                       f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__,
                       MIN_KEY_BYTES, MAX_KEY_BYTES)
        return True

    def _stat_key(self, key: bytes) -> bool:
        path = self.layout.path(key)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            present = False
        else:
            # Only a regular file is a block (a directory is 4096 bytes on ext4, NFS).
            present = stat.S_ISREG(st.st_mode) and st.st_size >= HEADER_SIZE
            if present:
                self._touch(path, st)
        self._remember(key, present)
        self.metrics.lookups.labels("hit" if present else "miss").inc()
        return present

    def lookup(self, key: bytes) -> bool | None:
        """True/False from the cache, or None while a background lookup runs."""
        if self._refused(key, "lookup"):
            return False
        cached = self._cached(key)
        if cached is not None:
            return cached
        now = time.monotonic()
        with self._lookup_cv:
            asked = self._lookup_pending.get(key)
            if asked is None:
                if len(self._lookup_pending) >= self.cfg.lookup_queue_limit:
                    return self._overdue()
                self._lookup_pending[key] = asked = now
                self._lookup_queue.append(key)
                self._lookup_cv.notify()
        if now - asked > self._pending_seconds:
            return self._overdue()
        return None

    @property
    def _pending_seconds(self) -> float:
        return min(self.cfg.lookup_pending_seconds, self.cfg.lookup_hit_ttl / 2)

    def _overdue(self) -> bool:
        """A lookup the volume did not answer in time: a miss (vLLM recomputes)."""
        self.metrics.lookups.labels("overdue").inc()
        self._log_once("lookup-overdue", "kvtier lookups are not answered within %.1fs "
                       "(a slow or hung volume?); answering miss meanwhile",
                       self._pending_seconds)
        return False

    def cached(self, key: bytes) -> bool | None:
        """The lookup cache's answer for key, never a stat: None where it has none."""
        return self._cached(key) if key_fits(key) else None

    def lookup_now(self, keys: Sequence[bytes]) -> list[bool]:
        """Synchronous, batched: cached answers, a stat for the rest."""
        out = []
        for key in keys:
            if self._refused(key, "lookup"):
                out.append(False)
                continue
            cached = self._cached(key)
            out.append(cached if cached is not None else self._stat_key(key))
        return out

    def _lookup_loop(self) -> None:
        while True:
            with self._lookup_cv:
                while not self._lookup_queue and not self._closed:
                    self._lookup_cv.wait()
                if self._closed:
                    return
                # a share of the queue: every lookup thread gets some of a long scan
                share = -(-len(self._lookup_queue) // len(self._lookup_threads))
                batch = [self._lookup_queue.popleft() for _ in range(min(share, 64))]
            try:
                for key in batch:
                    self._stat_key(key)
            finally:
                with self._lookup_cv:
                    for key in batch:
                        self._lookup_pending.pop(key, None)

    def forget(self, key: bytes) -> None:
        if not key_fits(key):
            return  # never cached
        with self._lock:
            self._cache.pop(key, None)

    # ---------------------------------------------------------------- jobs

    def _start_job(self, job_id: int, kind: str, keys: list[bytes]) -> _Job:
        job = _Job(JobOutcome(job_id, kind, keys, [False] * len(keys)), remaining=len(keys))
        with self._lock:
            self._jobs[job_id] = job
        self.metrics.in_queue[kind].inc(len(keys))
        if not keys:
            self._finish(job)
        return job

    def _done(self, job: _Job, index: int, ok: bool, nbytes: int) -> None:
        self._done_all(job, [(index, ok, nbytes)])

    def _done_all(self, job: _Job, results: Sequence[tuple[int, bool, int]]) -> None:
        """Record (index, ok, bytes) results of one job; the last one finishes it."""
        if not results:
            return  # finished already, or not yet: nothing here may finish it again
        with self._lock:
            for index, ok, nbytes in results:
                job.outcome.ok[index] = ok
                job.outcome.nbytes += nbytes if ok else 0
            job.remaining -= len(results)
            last = job.remaining == 0
        self.metrics.in_queue[job.outcome.kind].dec(len(results))
        if last:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        job.outcome.seconds = time.monotonic() - job.started
        with self._lock:
            self._jobs.pop(job.outcome.job_id, None)
            self._finished.append(job.outcome)
            self._idle.notify_all()

    def finished(self) -> list[JobOutcome]:
        with self._lock:
            out = list(self._finished)
            self._finished.clear()
        return out

    def pending_jobs(self) -> int:
        with self._lock:
            return len(self._jobs)

    def drain(self, timeout: float | None = WAIT_SECONDS) -> bool:
        """Wait until every submitted job has finished (results stay in finished()), at
        most timeout seconds (None: as long as it takes). False where some were still
        unfinished then, logged at most once a minute (a caller may poll): an I/O thread
        stuck on the volume (a hung mount), or simply more work than the timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._jobs:
                left = _left(deadline)
                if left is not None and left <= 0:
                    unfinished = len(self._jobs)
                    break
                self._idle.wait(left)
            else:
                return True
            now = time.monotonic()
            warn = timeout and now - self._unfinished_logged >= 60.0
            if warn:
                self._unfinished_logged = now
        if warn:
            log.warning("kvtier: %d job(s) still unfinished after waiting %.1fs; an I/O "
                        "thread may be stuck on the volume", unfinished, timeout)
        return False

    # --------------------------------------------------------------- store

    def store(self, job_id: int, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Queue the writes of one job; never blocks on I/O."""
        self._store(job_id, [k for k, _ in items], _Buffers([d for _, d in items]))

    def store_rows(self, job_id: int, keys: Sequence[bytes], rows: np.ndarray,
                   row_ids: Sequence[int] | np.ndarray) -> None:
        """store() from rows of one 2-D uint8 array (vLLM's CPU tier): rows[row_ids[i]]
        as keys[i]. The same outcomes, addresses taken from the row indices."""
        self._store(job_id, list(keys), _Rows(rows, np.asarray(row_ids, dtype=np.int64)))

    def _store(self, job_id: int, keys: list[bytes], sources: _Dests) -> None:
        job = self._start_job(job_id, "store", keys)
        nbytes = sources.total()
        if self._would_overflow(nbytes):
            self.metrics.dropped.labels("queue-full").inc(len(keys))
            self._log_once("queue-full", "kvtier write queue is over its %.1fs budget; "
                           "dropping stores", self.cfg.write_queue_seconds)
            for i in range(len(keys)):
                self._done(job, i, False, 0)
            return
        with self._lock:
            self._queued_write_bytes += nbytes
        enqueued = time.monotonic()
        block = sources.size(0) if keys else 0
        for batch in self._batches(len(keys), block, reads=False):
            self._pool.submit_write(lambda j=job, b=batch: self._store_task(
                j, keys, sources, b, enqueued))

    def _would_overflow(self, nbytes: int) -> bool:
        with self._lock:
            rate, queued = self._write_bps, self._queued_write_bytes
        return rate > 0 and (queued + nbytes) / rate > self.cfg.write_queue_seconds

    def _free_space_ok(self, size: int) -> bool:
        """Whether writing size more bytes keeps the volume above its free-space floor.
        statvfs is re-read at most once a second, or every time near the floor; bytes
        approved since are reserved against it, and statvfs cannot see bytes approved but
        not yet written (a batch approves all its blocks first), so a burst cannot
        overshoot."""
        if self.cfg.free_space_floor_percent <= 0:
            return True  # no floor: the write itself finds out (ENOSPC backs off)
        now = time.monotonic()
        with self._lock:
            checked_at, free, floor = self._free_checked
            stale = now - checked_at >= 1.0 or free - size < 2 * floor
        if stale:
            try:
                st = os.statvfs(self.layout.base)
            except OSError:
                return True  # cannot tell: let the write itself find out
            with self._lock:
                free = st.f_bavail * st.f_frsize - self._unwritten
            floor = int(st.f_blocks * st.f_frsize * self.cfg.free_space_floor_percent / 100)
            checked_at = now
        with self._lock:
            ok = free - size >= floor
            self._free_checked = (checked_at, free - size if ok else free, floor)
        return ok

    def _store_task(self, job: _Job, keys: list[bytes], sources: _Dests, batch: range,
                    enqueued: float) -> None:
        progress = _BatchProgress()
        try:
            self._store_batch(job, keys, sources, batch, enqueued, progress)
        except Exception as err:  # never let one batch take down an I/O thread
            self.metrics.failed.labels(type(err).__name__).inc()
            self._log_once(f"store-{type(err).__name__}", "kvtier store failed: %s", err)
        finally:
            for index in batch:
                if index not in progress.settled:
                    self._store_settle(job, index, False, sources.size(index), progress)

    def _store_settle(self, job: _Job, index: int, ok: bool, size: int,
                      progress: _BatchProgress) -> None:
        self._store_settle_all(job, [(index, ok, size)], progress)

    def _store_settle_all(self, job: _Job, results: Sequence[tuple[int, bool, int]],
                          progress: _BatchProgress) -> None:
        progress.settled.update(index for index, _, _ in results)
        with self._lock:
            for index, _, size in results:
                self._queued_write_bytes -= size
                if index in progress.approved:
                    self._unwritten -= HEADER_SIZE + size
        self._done_all(job, results)

    def _store_batch(self, job: _Job, keys: list[bytes], sources: _Dests, batch: range,
                     enqueued: float, progress: _BatchProgress) -> None:
        """Decide each block (drop, already there, write); write the batchable ones in
        one batch, the rest and whatever the batch could not finish on the Python path."""
        start = time.monotonic()
        at: dict[int, int] = {}
        if self.batch_io:
            indices, addresses = sources.batchable(batch, self.o_direct, writes_into=False)
            # A key outside the layout goes the per-block way, where it is refused.
            at = {index: address for index, address in zip(indices, addresses.tolist(),
                                                           strict=True)
                  if key_fits(keys[index])}
        total = sum(HEADER_SIZE + sources.size(index) for index in batch)
        if len(at) == len(batch) and self._batch_may_write(enqueued, start, total):
            indices = self._approve_batch(job, keys, sources, batch, progress)
            batch = range(0)  # decided: the loop below is for batches that need it per block
        else:
            indices = []
        for index in batch:
            key, size = keys[index], sources.size(index)
            batchable = index in at
            # The batch checks for an existing file itself, in C.
            verdict = self._store_verdict(key, size, enqueued, start, look=not batchable)
            if verdict is not None:
                self._store_settle(job, index, verdict, size, progress)
                continue
            with self._lock:
                self._unwritten += HEADER_SIZE + size
            progress.approved.add(index)
            if batchable:
                indices.append(index)
            else:
                ok = self._store_python(key, sources.view(index), self.layout.path(key))
                self._store_settle(job, index, ok, size, progress)
        if not indices:
            return
        batch_keys = [keys[index] for index in indices]
        sizes = sources.sizes(indices)
        headers = self._buffer(len(indices) * HEADER_SIZE, "headers")
        for key in batch_keys:
            self._ensure_parent(key)
        began = time.monotonic()
        each = np.zeros(len(indices))
        status = batchio.write_blocks(self._base_c, self._prefix, batch_keys,
                                      secrets.token_hex(8).encode(),
                                      np.array([at[index] for index in indices], dtype=np.int64),
                                      sizes, memoryview(headers), self.o_direct, self.cfg.fsync,
                                      self._piece, seconds=each)
        seconds = time.monotonic() - began
        settled: list[tuple[int, bool, int]] = []
        written: list[bytes] = []
        written_sizes: list[int] = []
        times: list[float] = []
        there: list[bytes] = []
        for index, key, size, st, took in zip(indices, batch_keys, sizes.tolist(),
                                              status.tolist(), each.tolist(), strict=True):
            if st == batchio.DONE:
                written.append(key)
                written_sizes.append(size)
                times.append(took)
            elif st == batchio.EXISTS:  # another pod or node stored it first: same bytes
                there.append(key)
            else:  # a directory reaped since it was made, or an error: Python decides
                ok = self._store_python(key, sources.view(index), self.layout.path(key))
                self._store_settle(job, index, ok, size, progress)
                continue
            settled.append((index, True, size))
        self._stored_all(written, written_sizes, seconds, times)
        if there:
            self.metrics.operations.labels("store", "exists").inc(len(there))
            self._remember_all(there, True)
        self._store_settle_all(job, settled, progress)

    def _batch_may_write(self, enqueued: float, now: float, total: int) -> bool:
        """Whether every block of a batch passes _store_verdict's time, backoff and floor
        checks, decided once (the floor reserving all of total); False sends the batch
        through those checks block by block, which may approve part of it."""
        return (now - enqueued <= self.cfg.write_queue_seconds and now >= self._blocked_until
                and self._free_space_ok(total))

    def _approve_batch(self, job: _Job, keys: list[bytes], sources: _Dests, batch: range,
                       progress: _BatchProgress) -> list[int]:
        """_store_verdict's last check (already stored, by the lookup cache) for a whole
        batch under one lock; settles those, approves and returns the rest."""
        now = time.monotonic()
        with self._lock:
            entries = [self._cache.get(keys[index]) for index in batch]
        there = [index for index, entry in zip(batch, entries, strict=True)
                 if self._answer(entry, now)]
        if there:  # another pod or node stored them first: same bytes
            self.metrics.operations.labels("store", "exists").inc(len(there))
            self._store_settle_all(job, [(index, True, sources.size(index)) for index in there],
                                   progress)
        skip = set(there)
        approved = [index for index in batch if index not in skip]
        with self._lock:
            self._unwritten += sum(HEADER_SIZE + sources.size(index) for index in approved)
        progress.approved.update(approved)
        return approved

    def _ensure_parent(self, key: bytes) -> None:
        """Create a block's fan-out directory once per process, so first writes take the
        batch path too (one the evictor removed since makes that block fall back to the
        Python path, which recreates it). The directory is named by the key's first two
        bytes: those stand for it, no path needed when it is there."""
        if key[:2] not in self._made_dirs:
            try:
                self.layout.ensure_dir(os.path.dirname(self.layout.path(key)))
            except OSError:
                return  # the write finds out and says why
            with self._lock:  # at most 65,536: the layout's fan-out bounds it
                self._made_dirs.add(key[:2])

    def _store_verdict(self, key: bytes, size: int, enqueued: float, now: float,
                       look: bool = True) -> bool | None:
        """False: drop this store; True: already stored; None: write it. look: also
        ask the volume whether the file is there (the batch path asks it itself)."""
        if self._refused(key, "store"):
            return False
        if now - enqueued > self.cfg.write_queue_seconds:
            self.metrics.dropped.labels("stale").inc()
            return False
        if now < self._blocked_until:
            self.metrics.dropped.labels("backoff").inc()
            return False
        if not self._free_space_ok(HEADER_SIZE + size):
            self.metrics.dropped.labels("free-space-floor").inc()
            self._log_once("floor", "kvtier volume below its %.1f%% free-space floor; "
                           "not writing", self.cfg.free_space_floor_percent)
            return False
        if self._cached(key) or (look and self._regular_file_at(self.layout.path(key))):
            self.metrics.operations.labels("store", "exists").inc()
            return True  # another pod or node stored it first: same bytes
        return None

    def _store_python(self, key: bytes, data: memoryview, path: str) -> bool:
        start = time.monotonic()
        if start < self._blocked_until:  # an earlier block of this batch backed off
            self.metrics.dropped.labels("backoff").inc()
            return False
        try:
            self._write_file(key, data, path)
        except OSError as err:
            name = errno.errorcode.get(err.errno or 0, type(err).__name__)
            self.metrics.failed.labels(name).inc()
            self._log_once(f"store-{name}", "kvtier cannot write %s: %s", path, err)
            if err.errno in BACKOFF_ERRNOS:
                self._backoff = min(max(self._backoff * 2, 1.0), 60.0)
                self._blocked_until = time.monotonic() + self._backoff
            return False
        took = time.monotonic() - start
        self._stored_all([key], [len(data)], took, [took])
        return True

    def _stored_all(self, keys: list[bytes], sizes: list[int], seconds: float,
                    each: Sequence[float]) -> None:
        """Count blocks written to the volume in `seconds` together, `each` the time
        each block took."""
        if not keys:
            return
        self._backoff = 0.0
        rate = sum(sizes) / max(seconds, 1e-6)
        keep = 0.8 ** len(keys)  # as if each block had moved the average 20% of the way
        with self._lock:
            self._write_bps = rate if self._write_bps == 0 else (
                keep * self._write_bps + (1 - keep) * rate)
        self._remember_all(keys, True)
        self.metrics.store_ok.inc(len(keys))
        self.metrics.store_bytes.inc(sum(sizes))
        observe_all(self.metrics.store_latency, each)

    def _write_file(self, key: bytes, data: memoryview, path: str) -> None:
        header = encode_header(self.layout.fingerprint, key, len(data), digest(data))
        tmp = self.layout.temp_path(key)
        directory = os.path.dirname(path)
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        direct = self.o_direct
        for attempt in range(2):
            try:
                fd = os.open(tmp, flags | (os.O_DIRECT if direct else 0), 0o664)
                break
            except FileNotFoundError:
                if attempt:
                    raise
                self.layout.ensure_dir(directory)  # first write here, or reaped as empty
        try:
            try:
                if direct:
                    self._write_direct(fd, header, data)
                else:
                    self._write_all(fd, [header, data])
                if self.cfg.fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)  # close errors (NFS reports ENOSPC here) must propagate
            # Atomic publish. A concurrent writer of the same key wrote the same bytes
            # (the key is a hash of the tokens under one fingerprint): whichever rename
            # lands last wins, readers keep whatever inode they opened, nothing mixes.
            os.replace(tmp, path)
            return
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @staticmethod
    def _write_all(fd: int, parts: list[bytes | memoryview | mmap.mmap]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)
        written = 0
        while written < total:
            n = os.writev(fd, views)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            written += n
            _advance(views, n)

    @staticmethod
    def _read_all(fd: int, parts: list[memoryview]) -> int:
        """preadv until the buffers are full or the file ends; returns bytes read."""
        views = [p.cast("B") for p in parts]
        offset = 0
        while views:
            n = os.preadv(fd, views, offset)
            if n <= 0:
                break  # end of file
            offset += n
            _advance(views, n)
        return offset

    def _write_direct(self, fd: int, header: bytes, data: memoryview) -> None:
        if _aligned(data):
            head = self._buffer(HEADER_SIZE)
            head[:HEADER_SIZE] = header
            self._write_all(fd, [memoryview(head)[:HEADER_SIZE], data])
            return
        total = padded(HEADER_SIZE + len(data))
        buf = self._buffer(total)
        buf[:HEADER_SIZE] = header
        buf[HEADER_SIZE:HEADER_SIZE + len(data)] = data
        buf[HEADER_SIZE + len(data):total] = bytes(total - HEADER_SIZE - len(data))
        self._write_all(fd, [memoryview(buf)[:total]])

    # ---------------------------------------------------------------- load

    def load(self, job_id: int, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Queue the reads of one job into the given (writable) buffers."""
        self._load(job_id, [k for k, _ in items], _Buffers([d for _, d in items]))

    def load_rows(self, job_id: int, keys: Sequence[bytes], rows: np.ndarray,
                  row_ids: Sequence[int] | np.ndarray) -> None:
        """load() into rows of one 2-D uint8 array (vLLM's CPU tier): keys[i] into
        rows[row_ids[i]]. The same outcomes; the batch path takes each row's address from
        its index instead of a buffer object per row (less interpreter time per row)."""
        self._load(job_id, list(keys), _Rows(rows, np.asarray(row_ids, dtype=np.int64)))

    def _load(self, job_id: int, keys: list[bytes], dests: _Dests) -> None:
        job = self._start_job(job_id, "load", keys)
        for batch in self._batches(len(keys), dests.size(0) if keys else 0, reads=True):
            self._pool.submit_read(lambda j=job, b=batch: self._load_task(j, keys, dests, b))

    def _load_task(self, job: _Job, keys: list[bytes], dests: _Dests, batch: range) -> None:
        settled: set[int] = set()
        try:
            if self.batch_io:
                # Machine code writes through a raw address: never into a read-only buffer.
                indices, addresses = dests.batchable(batch, self.o_direct)
                if not all(key_fits(keys[index]) for index in indices):
                    fit = [n for n, index in enumerate(indices) if key_fits(keys[index])]
                    indices, addresses = [indices[n] for n in fit], addresses[fit]
                if indices:
                    self._load_batch(job, keys, dests, indices, addresses, settled)
            for index in batch:
                if index not in settled:
                    ok = self._load_one(keys[index], dests.view(index))
                    settled.add(index)  # only now: if it raised, finally reports it failed
                    self._done(job, index, ok, dests.size(index))
        except Exception as err:
            self.metrics.operations.labels("load", "error").inc()
            self._log_once(f"load-{type(err).__name__}", "kvtier load failed: %s", err)
        finally:
            for index in batch:
                if index not in settled:
                    self._done(job, index, False, dests.size(index))

    def _load_batch(self, job: _Job, keys: list[bytes], dests: _Dests, indices: list[int],
                    addresses: np.ndarray, settled: set[int]) -> None:
        """Read, hash and check a batch in one call, against the headers its blocks must
        have. A block it could not serve (missing, short, damaged, foreign) is left to the
        Python path (not settled), which reads it again and says why."""
        headers = self._buffer(len(indices) * HEADER_SIZE, "headers")
        batch_keys = [keys[i] for i in indices]
        sizes = dests.sizes(indices)
        each = np.zeros(len(indices))
        status, last_used = batchio.read_blocks(self._base_c, self._prefix, batch_keys,
                                                addresses, sizes, memoryview(headers),
                                                self.o_direct, self._piece, seconds=each)
        if status.any():  # (DONE is 0) not all served; the usual case takes no indexing
            served = np.flatnonzero(status == batchio.DONE).tolist()
            if not served:
                return
            batch_keys = [batch_keys[n] for n in served]
            indices = [indices[n] for n in served]
            sizes, each, last_used = sizes[served], each[served], last_used[served]
        stale = time.time_ns() - int(self.cfg.touch_interval * 1e9)
        # Touched at most once per touch_interval (0, unknown, counts as stale).
        for n in np.flatnonzero(last_used <= stale).tolist():
            path = self.layout.path(batch_keys[n])
            try:
                self._touch(path, os.stat(path))
            except OSError:
                pass  # evicted since it was read: the bytes were verified, a hit
        served_sizes = sizes.tolist()
        self._remember_all(batch_keys, True)
        self.metrics.load_ok.inc(len(indices))
        self.metrics.load_bytes.inc(sum(served_sizes))
        observe_all(self.metrics.load_latency, each)
        settled.update(indices)
        self._done_all(job, [(index, True, size) for index, size in zip(indices, served_sizes,
                                                                        strict=True)])

    def _load_one(self, key: bytes, dest: memoryview) -> bool:
        """Load one block into dest on the Python path."""
        if self._refused(key, "load"):
            return False
        start = time.monotonic()
        path = self.layout.path(key)
        try:
            self._read_verified(key, dest, path)
        except FileNotFoundError:
            self._remember(key, False)
            self.metrics.operations.labels("load", "missing").inc()
            return False
        except BadBlock as bad:
            self.metrics.corrupt.labels(bad.reason).inc()
            removed = self._remove_bad(path, bad)
            self._log_once(f"bad-{bad.reason}", "kvtier refused block file %s (%s); %s, "
                           "vLLM recomputes", path, bad,
                           "removed it" if removed else "could not remove it")
            self._remember(key, False)
            return False
        except OSError as err:
            name = errno.errorcode.get(err.errno or 0, type(err).__name__)
            self.metrics.operations.labels("load", name).inc()
            self._log_once(f"load-{name}", "kvtier cannot read %s: %s", path, err)
            return False
        self.metrics.load_ok.inc()
        self.metrics.load_bytes.inc(len(dest))
        self.metrics.load_latency.observe(time.monotonic() - start)
        return True

    def _check(self, key: bytes, size: int, header: memoryview, payload_digest: int) -> None:
        expected = decode_header(header, self.layout.fingerprint, key, size)
        if payload_digest != expected:
            raise BadBlock("bad-checksum", "payload checksum mismatch")

    @staticmethod
    def _regular_file_at(path: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
        except OSError:
            return False

    @staticmethod
    def _remove_bad(path: str, bad: BadBlock) -> bool:
        """Remove a refused block file; True where it is gone. A FIFO, socket, device or
        symlink goes by unlink (only the name: no target is touched); a directory only
        where empty (rmdir): one with entries stays, a miss on every lookup."""
        try:
            if isinstance(bad, NotAFile) and bad.kind == "directory":
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            return False
        return True

    def _read_verified(self, key: bytes, dest: memoryview, path: str) -> None:
        size = len(dest)
        direct = self.o_direct
        try:
            # Never waits (a FIFO opens at once), never follows a symlink (ELOOP).
            fd = os.open(path, batchio.READ_FLAGS | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            raise
        except OSError as err:  # ELOOP for a symlink, EINVAL/ENXIO for some special files
            try:
                kind = _odd_kind(os.stat(path, follow_symlinks=False).st_mode)
            except OSError:
                kind = None
            if kind is None:
                raise
            raise NotAFile(kind) from err
        try:
            st = os.fstat(fd)
            kind = _odd_kind(st.st_mode)
            if kind is not None:  # checked before a byte is read
                raise NotAFile(kind)
            if st.st_size < HEADER_SIZE + size:
                raise BadBlock("truncated", f"{st.st_size} bytes, need {HEADER_SIZE + size}")
            if direct and not _aligned(dest):
                total = padded(HEADER_SIZE + size)
                buf = self._buffer(total)
                got = self._read_all(fd, [memoryview(buf)[:total]])
                header = memoryview(buf)[:HEADER_SIZE]
                dest[:] = memoryview(buf)[HEADER_SIZE:HEADER_SIZE + size]
            else:
                head = self._buffer(HEADER_SIZE) if direct else bytearray(HEADER_SIZE)
                header = memoryview(head)[:HEADER_SIZE]
                got = self._read_all(fd, [header, dest])
            if got < HEADER_SIZE + size:
                raise BadBlock("truncated", f"read {got} bytes")
            self._check(key, size, header, digest(dest))
        finally:
            os.close(fd)
        self._remember(key, True)
        self._touch(path, st)

    # ------------------------------------------------------------ lifetime

    def close(self, timeout: float | None = WAIT_SECONDS) -> bool:
        """Finish queued work, then stop every thread, within timeout seconds in all
        (None: as long as it takes). False where time ran out, logged: work not started
        by then is dropped (its jobs never finish), and a thread stuck in a call on the
        volume is left behind (a daemon thread, it ends with the process; a load it is
        in may still write its destination when the call returns). A second call returns
        True at once."""
        if self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self.drain(timeout)
        self._closed = True
        with self._lookup_cv:
            self._lookup_cv.notify_all()
        stopped = self._pool.close(_left(deadline))
        for thread in self._lookup_threads:
            thread.join(_left(deadline))
        if drained and stopped and not any(t.is_alive() for t in self._lookup_threads):
            return True
        log.warning("kvtier: closed with threads still stuck after %.1fs; left them behind",
                    timeout)
        return False
