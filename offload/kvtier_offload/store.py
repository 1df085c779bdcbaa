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
A store never starts without a digest to verify blocks with (NoDigest): a backend that
quietly missed every block would cost every request a recompute and say nothing.
Waiting on the I/O threads (drain, close) is bounded: a thread stuck in the kernel on a
hung mount costs the caller at most the timeout, never the engine.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier_offload import batchio, native
from kvtier_offload import digest as payload_digest
from kvtier_offload.buffers import BlockBuffers, BufferList, RowArray
from kvtier_offload.capacity import BoundedFiles
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, BadBlock, decode_header
from kvtier_offload.fileio import BlockFiles
from kvtier_offload.iopool import MAX_NICE, IOPool
from kvtier_offload.jobs import Job, JobOutcome, JobTable, Result, time_left
from kvtier_offload.layout import MAX_KEY_BYTES, MIN_KEY_BYTES, Layout, key_fits
from kvtier_offload.lookup import BackgroundLookup, LookupCache
from kvtier_offload.metrics import Metrics, observe_all
from kvtier_offload.probes import file_seconds, probe_o_direct
from kvtier_offload.removals import Removals
from kvtier_offload.write_admission import WriteAdmission

__all__ = ["BATCH_BYTES", "MEMORY_SPEED_SECONDS", "PIECE", "WAIT_SECONDS", "BlockStore",
           "JobOutcome", "NoDigest", "StoreConfig", "hot_path", "probe_memory_speed",
           "probe_o_direct", "split_job"]

log = logging.getLogger("kvtier_offload")

BATCH_BYTES = 8 << 20  # a batch task moves at most this much (at least one block)
PIECE = 512 << 10  # larger blocks move in pieces of this on memory-speed volumes
# drain() and close() wait at most this long by default: far longer than any healthy
# job (a store waits at most write_queue_seconds to start), short enough that a thread
# stuck on a hung mount does not hang its caller for good.
WAIT_SECONDS = 120.0
MEMORY_SPEED_SECONDS = 250e-6  # per 256 KiB file write or read: a RAM-backed volume


def probe_memory_speed(directory: str, o_direct: bool) -> bool:
    """Whether whole 256 KiB files are created, written, read and removed here at memory
    speed (tmpfs, a page-cached mount): then the I/O threads are CPU-bound. False where
    the volume cannot tell (read-only, full): every thread is kept."""
    seconds = file_seconds(directory, o_direct)
    return seconds is not None and seconds < MEMORY_SPEED_SECONDS


