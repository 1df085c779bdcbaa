"""Block files on the volume: written whole under a temp name and published by an atomic
rename, read back only from a regular file that holds at least a whole block.

Two paths. A batch of blocks goes through the C extension (batchio) with the GIL released;
it does only the common case and reports anything else "not done". One block goes
through the Python path here, which handles every case and raises for each failure:
FileNotFoundError (no file), NotAFile (a FIFO, socket, device, directory or symlink at
the name: never waited on, never followed), BadBlock (short or damaged) or another
OSError. Checking a header and payload against what the reader expects is
fileformat's and the caller's part; this module moves the bytes.

Every path below the volume root is resolved beneath an fd of the root without following
a symlink at any level (beneath.py), on both paths: a directory swapped for a symlink by
another writer of the volume fails the block, it never leads outside the volume.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import threading
import time

import numpy as np

from kvtier_offload import batchio
from kvtier_offload.beneath import (
    DIR_FLAGS,
    RACE_PAUSES,
    RACING,
    lstat_beneath,
    makedirs_beneath,
    open_beneath,
    parent_beneath,
)
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, BadBlock, encode_header, header_prefix, padded
from kvtier_offload.layout import DIR_MODE, Layout

ALIGN = 4096
Part = bytes | bytearray | memoryview | mmap.mmap


class NotAFile(BadBlock):
    """Something other than a regular file at a block's path."""

    def __init__(self, kind: str) -> None:
        super().__init__("not-a-file", f"a {kind} at a block path")
        self.kind = kind


_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"))


def odd_kind(mode: int) -> str | None:
    """What a file of this mode is, where it is not a regular file (None where it is)."""
    if stat.S_ISREG(mode):
        return None
    for test, name in _KINDS:
        if test(mode):
            return name
    return "special file"


