"""Whole batches of block files read or written with the GIL released.

The block store's Python path costs ~25 us of interpreter time per file, and every
syscall in it hands the GIL between I/O threads; at 256 KiB that, not the copy, bounded
throughput. Here a batch of files (each one's path and header built from its key, open,
pread/pwrite, XXH3-64 digest, close, rename) runs in the C extension
(offload/csrc/kvtier_native.c, `kvtier_offload._native`) with the GIL released for the
whole batch, so I/O threads run truly in parallel and the interpreter is paid once per
batch, not per block.

Only the common case lives here: a regular file (opened without following a symlink and
without blocking, so a FIFO or device planted at a block path is never waited on) that
is whole, reads or writes in full and (on load) carries exactly the header expected and
a payload matching its digest. Any other outcome (a missing, short, damaged or foreign
file, anything but a regular file, an error of any kind) is reported as
"not done" and the block store redoes that block on its Python path, which owns every
error, metric and log line, so there is one place that decides what a failure means;
the tests hold the two paths to the same files and outcomes. `AVAILABLE` is False where
the extension does not load (native.REASON says why), and the store then uses its Python
path for everything.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvtier_offload import native
from kvtier_offload.beneath import AT_FDCWD
from kvtier_offload.fileformat import MAX_KEY
from kvtier_offload.layout import MAX_KEY_BYTES, MIN_KEY_BYTES

DONE = 0
NOT_DONE = 1
EXISTS = 2  # a store whose final name was taken when it published: not replaced
# How a load opens a block file: a FIFO opens at once instead of waiting for a writer, a
# tty never becomes the controlling terminal, a symlink at the block's name is refused
# (ELOOP). The type is checked after open, before any read.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC

T = TypeVar("T")

if TYPE_CHECKING:  # calls into the extension are checked against _native.pyi
    from kvtier_offload import _native
else:
    _native = native.module
AVAILABLE = _native is not None
UNAVAILABLE_REASON = native.REASON


def address(buffer: memoryview) -> int:
    """Where a buffer's bytes start (0 when empty)."""
    if _native is not None:
        return int(_native.address(buffer))
    if not len(buffer):
        return 0
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def _packed(keys: Sequence[bytes]) -> tuple[bytes, np.ndarray]:
    """The keys one after another, and where each starts (one more entry: the end).
    (Plain iterators, not numpy steps: a few of those would cost more than the batch's
    whole interpreter time per block.)"""
    lengths = list(map(len, keys))
    if lengths and max(lengths) > min(MAX_KEY, MAX_KEY_BYTES):
        raise ValueError(f"a key is longer than {min(MAX_KEY, MAX_KEY_BYTES)} bytes (the "
                         "layout's limit)")
    if lengths and min(lengths) < MIN_KEY_BYTES:
        raise ValueError(f"a key is shorter than {MIN_KEY_BYTES} bytes (the layout's limit)")
    bounds = np.fromiter(itertools.accumulate(lengths, initial=0), np.int64, len(keys) + 1)
    return b"".join(keys), bounds


def eligible(buffer: memoryview, direct: bool, at: int | None = None) -> bool:
    """Whether a block's buffer can take the batch path: any buffer, but with O_DIRECT
    only a 4 KiB aligned address and length (else the Python path bounces it).
    at: its address, where the caller has it already."""
    return not direct or (len(buffer) % 4096 == 0
                          and (address(buffer) if at is None else at) % 4096 == 0)


def again_if_stale(path: str | bytes, attempt: Callable[[], T]) -> T:
    """attempt() (open, read and check the block file at path), and once more where it
    failed with ESTALE: on a network filesystem (GlusterFS, NFS) a node's cached name can
    point for a while (GlusterFS: its 1 s entry timeout) at the file another node has just
    replaced; the open succeeds, the first fstat or read fails. A stat by name fails there
    too and makes the kernel look the name up afresh, so the second attempt opens the new
    file (read_blocks does the same in C). FileNotFoundError where the name is gone."""
    try:
        return attempt()
    except OSError as err:
        if err.errno != errno.ESTALE:
            raise
    os.stat(path, follow_symlinks=False)
    return attempt()


def _check_piece(piece: int) -> None:
    if piece < 0 or piece % 4096:
        raise ValueError(f"piece must be 0 or a multiple of 4096, not {piece}")


