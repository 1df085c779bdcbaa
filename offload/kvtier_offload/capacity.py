"""A byte bound on a node-local block store, kept inside the backend (issue #38).

vLLM's own fs tier never deletes; on a shared volume kvtier's evictor (a CronJob) keeps
it in check, but a node-local directory (local NVMe, a hostPath, an emptyDir) belongs to
one pod and must never fill the node's disk, so the pod bounds it itself: `BoundedFiles`
is the block store's `BlockFiles` with an account of the bytes its block files take, and
room is made for every write before it starts, by removing the least recently used
block files. Use never passes the bound, not even while writes are in flight: a write
claims its bytes first (evicting what it must), and gives back what it did not use.

What counts: each block file and each temp file found, at its size rounded up to 4 KiB
(the filesystem block). Directories and config.json are not counted (at most 65,792
fan-out directories of one block each; size the volume with that headroom).

Recency: a store, a load and a lookup hit make a block the most recently used. The
account lives in memory (about 200 bytes per block file), so a restart starts from the
files: a background scan of the root counts every block file of every fingerprint and
every temp file before the first write is let through (stores fail with EAGAIN until
then; loads and lookups work at once: the file format verifies what they read). Files
of another fingerprint (another model or configuration: never loaded, the layout never
names them) and temp files (a write a killed process left) are evicted before any block
of this one, temp files first, then the oldest; this configuration's blocks keep the order of their
timestamps (atime, refreshed on hits, or mtime).

The root must belong to one engine process at a time: two bounded stores sharing a
directory would each count only what they wrote since they started.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

import numpy as np

from kvtier_offload import batchio
from kvtier_offload.beneath import parent_beneath
from kvtier_offload.fileformat import HEADER_SIZE, BadBlock
from kvtier_offload.fileio import BlockFiles
from kvtier_offload.layout import FORMAT_DIR, SUFFIX, Layout

log = logging.getLogger("kvtier_offload")

BLOCK = 4096  # what one file's size is rounded up to
BLOCK_NAME = re.compile(r"[0-9a-f]{8,228}\.kvb")
TEMP_NAME = re.compile(r"\.[0-9a-f]{8,228}\.kvb\.[0-9a-f]{16}\.tmp")
FAN_OUT = re.compile(r"[0-9a-f]{2}")
FINGERPRINT = re.compile(r"[0-9a-f]{16}")


def file_bytes(size: int) -> int:
    """What a file of size bytes counts against the bound."""
    return -(-size // BLOCK) * BLOCK


def block_file_bytes(payload: int) -> int:
    """What one block file with a payload of this many bytes counts."""
    return file_bytes(HEADER_SIZE + payload)


def parse_capacity(value: object, payload: int) -> int:
    """The capacity_bytes setting of a tier whose blocks carry payload bytes: a whole
    number of bytes with room for two block files at least; ValueError saying what is
    wrong otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"capacity_bytes must be a whole number of bytes (e.g. "
                         f"107374182400 for 100 GiB), not {value!r}")
    least = 2 * block_file_bytes(payload)
    if value < least:
        raise ValueError(f"capacity_bytes is {value}, but one block file takes "
                         f"{block_file_bytes(payload)} bytes here: give the local tier "
                         f"{least} bytes at least (room for two blocks)")
    return value


def _full(message: str) -> OSError:
    return OSError(errno.EDQUOT, f"{os.strerror(errno.EDQUOT)}: {message}")