def aligned(buf: memoryview) -> bool:
    """Whether buf's address and length are O_DIRECT aligned."""
    address = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0
    return len(buf) % ALIGN == 0 and address % ALIGN == 0


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes of a scatter/gather list (after a partial readv/writev)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def write_all(fd: int, parts: list[Part]) -> None:
    """writev until every byte of parts is written (the kernel may write less)."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    written = 0
    while written < total:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        written += n
        advance(views, n)


def read_all(fd: int, parts: list[memoryview]) -> int:
    """preadv until the buffers are full or the file ends; returns bytes read."""
    views = [p.cast("B") for p in parts]
    offset = 0
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            break  # end of file
        offset += n
        advance(views, n)
    return offset


class BlockFiles:
    """The block files of one layout. direct: O_DIRECT (bounced through an aligned
    buffer where a block's memory is not aligned); fsync: fdatasync before publishing;
    piece: the batch path moves larger payloads in pieces of this many bytes, each
    hashed while in cache (0: one I/O per file). Safe to use from many threads."""

    def __init__(self, layout: Layout, direct: bool, fsync: bool = False,
                 piece: int = 0) -> None:
        self.layout = layout
        self.direct, self.fsync, self.piece = direct, fsync, piece
        # The batch path builds paths on the base relative to the root's fd.
        self._root_prefix = os.path.join(layout.root, "")
        self._base = os.fsencode(self.rel(layout.base + "/x").rpartition("/")[0])
        self._root_fd = -1
        self._root_lock = threading.Lock()
        self._prefix = header_prefix(layout.fingerprint)
        self._local = threading.local()
        self._made_dirs: set[bytes] = set()  # fan-out directories, by a key's first 2 bytes
        self._dirs_lock = threading.Lock()

    # ------------------------------------------------------------- the root

    def root_fd(self) -> int:
        """An fd of the volume root, opened once (as given: the mount itself is the
        administrator's choice; made where it is missing); OSError while it cannot be
        opened (tried again next time)."""
        fd = self._root_fd
        if fd >= 0:
            return fd
        with self._root_lock:
            if self._root_fd < 0:
                flags = DIR_FLAGS & ~os.O_NOFOLLOW
                try:
                    self._root_fd = os.open(self.layout.root, flags)
                except FileNotFoundError:  # a directory to use, not a mount: made here
                    self.layout.ensure_dir(self.layout.root)
                    self._root_fd = os.open(self.layout.root, flags)
            return self._root_fd

    def close(self) -> None:
        with self._root_lock:
            if self._root_fd >= 0:
                os.close(self._root_fd)
                self._root_fd = -1

    def rel(self, path: str) -> str:
        """A path the layout built, relative to the root."""
        if not path.startswith(self._root_prefix):
            raise ValueError(f"{path} is not below {self.layout.root}")
        return path[len(self._root_prefix):]

    def lstat(self, path: str) -> os.stat_result:
        """os.stat(path, follow_symlinks=False), with no symlink followed above it."""
        return lstat_beneath(self.root_fd(), self.rel(path))

    def regular_file_at(self, path: str) -> bool:
        try:
            return stat.S_ISREG(self.lstat(path).st_mode)
        except OSError:
            return False

    def touch(self, path: str, st: os.stat_result, interval: float) -> None:
        """Refresh a hit file's atime so the evictor's LRU holds on noatime/relatime
        mounts; at most once per interval seconds per file (its own atime says when)."""
        now = time.time()
        if now - max(st.st_atime, st.st_mtime) < interval:
            return
        try:
            fd, name = parent_beneath(self.root_fd(), self.rel(path))
            try:
                os.utime(name, (now, st.st_mtime), dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)
        except OSError:
            pass  # read-only volume or a file deleted meanwhile: a hit is still a hit

    def remove_bad(self, path: str, bad: BadBlock) -> bool:
        """Remove a refused block file; True where it is gone. A FIFO, socket, device or
        symlink goes by unlink (only the name: no target is touched); a directory only
        where empty (rmdir): one with entries stays, a miss on every lookup."""
        try:
            fd, name = parent_beneath(self.root_fd(), self.rel(path))
            try:
                if isinstance(bad, NotAFile) and bad.kind == "directory":
                    os.rmdir(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    def ensure_dirs(self, directory: str) -> None:
        """A directory the layout names (base or a fan-out level) and those above it,
        made group-writable where missing, beneath the root; OSError."""
        makedirs_beneath(self.root_fd(), self.rel(directory), DIR_MODE)

    def _buffer(self, size: int, name: str = "bounce") -> mmap.mmap:
        """A page-aligned buffer per thread and use, grown on demand."""
        buf: mmap.mmap | None = getattr(self._local, name, None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = mmap.mmap(-1, padded(size))
            setattr(self._local, name, buf)
        return buf

    def ensure_parent(self, key: bytes) -> None:
        """Create a block's fan-out directory once per process, so first writes take the
        batch path too (one the evictor removed since makes that block fall back to the
        Python path, which recreates it). The directory is named by the key's first two
        bytes: those stand for it, no path needed when it is there."""
        if key[:2] not in self._made_dirs:
            try:
                self.ensure_dirs(os.path.dirname(self.layout.path(key)))
            except OSError:
                return  # the write finds out and says why
            with self._dirs_lock:  # at most 65,536: the layout's fan-out bounds it
                self._made_dirs.add(key[:2])

    # ------------------------------------------------------------ Python path

    def write(self, key: bytes, data: memoryview, path: str) -> None:
        """Write one block file at path (key's): header and data to a temp name, then an
        atomic rename. A concurrent writer of the same key writes the same bytes (the key
        is a hash of the tokens under one fingerprint): whichever rename lands last wins,
        readers keep whatever inode they opened, nothing mixes. Raises OSError; leaves no
        temp file behind."""
        header = encode_header(self.layout.fingerprint, key, len(data), digest(data))
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        direct = self.direct
        if direct:
            flags |= os.O_DIRECT
        dir_fd, name = self._parent(path)
        try:
            # Again in a directory looked up afresh (and made again where it was reaped),
            # after a short pause (RACE_PAUSES): on a network filesystem another node's
            # mkdir or rename of the same names can make a create fail for a moment
            # (ENOENT, ESTALE). The failed create made nothing: the same name will do.
            tmp = self.layout.temp_path(key).rpartition("/")[2]
            pauses = iter(RACE_PAUSES[1:])
            while True:
                try:
                    fd = os.open(tmp, flags, 0o664, dir_fd=dir_fd)
                    break
                except OSError as err:
                    pause = next(pauses, None)
                    if err.errno not in RACING or pause is None:
                        raise
                os.close(dir_fd)
                dir_fd = -1
                time.sleep(pause)
                dir_fd, name = self._parent(path, fresh=True)
            try:
                try:
                    if direct:
                        self._write_direct(fd, header, data)
                    else:
                        write_all(fd, [header, data])
                    if self.fsync:
                        os.fdatasync(fd)
                finally:
                    os.close(fd)  # close errors (NFS reports ENOSPC here) must propagate
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass
                raise
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)

    def _parent(self, path: str, fresh: bool = False) -> tuple[int, str]:
        """parent_beneath for a block path: its fan-out directory made first where it is
        missing (a first write, or reaped by the evictor) or where fresh (asked again
        after a create in it failed: made again, each level looked up afresh)."""
        if fresh:
            self.ensure_dirs(os.path.dirname(path))
        try:
            return parent_beneath(self.root_fd(), self.rel(path))
        except OSError as err:
            if fresh or err.errno not in RACING:
                raise
        self.ensure_dirs(os.path.dirname(path))
        return parent_beneath(self.root_fd(), self.rel(path))

    def _write_direct(self, fd: int, header: bytes, data: memoryview) -> None:
        if aligned(data):
            head = self._buffer(HEADER_SIZE)
            head[:HEADER_SIZE] = header
            write_all(fd, [memoryview(head)[:HEADER_SIZE], data])
            return
        total = padded(HEADER_SIZE + len(data))
        buf = self._buffer(total)
        buf[:HEADER_SIZE] = header
        buf[HEADER_SIZE:HEADER_SIZE + len(data)] = data
        buf[HEADER_SIZE + len(data):total] = bytes(total - HEADER_SIZE - len(data))
        write_all(fd, [memoryview(buf)[:total]])

    def read(self, dest: memoryview, path: str) -> tuple[memoryview, os.stat_result]:
        """Read the block file at path: its payload into dest (len(dest) bytes), its
        header returned (valid until this thread's next read), with the file's stat
        from before the read. Checks only that it is a regular file holding a whole
        block; the header and digest are the caller's to check."""
        size = len(dest)
        direct = self.direct
        try:
            # Never waits (a FIFO opens at once), never follows a symlink (ELOOP), at the
            # name or above it.
            fd = open_beneath(self.root_fd(), self.rel(path),
                              batchio.READ_FLAGS | (os.O_DIRECT if direct else 0), 0)
        except FileNotFoundError:
            raise
        except OSError as err:  # ELOOP for a symlink, EINVAL/ENXIO for some special files
            try:
                kind = odd_kind(self.lstat(path).st_mode)
            except OSError:
                kind = None
            if kind is None:
                raise
            raise NotAFile(kind) from err
        try:
            st = os.fstat(fd)
            kind = odd_kind(st.st_mode)
            if kind is not None:  # checked before a byte is read
                raise NotAFile(kind)
            if st.st_size < HEADER_SIZE + size:
                raise BadBlock("truncated", f"{st.st_size} bytes, need {HEADER_SIZE + size}")
            if direct and not aligned(dest):
                total = padded(HEADER_SIZE + size)
                buf = self._buffer(total)
                got = read_all(fd, [memoryview(buf)[:total]])
                header = memoryview(buf)[:HEADER_SIZE]
                dest[:] = memoryview(buf)[HEADER_SIZE:HEADER_SIZE + size]
            else:
                head = self._buffer(HEADER_SIZE) if direct else bytearray(HEADER_SIZE)
                header = memoryview(head)[:HEADER_SIZE]
                got = read_all(fd, [header, dest])
            if got < HEADER_SIZE + size:
                raise BadBlock("truncated", f"read {got} bytes")
        finally:
            os.close(fd)
        return header, st

    # ------------------------------------------------------------- batch path

    def write_batch(self, keys: list[bytes], addresses: np.ndarray, sizes: np.ndarray,
                    seconds: np.ndarray) -> np.ndarray:
        """batchio.write_blocks for these blocks (their fan-out directories made first):
        per block DONE, EXISTS or NOT_DONE; seconds filled with each block's time."""
        for key in keys:
            self.ensure_parent(key)
        headers = self._buffer(len(keys) * HEADER_SIZE, "headers")
        return batchio.write_blocks(self._base, self._prefix, keys,
                                    secrets.token_hex(8).encode(), addresses, sizes,
                                    memoryview(headers), self.direct, self.fsync, self.piece,
                                    seconds=seconds, dirfd=self.root_fd())

    def read_batch(self, keys: list[bytes], addresses: np.ndarray, sizes: np.ndarray,
                   seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """batchio.read_blocks for these blocks: (status, last use) per block."""
        headers = self._buffer(len(keys) * HEADER_SIZE, "headers")
        return batchio.read_blocks(self._base, self._prefix, keys, addresses, sizes,
                                   memoryview(headers), self.direct, self.piece,
                                   seconds=seconds, dirfd=self.root_fd())