def read_blocks(base: bytes, prefix: bytes, keys: Sequence[bytes], addresses: np.ndarray,
                sizes: np.ndarray, headers: memoryview, direct: bool, piece: int = 0,
                seconds: np.ndarray | None = None,
                dirfd: int = AT_FDCWD) -> tuple[np.ndarray, np.ndarray]:
    """Read the block file of each key under base (a Layout's base directory, encoded;
    relative to dirfd and resolved beneath it with no symlink followed at any level),
    its header into headers[i * 4096:] and its payload, sizes[i] bytes (int64), to
    addresses[i] (int64), and check them: the header must be the one
    fileformat.encode_header makes for this key and size (prefix: header_prefix of the
    fingerprint) but for its digest field, which must equal the payload's digest. Paths
    and expected headers are built in C, not per block in Python.

    Returns (status, last use): DONE where all of that holds, else NOT_DONE (so is
    anything but a regular file: opened with READ_FLAGS, its type checked before a byte
    is read); last use is the later of the file's atime and mtime in ns before this read,
    0 where the file was not opened. A block whose first try met ESTALE (a network
    filesystem's stale name, see again_if_stale) is tried once more. The caller
    vouches that each address range is writable memory it owns; with direct, addresses and
    headers must be 4 KiB aligned. piece: payloads larger than this move in pieces of it
    (a multiple of 4 KiB), each hashed while in cache; 0: one read per file (what a device
    wants). seconds: where given, filled with each block's time (open to close)."""
    packed, bounds, addresses, sizes, status, elapsed = _arguments(keys, addresses, sizes,
                                                                   piece, seconds)
    last_used = np.zeros(len(keys), dtype=np.int64)
    flags = READ_FLAGS | (os.O_DIRECT if direct else 0)
    _native.read_batch(dirfd, _c_bytes(base), prefix, packed, bounds,
                       addresses, sizes, headers, flags, piece, status, last_used, elapsed)
    _times_back(seconds, elapsed)
    return status, last_used


def write_blocks(base: bytes, prefix: bytes, keys: Sequence[bytes], token: bytes,
                 addresses: np.ndarray, sizes: np.ndarray, headers: memoryview, direct: bool,
                 fsync: bool, piece: int = 0, seconds: np.ndarray | None = None,
                 dirfd: int = AT_FDCWD) -> np.ndarray:
    """Write each key's block file under base (relative to dirfd, its fan-out directory
    reached with no symlink followed; the temp file, rename and clean-up happen in it):
    its header (built here into
    headers[i * 4096:], digest filled in) and the payload of sizes[i] bytes at
    addresses[i], to the temp name with this token (Layout.temp_path), close, and rename it
    to its final name. Nothing looks for the final name first (on a network filesystem
    that is one more request per block; the caller skips blocks its lookups know are
    there): the rename refuses to replace it (RENAME_NOREPLACE) where the filesystem can,
    and there EXISTS means a regular file had the final name already (the temp file is
    removed, the block left as it was) and NOT_DONE anything else there (a directory,
    FIFO or symlink). Where the filesystem cannot (GlusterFS's FUSE client, NFS: EINVAL,
    asked once per batch) the rename is plain: a block another writer published meanwhile
    is replaced by the same bytes (the key is a hash of them) and reported DONE. A block
    not done leaves no file behind. The fan-out directories must exist. piece, seconds
    (here: from the temp file's open to the rename), memory and alignment: as for
    read_blocks."""
    packed, bounds, addresses, sizes, status, elapsed = _arguments(keys, addresses, sizes,
                                                                   piece, seconds)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | (
        os.O_DIRECT if direct else 0)
    _native.write_batch(dirfd, _c_bytes(base), prefix, packed, bounds,
                        _c_bytes(token), addresses, sizes, headers, flags, fsync, piece,
                        status, elapsed)
    _times_back(seconds, elapsed)
    return status


def built_for(base: bytes, prefix: bytes, key: bytes, size: int,
              token: bytes = b"") -> tuple[bytes, bytes]:
    """The path (a temp name, given a token) and header the batch functions build for
    one block: to check them against Layout and fileformat."""
    _packed([key])  # the same key checks as a batch
    path, header = _native.built(_c_bytes(base), prefix, key,
                                 _c_bytes(token), size)
    return path, header


def _c_bytes(name: bytes) -> bytes:
    if b"\0" in name:
        raise ValueError("a path holds a NUL byte")
    return name


def _arguments(keys: Sequence[bytes], addresses: np.ndarray, sizes: np.ndarray, piece: int,
               seconds: np.ndarray | None) -> tuple[Any, ...]:
    """What read_batch and write_batch share, checked and typed as the extension takes
    them: the keys packed and their bounds, addresses, sizes, status to fill, and where
    each block's time goes (the caller's seconds itself where it is float64 and
    contiguous)."""
    _check_piece(piece)
    n = len(keys)
    if len(addresses) != n or len(sizes) != n:
        raise ValueError(f"{len(addresses)} addresses and {len(sizes)} sizes for {n} keys")
    if seconds is not None and len(seconds) != n:
        raise ValueError(f"seconds holds {len(seconds)} values for {n} blocks")
    packed, bounds = _packed(keys)
    return (packed, bounds, np.ascontiguousarray(addresses, dtype=np.int64),
            np.ascontiguousarray(sizes, dtype=np.int64), np.empty(n, dtype=np.int64),
            np.empty(n) if seconds is None else np.ascontiguousarray(seconds, np.float64))


def _times_back(seconds: np.ndarray | None, elapsed: np.ndarray) -> None:
    if seconds is not None and elapsed is not seconds:  # a copy _arguments made
        seconds[:] = elapsed