class BoundedFiles(BlockFiles):
    """BlockFiles whose files never take more than limit bytes in all (see the module
    docstring). forget(key) is called for every block evicted (the store's lookup cache
    must stop answering hit for it). Thread-safe: one lock guards the account; files are
    removed outside it."""

    def __init__(self, layout: Layout, limit: int,
                 forget: Callable[[bytes], None] | None = None,
                 removed: Callable[[list[bytes]], None] | None = None) -> None:
        super().__init__(layout, direct=False)
        self.limit = limit
        self._forget = forget
        self._removed = removed
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes, LRU first
        self._stale: deque[tuple[str, int]] = deque()  # (path below root, bytes): first out
        self.used = 0  # bytes of files on disk (counted, being removed, or stuck)
        self.claimed = 0  # bytes claimed by writes in flight
        self.evicted_blocks = 0
        self.evicted_bytes = 0
        self.stuck_bytes = 0  # files that could not be removed: still counted
        self.ready = threading.Event()  # set once the files found at start are counted
        self._stop = threading.Event()
        self._scanner = threading.Thread(target=self._scan, daemon=True,
                                         name="kvtier-capacity-scan")
        self._scanner.start()

    # ------------------------------------------------------------- accounting

    def usage(self) -> tuple[int, int]:
        """(bytes on disk, bytes claimed by writes in flight): their sum never passes
        limit once ready (unless files appear that this process did not write)."""
        with self._lock:
            return self.used, self.claimed

    def blocks(self) -> list[bytes]:
        """The keys counted, least recently used first."""
        with self._lock:
            return list(self._blocks)

    def claim(self, nbytes: int) -> None:
        """Make room for nbytes and hold it for a write: evicts least recently used files
        (stale ones first) until used + claimed + nbytes fits. OSError: EAGAIN while the
        files found at start are being counted, EDQUOT where no room can be made (the
        bound is taken by writes in flight)."""
        if not self.ready.is_set():
            raise OSError(errno.EAGAIN, "the local tier is still counting the files it "
                          "found at start")
        if nbytes > self.limit:
            raise _full(f"{nbytes} bytes is more than the local tier's {self.limit}")
        while True:
            with self._lock:
                over = self.used + self.claimed + nbytes - self.limit
                if over <= 0:
                    self.claimed += nbytes
                    return
                victims = self._pick(over)
            if not victims:
                raise _full(f"the local tier's {self.limit} bytes are taken by writes in "
                            "flight")
            self._remove(victims)

    def release(self, nbytes: int) -> None:
        """Give back a claim a write did not use."""
        with self._lock:
            self.claimed -= nbytes

    def written(self, done: list[tuple[bytes, int]], claimed: int) -> None:
        """Blocks (key, bytes) are on disk now, written under a claim of claimed bytes
        in all; a key counted already (replaced by the same bytes) is counted once."""
        with self._lock:
            self.claimed -= claimed
            for key, nbytes in done:
                self.used += nbytes - self._blocks.pop(key, 0)
                self._blocks[key] = nbytes

    def _pick(self, nbytes: int) -> list[tuple[str, bytes | None, int]]:
        """Take files of at least nbytes in all off the account, stale ones first, then
        least recently used: (path below the root, key or None, bytes). Their bytes stay
        in used until they are gone. Under the lock."""
        out: list[tuple[str, bytes | None, int]] = []
        while nbytes > 0 and self._stale:
            rel, size = self._stale.popleft()
            out.append((rel, None, size))
            nbytes -= size
        while nbytes > 0 and self._blocks:
            key, size = self._blocks.popitem(last=False)
            out.append((self.rel(self.layout.path(key)), key, size))
            nbytes -= size
        return out

    def _remove(self, victims: list[tuple[str, bytes | None, int]]) -> None:
        freed = stuck = 0
        keys = []
        for rel, key, size in victims:
            if key is not None and self._forget is not None:
                try:  # before it goes: no cached lookup may call it a hit after
                    self._forget(key)
                except Exception:  # the store's cache may not exist yet (at start)
                    pass
            try:
                fd, name = parent_beneath(self.root_fd(), rel)
                try:
                    os.unlink(name, dir_fd=fd)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                pass  # gone already: its bytes are free
            except OSError as err:
                stuck += size
                log.warning("kvtier local tier cannot remove %s (%s); its %d bytes stay "
                            "counted", rel, err, size)
                continue
            freed += size
            if key is not None:
                keys.append(key)
        with self._lock:
            self.used -= freed
            self.stuck_bytes += stuck
            self.evicted_blocks += len(keys)
            self.evicted_bytes += freed
        if keys and self._removed is not None:
            self._removed(keys)

    def _used_now(self, key: bytes) -> None:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _dropped(self, key: bytes) -> None:
        """A block file removed by the store (refused on load): off the account."""
        with self._lock:
            size = self._blocks.pop(key, None)
            if size is not None:
                self.used -= size

    def _key(self, path: str) -> bytes | None:
        name = path.rpartition("/")[2]
        try:
            return bytes.fromhex(name.removesuffix(SUFFIX))
        except ValueError:
            return None

    # ------------------------------------------------------- the files found

    def _scan(self) -> None:
        """Count what the root holds (every fingerprint's block and temp files), then let
        writes through; down to the bound first where it holds more."""
        try:
            self._count_found()
        except Exception as err:  # never leave writes refused for good
            log.warning("kvtier local tier could not count the files under %s (%s); "
                        "counting from what it writes", self.layout.root, err)
        finally:
            self.ready.set()

    def _count_found(self) -> None:
        own, stale = self._found()
        own.sort()
        stale.sort()
        with self._lock:
            for _, key, size in own:
                self._blocks[key] = size
            self._stale.extend((rel, size) for _, rel, size in stale)
            self.used += sum(size for _, _, size in own) + sum(size for _, _, size in stale)
            over = self.used - self.limit
            victims = self._pick(over) if over > 0 else []
        if victims:
            self._remove(victims)
        log.info("kvtier local tier at %s: found %d blocks of this configuration and %d "
                 "other files (%d bytes in all, bound %d)", self.layout.base, len(own),
                 len(stale), sum(s for *_, s in own) + sum(s for *_, s in stale), self.limit)

    def _found(self) -> tuple[list[tuple[float, bytes, int]], list[tuple[float, str, int]]]:
        own: list[tuple[float, bytes, int]] = []
        stale: list[tuple[float, str, int]] = []
        top = os.path.join(FORMAT_DIR)
        for fp in self._dirs(top, FINGERPRINT):
            mine = fp == self.layout.fingerprint
            for first in self._dirs(f"{top}/{fp}", FAN_OUT):
                for second in self._dirs(f"{top}/{fp}/{first}", FAN_OUT):
                    leaf = f"{top}/{fp}/{first}/{second}"
                    for entry in self._entries(leaf):
                        if self._stop.is_set():
                            return own, stale
                        block = BLOCK_NAME.fullmatch(entry.name)
                        if not block and not TEMP_NAME.fullmatch(entry.name):
                            continue
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if not stat.S_ISREG(st.st_mode):
                            continue
                        when = max(st.st_atime, st.st_mtime)
                        size = file_bytes(st.st_size)
                        if block and mine:
                            own.append((when, bytes.fromhex(entry.name[:-len(SUFFIX)]), size))
                        else:  # a temp file: a write that never finished, out first
                            stale.append((when if block else 0.0, f"{leaf}/{entry.name}",
                                          size))
        return own, stale

    def _entries(self, rel: str) -> Iterator[os.DirEntry[str]]:
        """The entries of a directory below the root; none where it is not a directory
        reached without a symlink."""
        try:
            st = os.lstat(os.path.join(self.layout.root, rel))
            if not stat.S_ISDIR(st.st_mode):
                return
            with os.scandir(os.path.join(self.layout.root, rel)) as it:
                yield from it
        except OSError:
            return

    def _dirs(self, rel: str, pattern: re.Pattern[str]) -> list[str]:
        return sorted(e.name for e in self._entries(rel)
                      if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False))

    def close(self) -> None:
        self._stop.set()
        self._scanner.join(5.0)
        super().close()

    # ------------------------------------------------- BlockFiles, bounded

    def write(self, key: bytes, data: memoryview, path: str) -> None:
        nbytes = block_file_bytes(len(data))
        self.claim(nbytes)
        try:
            super().write(key, data, path)
        except BaseException:
            self.release(nbytes)
            raise
        self.written([(key, nbytes)], nbytes)

    def write_batch(self, keys: list[bytes], addresses: np.ndarray, sizes: np.ndarray,
                    seconds: np.ndarray) -> np.ndarray:
        each = [block_file_bytes(int(size)) for size in sizes.tolist()]
        total = sum(each)
        try:
            self.claim(total)
        except OSError:
            # Not done: the store writes these one by one on its Python path, each
            # claiming its own bytes, and that path says why one cannot be written.
            seconds[:] = 0
            return np.full(len(keys), batchio.NOT_DONE, dtype=np.int64)
        try:
            status = super().write_batch(keys, addresses, sizes, seconds)
        except BaseException:
            self.release(total)
            raise
        done = []
        for key, nbytes, st in zip(keys, each, status.tolist(), strict=True):
            if st == batchio.DONE:
                done.append((key, nbytes))
            elif st == batchio.EXISTS:
                with self._lock:
                    known = key in self._blocks
                if not known:  # on disk and not counted: count it now
                    done.append((key, nbytes))
                else:
                    self._used_now(key)
        self.written(done, total)
        return status

    def read(self, dest: memoryview, path: str) -> tuple[memoryview, os.stat_result]:
        out = super().read(dest, path)
        key = self._key(path)
        if key is not None:
            self._used_now(key)
        return out

    def read_batch(self, keys: list[bytes], addresses: np.ndarray, sizes: np.ndarray,
                   seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        status, last_used = super().read_batch(keys, addresses, sizes, seconds)
        with self._lock:
            for key, st in zip(keys, status.tolist(), strict=True):
                if st == batchio.DONE and key in self._blocks:
                    self._blocks.move_to_end(key)
        return status, last_used

    def touch(self, path: str, st: os.stat_result, interval: float) -> None:
        key = self._key(path)
        if key is not None:
            self._used_now(key)  # a lookup hit
        super().touch(path, st, interval)

    def remove_bad(self, path: str, bad: BadBlock) -> bool:
        removed = super().remove_bad(path, bad)
        key = self._key(path)
        if removed and key is not None:
            self._dropped(key)
        return removed