def split_job(count: int, block: int, spare: int) -> list[range]:
    """A job of count blocks of block bytes as batch tasks: as many as the spare I/O
    threads (one at least), each at most BATCH_BYTES (one block at least). A lone job
    spreads over every thread (its latency); under a backlog (no spare thread) it goes
    whole, since more pieces would only queue, and every task costs interpreter time and
    GIL hand-offs."""
    ways = max(1, spare)
    per_task = max(1, min(-(-count // ways), BATCH_BYTES // max(block, 1)))
    return [range(i, min(i + per_task, count)) for i in range(0, count, per_task)]


def _sized_pool(config: StoreConfig, memory_speed: bool) -> IOPool:
    """The I/O threads for config: at most io_threads, or one per core where files move
    at memory speed (then every thread takes loads before stores; with store_nice, as
    many store threads of their own)."""
    limit = config.io_threads
    if not limit and memory_speed:
        limit = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    reads, writes = config.read_threads, config.write_threads
    if writes and config.store_nice:
        # Stores have their own threads (iopool), the limit holding for each kind. Loads
        # keep as many threads as they could take when every thread took either kind
        # (read_threads + write_threads): a load alone is not slowed by the split.
        loads = reads + writes
        return IOPool(min(loads, limit) if limit else loads,
                      min(writes, limit) if limit else writes, store_nice=config.store_nice)
    if limit and limit < reads + writes:
        reads, writes = limit, 0
    return IOPool(reads, writes)


class NoDigest(RuntimeError):
    """Neither the C extension nor python-xxhash loads: no block could be verified, so the
    store does not start (vLLM then fails at start, the reason in its log)."""


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
    # With store_nice the bound holds for each kind: loads and stores have their own.
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
    # Store threads run this much nicer than the engine (iopool: stores and loads then have
    # their own threads); on a starved host the engine's prefill goes ahead of background
    # stores' copies and digests. Nice, not SCHED_IDLE: a store thread at nice +10 still
    # gets about a tenth of a core the engine keeps busy, so stores go on (and those
    # waiting longer than write_queue_seconds are dropped, counted); SCHED_IDLE would
    # starve them for as long as the engine runs. 0: one pool shared by loads and stores,
    # all at the engine's priority.
    store_nice: int = 10
    # A node-local tier's bound on its block files' bytes, least recently used evicted to
    # stay under it (capacity.py); 0: unbounded (a shared volume: the evictor's job).
    capacity_bytes: int = 0

    def __post_init__(self) -> None:
        nice = self.store_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= MAX_NICE:
            raise ValueError(f"kvtier store_nice must be a whole number from 0 to {MAX_NICE} "
                             f"(how much lower than the engine's the store threads' CPU "
                             f"priority is; 0: the same), not {nice!r}")


@dataclass
class _BatchProgress:
    settled: set[int] = field(default_factory=set)  # indices reported done
    approved: set[int] = field(default_factory=set)  # indices reserved against the floor


class BlockStore:
    """Loads and stores of whole jobs of blocks, never blocking the caller on I/O, and
    lookups answered from a cache. It composes the parts: jobs (jobs.JobTable) run on
    an I/O pool (iopool.IOPool) in batch tasks; the lookup cache and its threads
    (lookup); write admission (admission.WriteAdmission); the block files (fileio,
    the C extension through batchio, the Python path for the rest). It owns what ties
    them together: which blocks go which way, and what each outcome counts and logs."""

    def __init__(self, config: StoreConfig, metrics: Metrics | None = None, *,
                 pool: IOPool | None = None) -> None:
        """pool: the I/O threads to run on (the store closes it); by default a pool sized
        from config and the volume (io_threads)."""
        self.cfg = config
        self.layout = Layout(config.root, config.fingerprint)
        self.metrics = metrics or Metrics()
        # The block files this store removes (corrupt, or evicted by a bounded tier), for
        # the KV events of a tier that publishes them (vllm_tier, tier_events).
        self.removals: Removals | None = None
        if not payload_digest.AVAILABLE:
            self.metrics.native.labels("no-digest").set(0)
            message = (f"kvtier block store cannot start: no XXH3-64 digest to verify blocks "
                       f"with ({payload_digest.REASON}). Use the kvtier-offload image's C "
                       "extension for this platform, or install python-xxhash into the model "
                       "server's image")
            log.error("%s", message)
            raise NoDigest(message)
        self._files: BlockFiles
        if config.capacity_bytes:  # an evicted block must stop being a cached lookup hit
            self._files = BoundedFiles(self.layout, config.capacity_bytes,
                                       forget=lambda key: self.forget(key),
                                       removed=self._removed)
        else:
            self._files = BlockFiles(self.layout, direct=False)
        try:
            self._files.ensure_dirs(self.layout.base)
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
            direct = probe_o_direct(self.layout.base)
        else:
            direct = config.o_direct == "on"
        memory_speed = probe_memory_speed(self.layout.base, direct)
        # Where files move at memory speed, large blocks go piece by piece, each hashed
        # while in cache; a device or network wants one large I/O per file instead.
        files = self._files
        files.direct, files.fsync, files.piece = direct, config.fsync, (
            PIECE if memory_speed else 0)
        self._jobs = JobTable(self.metrics.in_queue)
        self._lookups = LookupCache(config.lookup_hit_ttl, config.lookup_miss_ttl,
                                    config.lookup_cache_entries)
        self._admission = WriteAdmission(self.layout.base, config.write_queue_seconds,
                                         config.free_space_floor_percent)
        self._logged: set[str] = set()
        self._closed = False
        self._pool = pool if pool is not None else _sized_pool(config, memory_speed)
        # every thread writes where the pool has no write-first threads
        self._admission.writers = self._pool.write_threads or self._pool.threads
        self._background = BackgroundLookup(
            self._stat_key, config.lookup_threads, config.lookup_queue_limit,
            min(config.lookup_pending_seconds, config.lookup_hit_ttl / 2))

    # ------------------------------------------------ settings and parts' state

    @property
    def o_direct(self) -> bool:
        """Whether block files are read and written with O_DIRECT."""
        return self._files.direct

    @o_direct.setter
    def o_direct(self, value: bool) -> None:
        self._files.direct = value

    @property
    def files(self) -> BlockFiles:
        """The block files' reader and writer (the Python path and the batch path)."""
        return self._files

    @property
    def admission(self) -> WriteAdmission:
        """Which stores may be written: the queue budget, backoff, the free-space floor."""
        return self._admission

    @property
    def pool(self) -> IOPool:
        """The I/O threads the store's jobs run on."""
        return self._pool

    @property
    def jobs(self) -> JobTable:
        """Jobs submitted and the outcomes of finished ones not yet taken."""
        return self._jobs

    # ---------------------------------------------------------------- helpers

    def _log_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(message + " (logged once; see kvtier_offload_* metrics)", *args)

    def _batches(self, count: int, block: int, reads: bool) -> list[range]:
        if not self.batch_io:
            return [range(i, i + 1) for i in range(count)]  # the Python path: one a task
        return split_job(count, block, self._pool.spare(reads))

    def _refused(self, key: object, direction: str) -> bool:
        """Whether key is outside the layout (layout.key_fits): counted, logged once."""
        if key_fits(key):
            return False
        self.metrics.operations.labels(direction, "bad-key").inc()
        self._log_once("bad-key", "kvtier refused a key of %s (a block key is %d to %d "
                       "bytes); a miss, vLLM recomputes",
                       f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__,
                       MIN_KEY_BYTES, MAX_KEY_BYTES)
        return True

    # ----------------------------------------------------------------- lookup

    def _stat_key(self, key: bytes) -> bool:
        path = self.layout.path(key)
        try:
            st = self._files.lstat(path)
        except OSError:
            present = False
        else:
            # Only a regular file is a block (a directory is 4096 bytes on ext4, NFS).
            present = stat.S_ISREG(st.st_mode) and st.st_size >= HEADER_SIZE
        self._lookups.remember((key,), present)
        self.metrics.lookups.labels("hit" if present else "miss").inc()
        if present:  # after the answer: a request waits on it, not on the atime refresh
            self._files.touch(path, st, self.cfg.touch_interval)
        return present

    def lookup(self, key: bytes, patient: bool = False) -> bool | None:
        """True/False from the cache, or None while a background lookup runs. patient:
        the caller bounds the wait itself (recompute_bound.py): no lookup_pending_seconds
        deadline, only a full queue makes the key a miss."""
        if self._refused(key, "lookup"):
            return False
        cached = self._lookups.get(key)
        if cached is not None:
            return cached
        return None if self._background.ask(key, patient) else self._overdue()

    def stat_seconds(self) -> float | None:
        """The volume's measured round trip for one stat (lookup.BackgroundLookup)."""
        return self._background.stat_seconds()

    def expected_lookup_wait(self) -> float | None:
        """How long the keys waiting for a stat now will take to be answered, at the
        volume's measured round trip; None before any stat began."""
        return self._background.expected_wait()

    def _overdue(self) -> bool:
        """A lookup the volume did not answer in time: a miss (vLLM recomputes)."""
        self.metrics.lookups.labels("overdue").inc()
        self._log_once("lookup-overdue", "kvtier lookups are not answered within %.1fs "
                       "(a slow or hung volume?); answering miss meanwhile",
                       self._background.pending_seconds)
        return False

    def bounded_usage(self) -> tuple[int, int] | None:
        """(bytes the block files take with writes in flight, the capacity) of a tier
        bounded inside the backend (capacity_bytes); None for an unbounded one (the
        shared volume, which the evictor holds to its watermarks)."""
        files = self._files
        if not isinstance(files, BoundedFiles):
            return None
        used, claimed = files.usage()
        return used + claimed, files.limit

    def cached(self, key: bytes) -> bool | None:
        """The lookup cache's answer for key, never a stat: None where it has none."""
        return self._lookups.get(key) if key_fits(key) else None

    def lookup_now(self, keys: Sequence[bytes]) -> list[bool]:
        """Synchronous, batched: cached answers, a stat for the rest."""
        out = []
        for key in keys:
            if self._refused(key, "lookup"):
                out.append(False)
                continue
            cached = self._lookups.get(key)
            out.append(cached if cached is not None else self._stat_key(key))
        return out

    def _removed(self, keys: list[bytes]) -> None:
        """Block files this store removed: kept for KV events where a tier asked."""
        if self.removals is not None:
            self.removals.add(keys)

    def forget(self, key: bytes) -> None:
        if key_fits(key):  # else never cached
            self._lookups.forget(key)

    # ------------------------------------------------------------------- jobs

    def _start_job(self, job_id: int, kind: str, keys: list[bytes]) -> Job:
        return self._jobs.start(job_id, kind, keys)

    def _done(self, job: Job, index: int, ok: bool, nbytes: int) -> None:
        self._jobs.report(job, [(index, ok, nbytes)])

    def finished(self) -> list[JobOutcome]:
        return self._jobs.finished()

    def pending_jobs(self) -> int:
        return self._jobs.pending()

    def drain(self, timeout: float | None = WAIT_SECONDS) -> bool:
        """Wait until every submitted job has finished (results stay in finished()), at
        most timeout seconds (None: as long as it takes). False where some were still
        unfinished then, logged at most once a minute (a caller may poll): an I/O thread
        stuck on the volume (a hung mount), or simply more work than the timeout."""
        return self._jobs.wait(timeout)

    # ------------------------------------------------------------------ store

    def store(self, job_id: int, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Queue the writes of one job; never blocks on I/O."""
        self._store(job_id, [k for k, _ in items], BufferList([d for _, d in items]))

    def store_rows(self, job_id: int, keys: Sequence[bytes], rows: np.ndarray,
                   row_ids: Sequence[int] | np.ndarray) -> None:
        """store() from rows of one 2-D uint8 array (vLLM's CPU tier): rows[row_ids[i]]
        as keys[i]. The same outcomes, addresses taken from the row indices."""
        self._store(job_id, list(keys), RowArray(rows, np.asarray(row_ids, dtype=np.int64)))

    def _store(self, job_id: int, keys: list[bytes], sources: BlockBuffers) -> None:
        job = self._start_job(job_id, "store", keys)
        if not self._admission.admit(sources.total()):
            self.metrics.dropped.labels("queue-full").inc(len(keys))
            self._log_once("queue-full", "kvtier write queue is over its %.1fs budget; "
                           "dropping stores", self.cfg.write_queue_seconds)
            for i in range(len(keys)):
                self._done(job, i, False, 0)
            return
        enqueued = time.monotonic()
        block = sources.size(0) if keys else 0
        for batch in self._batches(len(keys), block, reads=False):
            self._pool.submit_write(functools.partial(
                self._store_task, job, keys, sources, batch, enqueued))

    def _free_space_ok(self, size: int) -> bool:
        return self._admission.free_space_ok(size)

    def _store_task(self, job: Job, keys: list[bytes], sources: BlockBuffers, batch: range,
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

    def _store_settle(self, job: Job, index: int, ok: bool, size: int,
                      progress: _BatchProgress) -> None:
        self._store_settle_all(job, [(index, ok, size)], progress)

    def _store_settle_all(self, job: Job, results: Sequence[Result],
                          progress: _BatchProgress) -> None:
        """Report blocks of a store done, giving back what admission counted for them."""
        queued = reserved = 0
        for index, _, size in results:
            progress.settled.add(index)
            queued += size
            if index in progress.approved:
                reserved += HEADER_SIZE + size
        self._admission.settle(queued, reserved)
        self._jobs.report(job, results)

    def _store_batch(self, job: Job, keys: list[bytes], sources: BlockBuffers, batch: range,
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
            # The batch path does not stat the volume first (one request per block on a
            # network filesystem): the lookup cache above it skips known blocks, and its
            # rename reports EXISTS where the filesystem can refuse to replace one.
            verdict = self._store_verdict(key, size, enqueued, start, look=not batchable)
            if verdict is not None:
                self._store_settle(job, index, verdict, size, progress)
                continue
            self._admission.reserve(HEADER_SIZE + size)
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
        each = np.zeros(len(indices))
        addresses = np.array([at[index] for index in indices], dtype=np.int64)
        began = time.monotonic()
        status = self._files.write_batch(batch_keys, addresses, sizes, each)
        seconds = time.monotonic() - began
        settled: list[Result] = []
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
            elif st == batchio.EXISTS:  # another pod or node published it first: same bytes
                there.append(key)
            else:  # a directory reaped since it was made, or an error: Python decides
                ok = self._store_python(key, sources.view(index), self.layout.path(key))
                self._store_settle(job, index, ok, size, progress)
                continue
            settled.append((index, True, size))
        self._stored_all(written, written_sizes, seconds, times)
        if there:
            self.metrics.operations.labels("store", "exists").inc(len(there))
            self._lookups.remember(there, True)
        self._store_settle_all(job, settled, progress)

    def _batch_may_write(self, enqueued: float, now: float, total: int) -> bool:
        """Whether every block of a batch passes _store_verdict's time, backoff and floor
        checks, decided once (the floor reserving all of total); False sends the batch
        through those checks block by block, which may approve part of it."""
        return self._admission.late(enqueued, now) is None and self._free_space_ok(total)

    def _approve_batch(self, job: Job, keys: list[bytes], sources: BlockBuffers,
                       batch: range, progress: _BatchProgress) -> list[int]:
        """_store_verdict's last check (already stored, by the lookup cache) for a whole
        batch at once; settles those, approves and returns the rest."""
        answers = self._lookups.get_all([keys[index] for index in batch])
        there = [index for index, present in zip(batch, answers, strict=True) if present]
        if there:  # another pod or node stored them first: same bytes
            self.metrics.operations.labels("store", "exists").inc(len(there))
            self._store_settle_all(job, [(index, True, sources.size(index)) for index in there],
                                   progress)
        skip = set(there)
        approved = [index for index in batch if index not in skip]
        self._admission.reserve(sum(HEADER_SIZE + sources.size(index) for index in approved))
        progress.approved.update(approved)
        return approved

    def _store_verdict(self, key: bytes, size: int, enqueued: float, now: float,
                       look: bool = True) -> bool | None:
        """False: drop this store; True: already stored; None: write it. look: also
        ask the volume whether the file is there (the batch path asks it itself)."""
        if self._refused(key, "store"):
            return False
        late = self._admission.late(enqueued, now)
        if late is not None:
            self.metrics.dropped.labels(late).inc()
            return False
        if not self._free_space_ok(HEADER_SIZE + size):
            self.metrics.dropped.labels("free-space-floor").inc()
            self._log_once("floor", "kvtier volume below its %.1f%% free-space floor; "
                           "not writing", self.cfg.free_space_floor_percent)
            return False
        if self._lookups.get(key) or (
                look and self._files.regular_file_at(self.layout.path(key))):
            self.metrics.operations.labels("store", "exists").inc()
            return True  # another pod or node stored it first: same bytes
        return None

    def _store_python(self, key: bytes, data: memoryview, path: str) -> bool:
        start = time.monotonic()
        if start < self._admission.blocked_until:  # an earlier block backed off
            self.metrics.dropped.labels("backoff").inc()
            return False
        try:
            self._files.write(key, data, path)
        except OSError as err:
            name = errno.errorcode.get(err.errno or 0, type(err).__name__)
            self.metrics.failed.labels(name).inc()
            self._log_once(f"store-{name}", "kvtier cannot write %s: %s", path, err)
            self._admission.failed(err)
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
        nbytes = sum(sizes)
        self._admission.written(nbytes, seconds, len(keys))
        self._lookups.remember(keys, True)
        self.metrics.store_ok.inc(len(keys))
        self.metrics.store_bytes.inc(nbytes)
        observe_all(self.metrics.store_latency, each)

    # ------------------------------------------------------------------- load

    def load(self, job_id: int, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Queue the reads of one job into the given (writable) buffers."""
        self._load(job_id, [k for k, _ in items], BufferList([d for _, d in items]))

    def load_rows(self, job_id: int, keys: Sequence[bytes], rows: np.ndarray,
                  row_ids: Sequence[int] | np.ndarray, urgent: bool = False) -> None:
        """load() into rows of one 2-D uint8 array (vLLM's CPU tier): keys[i] into
        rows[row_ids[i]]. The same outcomes; the batch path takes each row's address from
        its index instead of a buffer object per row (less interpreter time per row).
        urgent: its reads go ahead of every read queued (the engine waits for it)."""
        self._load(job_id, list(keys), RowArray(rows, np.asarray(row_ids, dtype=np.int64)),
                   urgent)

    def _load(self, job_id: int, keys: list[bytes], dests: BlockBuffers,
              urgent: bool = False) -> None:
        job = self._start_job(job_id, "load", keys)
        batches = self._batches(len(keys), dests.size(0) if keys else 0, reads=True)
        # urgent: each batch queued at the front, so the last first (they run in order)
        for batch in reversed(batches) if urgent else batches:
            self._pool.submit_read(functools.partial(self._load_task, job, keys, dests, batch),
                                   urgent)

    def _load_task(self, job: Job, keys: list[bytes], dests: BlockBuffers,
                   batch: range) -> None:
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

    def _load_batch(self, job: Job, keys: list[bytes], dests: BlockBuffers,
                    indices: list[int], addresses: np.ndarray, settled: set[int]) -> None:
        """Read, hash and check a batch in one call, against the headers its blocks must
        have. A block it could not serve (missing, short, damaged, foreign) is left to the
        Python path (not settled), which reads it again and says why."""
        batch_keys = [keys[i] for i in indices]
        sizes = dests.sizes(indices)
        each = np.zeros(len(indices))
        status, last_used = self._files.read_batch(batch_keys, addresses, sizes, each)
        if status.any():  # (DONE is 0) not all served; the usual case takes no indexing
            served = np.flatnonzero(status == batchio.DONE).tolist()
            if not served:
                return
            batch_keys = [batch_keys[n] for n in served]
            indices = [indices[n] for n in served]
            sizes, each, last_used = sizes[served], each[served], last_used[served]
        served_sizes = sizes.tolist()
        self._lookups.remember(batch_keys, True)
        self.metrics.load_ok.inc(len(indices))
        self.metrics.load_bytes.inc(sum(served_sizes))
        observe_all(self.metrics.load_latency, each)
        settled.update(indices)
        self._jobs.report(job, [(index, True, size)
                                for index, size in zip(indices, served_sizes, strict=True)])
        # After the report: the request waits for its bytes, not for the atime refresh
        # (two more round trips per block on a network filesystem). Touched at most once
        # per touch_interval (0, unknown, counts as stale).
        stale = time.time_ns() - int(self.cfg.touch_interval * 1e9)
        for n in np.flatnonzero(last_used <= stale).tolist():
            path = self.layout.path(batch_keys[n])
            try:
                self._files.touch(path, self._files.lstat(path), self.cfg.touch_interval)
            except OSError:
                pass  # evicted since it was read: the bytes were verified, a hit

    def _load_one(self, key: bytes, dest: memoryview) -> bool:
        """Load one block into dest on the Python path."""
        if self._refused(key, "load"):
            return False
        start = time.monotonic()
        path = self.layout.path(key)
        try:
            # A network filesystem's stale name (ESTALE) gets one fresh lookup and retry.
            batchio.again_if_stale(path, lambda: self._read_verified(key, dest, path))
        except FileNotFoundError:
            self._lookups.remember((key,), False)
            self.metrics.operations.labels("load", "missing").inc()
            return False
        except BadBlock as bad:
            self.metrics.corrupt.labels(bad.reason).inc()
            removed = self._files.remove_bad(path, bad)
            if removed:
                self._removed([key])
            self._log_once(f"bad-{bad.reason}", "kvtier refused block file %s (%s); %s, "
                           "vLLM recomputes", path, bad,
                           "removed it" if removed else "could not remove it")
            self._lookups.remember((key,), False)
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

    def _read_verified(self, key: bytes, dest: memoryview, path: str) -> None:
        """Read key's block file into dest and check it; raises what fileio raises, or
        BadBlock for a header or payload that is not key's."""
        header, st = self._files.read(dest, path)
        self._check(key, len(dest), header, digest(dest))
        self._lookups.remember((key,), True)
        self._files.touch(path, st, self.cfg.touch_interval)

    def _check(self, key: bytes, size: int, header: memoryview, payload_digest: int) -> None:
        expected = decode_header(header, self.layout.fingerprint, key, size)
        if payload_digest != expected:
            raise BadBlock("bad-checksum", "payload checksum mismatch")

    # --------------------------------------------------------------- lifetime

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
        self._background.stop()
        stopped = self._pool.close(time_left(deadline))
        if self._background.join(deadline) and drained and stopped:
            self._files.close()  # never under a thread left behind: its fd stays valid
            return True
        log.warning("kvtier: closed with threads still stuck after %.1fs; left them behind",
                    timeout)
        return False
