"""Whole batches of block files read or written with the GIL released.

The block store's Python path costs ~25 us of interpreter time per file, and every
syscall in it hands the GIL between I/O threads; at 256 KiB that, not the copy, bounded
throughput. Here a batch of files (each one's path and header built from its key, open,
pread/pwrite, digest, close, rename) runs as machine code compiled by numba (a vLLM
dependency) calling libc directly, so I/O threads run truly in parallel and the
interpreter is paid once per batch, not per block.

Only the common case lives here: a regular file (opened without following a symlink and
without blocking, so a FIFO or device planted at a block path is never waited on) that
is whole, reads or writes in full and (on load) carries exactly the header expected and
a payload matching its digest. Any other outcome (a missing, short, damaged or foreign
file, anything but a regular file, an error of any kind) is reported as
"not done" and the block store redoes that block on its Python path, which owns every
error, metric and log line, so there is one place that decides what a failure means.
Linux only; `AVAILABLE` is False elsewhere or without numba, and the store then uses
its Python path for everything.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
from collections.abc import Sequence

import numpy as np

from kvtier_offload import digest as payload_digest
from kvtier_offload.fileformat import (
    DIGEST_OFFSET,
    HEADER_SIZE,
    KEY_LEN_OFFSET,
    KEY_OFFSET,
    LENGTH_OFFSET,
    MAX_KEY,
)
from kvtier_offload.layout import MAX_KEY_BYTES, MIN_KEY_BYTES, SUFFIX, TEMP_SUFFIX

DONE = 0
NOT_DONE = 1
EXISTS = 2  # a store whose final name was already there: nothing written
_AT_FDCWD, _AT_SYMLINK_NOFOLLOW, _AT_EMPTY_PATH = -100, 0x100, 0x1000
_STATX_TYPE, _STATX_ATIME, _STATX_MTIME = 0x1, 0x20, 0x40
_CLOCK_MONOTONIC = 1
O_ACCMODE = 3  # of open()'s flags: O_RDONLY, O_WRONLY or O_RDWR
# struct statx is the same on every arch: stx_mode is the u16 at byte 28 (the high half
# of the 4th 8-byte word, after stx_gid)
_STATX_ATIME_AT, _STATX_MTIME_AT, _STATX_MODE_WORD = 64, 112, 3
_S_IFMT, _S_IFREG = 0o170000, 0o100000
# How a load opens a block file: a FIFO opens at once instead of waiting for a writer, a
# tty never becomes the controlling terminal, a symlink at the block's name is refused
# (ELOOP). The type is checked after open, before any read.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


def address(buffer: memoryview) -> int:
    """Where a buffer's bytes start (0 when empty)."""
    if not len(buffer):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # 5x cheaper than numpy
    except TypeError:  # read-only: numpy reads the address without asking for writes
        return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def _packed(keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
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
    return np.frombuffer(b"".join(keys), dtype=np.uint8), bounds


def _crc_table() -> np.ndarray:
    """zlib's crc32 (reflected 0xEDB88320), a byte at a time."""
    table = np.arange(256, dtype=np.int64)
    for _ in range(8):
        table = np.where(table & 1, 0xEDB88320 ^ (table >> 1), table >> 1)
    return table


def _build() -> tuple[object, object, object]:
    import numba
    from numba import types
    from numba.extending import intrinsic

    if not sys.platform.startswith("linux") or sys.byteorder != "little":
        raise OSError("the batch path is built for little-endian Linux")
    if not payload_digest.COMPILED:
        raise ImportError(f"the digest is not compiled ({payload_digest.UNCOMPILED_REASON})")
    libc = ctypes.CDLL(None)
    empty = np.zeros(1, np.uint8)  # the "" path statx needs with AT_EMPTY_PATH
    word, size_t, off_t, c_int = ctypes.c_ssize_t, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int

    def c(name: str, restype: object, *argtypes: object) -> object:
        fn = getattr(libc, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
        return fn

    # Pointers travel as machine words (same registers as pointers on LP64 Linux).
    c_open = c("open", c_int, word, c_int, c_int)
    c_close = c("close", c_int, c_int)
    c_pread = c("pread", word, c_int, word, size_t, off_t)
    c_pwrite = c("pwrite", word, c_int, word, size_t, off_t)
    c_preadv = c("preadv", word, c_int, word, c_int, off_t)
    c_pwritev = c("pwritev", word, c_int, word, c_int, off_t)
    c_fdatasync = c("fdatasync", c_int, c_int)
    c_rename = c("rename", c_int, word, word)
    c_unlink = c("unlink", c_int, word)
    c_statx = c("statx", c_int, c_int, word, c_int, ctypes.c_uint, word)
    c_clock_gettime = c("clock_gettime", c_int, c_int, word)  # the vDSO: ~20 ns
    digest_words = payload_digest.digest_words
    digest_start = payload_digest.digest_start
    digest_absorb = payload_digest.digest_absorb
    digest_finish = payload_digest.digest_finish

    @intrinsic
    def words_at(typingctx: object, address: object) -> object:  # pragma: no cover
        sig = types.CPointer(types.uint64)(types.int64)

        def codegen(context: object, builder: object, signature: object, args: list) -> object:
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return sig, codegen

    @numba.njit(nogil=True)
    def transfer(fd: int, address: int, size: int, offset: int,
                 write: bool) -> bool:  # pragma: no cover (machine code)
        done = 0
        while done < size:
            if write:
                n = c_pwrite(fd, address + done, size - done, offset + done)
            else:
                n = c_pread(fd, address + done, size - done, offset + done)
            if n <= 0:
                return False
            done += n
        return True

    @numba.njit(nogil=True)
    def header_and_payload(fd: int, header: int, payload: int, size: int,
                           write: bool) -> bool:  # pragma: no cover (machine code)
        # One syscall for both: with O_DIRECT on a disk that is one device round trip per
        # file instead of two. A short transfer is finished piece by piece.
        iov = np.empty(4, np.int64)
        iov[0], iov[1], iov[2], iov[3] = header, 4096, payload, size
        if write:
            n = c_pwritev(fd, iov.ctypes.data, 2, 0)
        else:
            n = c_preadv(fd, iov.ctypes.data, 2, 0)
        if n <= 0:
            return False
        if n < 4096:
            return transfer(fd, header + n, 4096 - n, n, write) and transfer(
                fd, payload, size, 4096, write)
        return transfer(fd, payload + n - 4096, size - (n - 4096), n, write)

    @numba.njit(nogil=True)
    def digest_at(address: int, size: int, secret: np.ndarray) -> np.uint64:  # pragma: no cover
        # size is a multiple of 8 (see eligible()): no tail word
        words = numba.carray(words_at(address), size // 8)
        return digest_words(words, secret, np.uint64(0), np.uint64(size))

    @numba.njit(nogil=True)
    def in_pieces(fd: int, header: int, payload: int, size: int, piece: int, write: bool,
                  secret: np.ndarray, digest: np.ndarray) -> bool:  # pragma: no cover
        # A large payload piece by piece, each hashed while in cache (a store hashes it
        # before writing it, a load after reading it), so its bytes come from memory once,
        # not twice. A store writes the header, digest filled in, last; a load reads it
        # with the first piece. piece: a multiple of 4 KiB.
        lanes = digest_start(secret)
        done = 0
        if not write:
            first = min(piece, size)
            if not header_and_payload(fd, header, payload, first, write):
                return False
        while done < size:
            n = min(piece, size - done)
            if not write and done and not transfer(fd, payload + done, n, 4096 + done, write):
                return False
            digest_absorb(lanes, numba.carray(words_at(payload + done), n // 8), secret)
            if write and not transfer(fd, payload + done, n, 4096 + done, write):
                return False
            done += n
        cut = size // 256 * 256  # words past the last whole stripe (of the last piece)
        digest[0] = digest_finish(lanes, numba.carray(words_at(payload + cut), (size - cut) // 8),
                                  np.uint64(0), np.uint64(size))
        if write:
            numba.carray(words_at(header), 4096 // 8)[DIGEST_OFFSET // 8] = digest[0]
            return transfer(fd, header, 4096, 0, write)
        return True

    @numba.njit(nogil=True)
    def regular(stx: np.ndarray) -> bool:  # pragma: no cover (machine code)
        # Whether a struct statx filled in by the kernel describes a regular file.
        return ((stx[_STATX_MODE_WORD] >> 32) & _S_IFMT) == _S_IFREG

    @numba.njit(nogil=True)
    def now_ns(timespec: np.ndarray) -> int:  # pragma: no cover (machine code)
        c_clock_gettime(_CLOCK_MONOTONIC, timespec.ctypes.data)
        return timespec[0] * 10**9 + timespec[1]

    crc_table = _crc_table()
    hex_digits = np.frombuffer(b"0123456789abcdef", np.uint8).copy()
    suffix = np.frombuffer(SUFFIX.encode(), np.uint8).copy()
    temp_suffix = np.frombuffer(TEMP_SUFFIX.encode(), np.uint8).copy()
    slash, dot = ord("/"), ord(".")

    @numba.njit(nogil=True)
    def copy_into(out: np.ndarray, at: int, data: np.ndarray) -> int:  # pragma: no cover
        for j in range(data.shape[0]):
            out[at + j] = data[j]
        return at + data.shape[0]

    @numba.njit(nogil=True)
    def hex_into(out: np.ndarray, at: int, data: np.ndarray, start: int,
                 stop: int) -> int:  # pragma: no cover (machine code)
        for j in range(start, stop):
            out[at] = hex_digits[data[j] >> 4]
            out[at + 1] = hex_digits[data[j] & 15]
            at += 2
        return at

    @numba.njit(nogil=True)
    def path_into(out: np.ndarray, base: np.ndarray, keys: np.ndarray, k0: int, k1: int,
                  token: np.ndarray) -> None:  # pragma: no cover (machine code)
        # Layout.path (or, given a token, Layout.temp_path) of keys[k0:k1], NUL-terminated.
        n = base.shape[0]
        for j in range(n):
            out[j] = base[j]
        out[n] = slash
        n = hex_into(out, n + 1, keys, k0, min(k0 + 1, k1))
        out[n] = slash
        n = hex_into(out, n + 1, keys, min(k0 + 1, k1), min(k0 + 2, k1))
        out[n] = slash
        n += 1
        if token.shape[0]:
            out[n] = dot
            n += 1
        n = copy_into(out, hex_into(out, n, keys, k0, k1), suffix)
        if token.shape[0]:
            out[n] = dot
            n = copy_into(out, copy_into(out, n + 1, token), temp_suffix)
        out[n] = 0

    @numba.njit(nogil=True)
    def header_into(out: np.ndarray, at: int, prefix: np.ndarray, size: int, keys: np.ndarray,
                    k0: int, k1: int) -> None:  # pragma: no cover (machine code)
        # fileformat.encode_header(fingerprint, keys[k0:k1], size, 0) into out[at:]
        for j in range(at, at + 4096):
            out[j] = 0
        copy_into(out, at, prefix)
        for j in range(8):
            out[at + LENGTH_OFFSET + j] = (size >> (8 * j)) & 0xFF
        length = k1 - k0
        out[at + KEY_LEN_OFFSET] = length & 0xFF
        out[at + KEY_LEN_OFFSET + 1] = length >> 8
        end = at + KEY_OFFSET + length
        for j in range(length):
            out[at + KEY_OFFSET + j] = keys[k0 + j]
        crc = 0xFFFFFFFF
        for j in range(at, end):
            crc = crc_table[(crc ^ out[j]) & 0xFF] ^ (crc >> 8)
        crc ^= 0xFFFFFFFF
        for j in range(4):
            out[end + j] = (crc >> (8 * j)) & 0xFF

    @numba.njit(nogil=True)
    def scratch_path(base: np.ndarray, bounds: np.ndarray,
                     token: np.ndarray) -> np.ndarray:  # pragma: no cover (machine code)
        longest = 0
        for i in range(bounds.shape[0] - 1):
            longest = max(longest, bounds[i + 1] - bounds[i])
        return np.empty(base.shape[0] + 2 * longest + token.shape[0] + 32, np.uint8)

    @numba.njit(nogil=True)
    def header_expected(got: np.ndarray, first: int, want: np.ndarray) -> bool:  # pragma: no cover
        # Every word as expected except the payload digest, checked against the payload.
        for w in range(HEADER_SIZE // 8):
            if w != DIGEST_OFFSET // 8 and got[first + w] != want[w]:
                return False
        return True

    @numba.njit(nogil=True)
    def read_batch(base: np.ndarray, prefix: np.ndarray, keys: np.ndarray, bounds: np.ndarray,
                   dests: np.ndarray, sizes: np.ndarray, headers: np.ndarray, flags: int,
                   piece: int, secret: np.ndarray, status: np.ndarray,
                   last_used: np.ndarray, elapsed: np.ndarray) -> None:  # pragma: no cover
        got = headers.view(np.uint64)
        want = np.zeros(HEADER_SIZE, np.uint8)
        # Typed values, not literals (False, 0): numba compiles a callee once more for
        # each literal it is called with, seconds at import.
        write, origin = (flags & O_ACCMODE) != os.O_RDONLY, np.int64(0)
        want_words = want.view(np.uint64)
        path = scratch_path(base, bounds, keys[:0])
        stx = np.zeros(256 // 8, np.int64)
        digest = np.zeros(1, np.uint64)
        clock = np.zeros(2, np.int64)
        for i in range(dests.shape[0]):
            status[i] = 1
            began = now_ns(clock)
            path_into(path, base, keys, bounds[i], bounds[i + 1], keys[:0])
            fd = c_open(path.ctypes.data, flags, 0)
            if fd < 0:
                elapsed[i] = (now_ns(clock) - began) * 1e-9
                continue
            # Nothing but a regular file is read (a FIFO would block a read, a directory
            # or device has no business here); its times are taken on the way.
            if c_statx(fd, empty.ctypes.data, _AT_EMPTY_PATH,
                       _STATX_TYPE | _STATX_ATIME | _STATX_MTIME,
                       stx.ctypes.data) != 0 or not regular(stx):
                c_close(fd)
                elapsed[i] = (now_ns(clock) - began) * 1e-9
                continue
            atime = stx[_STATX_ATIME_AT // 8] * 10**9 + (stx[_STATX_ATIME_AT // 8 + 1]
                                                        & 0xFFFFFFFF)
            mtime = stx[_STATX_MTIME_AT // 8] * 10**9 + (stx[_STATX_MTIME_AT // 8 + 1]
                                                        & 0xFFFFFFFF)
            last_used[i] = max(atime, mtime)
            if 0 < piece < sizes[i]:
                whole = in_pieces(fd, headers.ctypes.data + i * 4096, dests[i], sizes[i], piece,
                                  write, secret, digest)
            else:
                whole = header_and_payload(fd, headers.ctypes.data + i * 4096, dests[i],
                                           sizes[i], write)
                if whole:
                    digest[0] = digest_at(dests[i], sizes[i], secret)
            c_close(fd)  # read-only: nothing to lose on a failed close
            if whole:
                header_into(want, origin, prefix, sizes[i], keys, bounds[i], bounds[i + 1])
                first = i * (HEADER_SIZE // 8)
                if header_expected(got, first, want_words) and got[
                        first + DIGEST_OFFSET // 8] == digest[0]:
                    status[i] = 0
            elapsed[i] = (now_ns(clock) - began) * 1e-9

    @numba.njit(nogil=True)
    def write_batch(base: np.ndarray, prefix: np.ndarray, keys: np.ndarray, bounds: np.ndarray,
                    token: np.ndarray, datas: np.ndarray, sizes: np.ndarray,
                    headers: np.ndarray, flags: int, fsync: bool, piece: int,
                    secret: np.ndarray, status: np.ndarray,
                    elapsed: np.ndarray) -> None:  # pragma: no cover
        digest_slots = headers.view(np.uint64)
        write = (flags & O_ACCMODE) != os.O_RDONLY  # not the literal True (see read_batch)
        final = scratch_path(base, bounds, token)
        tmp = scratch_path(base, bounds, token)
        digest = np.zeros(1, np.uint64)
        clock = np.zeros(2, np.int64)
        stx = np.zeros(256 // 8, np.int64)
        for i in range(datas.shape[0]):
            status[i] = 1
            began = now_ns(clock)
            path_into(final, base, keys, bounds[i], bounds[i + 1], token[:0])
            if c_statx(_AT_FDCWD, final.ctypes.data, _AT_SYMLINK_NOFOLLOW, _STATX_TYPE,
                       stx.ctypes.data) == 0:
                # A regular file: another writer got there first. Anything else (a
                # directory, FIFO, symlink): the Python path decides.
                status[i] = 2 if regular(stx) else 1
                elapsed[i] = (now_ns(clock) - began) * 1e-9
                continue
            header_into(headers, i * 4096, prefix, sizes[i], keys, bounds[i], bounds[i + 1])
            pieces = 0 < piece < sizes[i]
            if not pieces:
                digest_slots[(i * 4096 + DIGEST_OFFSET) // 8] = digest_at(datas[i], sizes[i],
                                                                           secret)
            path_into(tmp, base, keys, bounds[i], bounds[i + 1], token)
            fd = c_open(tmp.ctypes.data, flags, 0o664)
            if fd < 0:
                elapsed[i] = (now_ns(clock) - began) * 1e-9
                continue
            if pieces:
                ok = in_pieces(fd, headers.ctypes.data + i * 4096, datas[i], sizes[i], piece,
                               write, secret, digest)
            else:
                ok = header_and_payload(fd, headers.ctypes.data + i * 4096, datas[i],
                                        sizes[i], write)
            if ok and fsync:
                ok = c_fdatasync(fd) == 0
            ok = c_close(fd) == 0 and ok  # NFS reports ENOSPC at close
            if ok and c_rename(tmp.ctypes.data, final.ctypes.data) == 0:
                status[i] = 0
            else:
                c_unlink(tmp.ctypes.data)
            elapsed[i] = (now_ns(clock) - began) * 1e-9

    @numba.njit(nogil=True)
    def built(base: np.ndarray, prefix: np.ndarray, keys: np.ndarray, bounds: np.ndarray,
              token: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
        # What the two above build for block 0: its path (a temp name with a token), header.
        path = scratch_path(base, bounds, token)
        path_into(path, base, keys, bounds[0], bounds[1], token)
        header = np.zeros(HEADER_SIZE, np.uint8)
        header_into(header, 0, prefix, size, keys, bounds[0], bounds[1])
        return path, header

    assert HEADER_SIZE == 4096  # as compiled above
    return read_batch, write_batch, built


try:
    _read_batch, _write_batch, _built = _build()
    UNAVAILABLE_REASON = ""
except Exception as err:  # no numba, not Linux, a libc without these symbols
    _read_batch = _write_batch = _built = None
    UNAVAILABLE_REASON = f"{type(err).__name__}: {err}"
AVAILABLE = _read_batch is not None


def eligible(buffer: memoryview, direct: bool, at: int | None = None) -> bool:
    """Whether a block's buffer can take the batch path: whole 8-byte words, and with
    O_DIRECT a 4 KiB aligned address and length (else the Python path bounces it).
    at: its address, where the caller has it already."""
    if len(buffer) % 8:
        return False
    return not direct or (len(buffer) % 4096 == 0
                          and (address(buffer) if at is None else at) % 4096 == 0)


def _check_piece(piece: int) -> None:
    if piece < 0 or piece % 4096:
        raise ValueError(f"piece must be 0 or a multiple of 4096, not {piece}")


def read_blocks(base: bytes, prefix: bytes, keys: Sequence[bytes], addresses: np.ndarray,
                sizes: np.ndarray, headers: memoryview, direct: bool, piece: int = 0,
                seconds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read the block file of each key under base (a Layout's base directory, encoded),
    its header into headers[i * 4096:] and its payload, sizes[i] bytes (int64, a multiple
    of 8), to addresses[i] (int64), and check them: the header must be the one
    fileformat.encode_header makes for this key and size (prefix: header_prefix of the
    fingerprint) but for its digest field, which must equal the payload's digest. Paths
    and expected headers are built in machine code, not per block in Python.

    Returns (status, last use): DONE where all of that holds, else NOT_DONE (so is
    anything but a regular file: opened with READ_FLAGS, its type checked before a byte
    is read); last use is the later of the file's atime and mtime in ns before this read,
    0 where the file was not opened. The caller
    vouches that each address range is writable memory it owns; with direct, addresses and
    headers must be 4 KiB aligned. piece: payloads larger than this move in pieces of it
    (a multiple of 4 KiB), each hashed while in cache; 0: one read per file (what a device
    wants). seconds: where given, filled with each block's time (open to close)."""
    packed, bounds, addresses, sizes, status, elapsed = _arguments(keys, addresses, sizes,
                                                                   piece, seconds)
    last_used = np.zeros(len(keys), dtype=np.int64)
    flags = READ_FLAGS | (os.O_DIRECT if direct else 0)
    _read_batch(_c_bytes(base), _array(prefix), packed, bounds,  # type: ignore[misc]
                addresses, sizes, np.frombuffer(headers, np.uint8), flags, piece,
                payload_digest.SECRET, status, last_used, elapsed)
    _times_back(seconds, elapsed)
    return status, last_used


def write_blocks(base: bytes, prefix: bytes, keys: Sequence[bytes], token: bytes,
                 addresses: np.ndarray, sizes: np.ndarray, headers: memoryview, direct: bool,
                 fsync: bool, piece: int = 0, seconds: np.ndarray | None = None) -> np.ndarray:
    """Write each key's block file under base: its header (built here into
    headers[i * 4096:], digest filled in) and the payload of sizes[i] bytes at
    addresses[i], to the temp name with this token (Layout.temp_path), close, and rename it
    to its final name. Returns per block DONE, EXISTS (a regular file had its final name
    already: nothing written) or NOT_DONE (so is a final name held by anything else: a
    directory, FIFO or symlink); a block not done leaves no file behind. The fan-out
    directories must exist. piece, seconds (here: from the existence check to the
    rename), memory and alignment: as for read_blocks."""
    packed, bounds, addresses, sizes, status, elapsed = _arguments(keys, addresses, sizes,
                                                                   piece, seconds)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | (
        os.O_DIRECT if direct else 0)
    _write_batch(_c_bytes(base), _array(prefix), packed, bounds,  # type: ignore[misc]
                 _c_bytes(token, False), addresses, sizes, np.frombuffer(headers, np.uint8),
                 flags, fsync, piece, payload_digest.SECRET, status, elapsed)
    _times_back(seconds, elapsed)
    return status


def built_for(base: bytes, prefix: bytes, key: bytes, size: int,
              token: bytes = b"") -> tuple[bytes, bytes]:
    """The path (a temp name, given a token) and header the batch functions build for
    one block: to check them against Layout and fileformat."""
    packed, bounds = _packed([key])
    path, header = _built(_c_bytes(base), _array(prefix), packed,  # type: ignore[misc]
                          bounds, _c_bytes(token, False), size)
    return bytes(path[:int(np.flatnonzero(path == 0)[0])]), header.tobytes()


@functools.lru_cache(maxsize=64)
def _array(data: bytes) -> np.ndarray:
    """Bytes as the machine code takes them: the same few (base, prefix) every batch."""
    return np.frombuffer(data, np.uint8)


def _c_bytes(name: bytes, same_every_batch: bool = True) -> np.ndarray:
    if b"\0" in name:
        raise ValueError("a path holds a NUL byte")
    return _array(name) if same_every_batch else np.frombuffer(name, np.uint8)


def _arguments(keys: Sequence[bytes], addresses: np.ndarray, sizes: np.ndarray, piece: int,
               seconds: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """What read_batch and write_batch share, checked and typed as compiled: the keys
    packed and their bounds, addresses, sizes, status to fill, and where each block's time
    goes (the caller's seconds itself where it is float64 and contiguous)."""
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


if AVAILABLE:
    # Compile now (about 4 s, once per process), not inside the first transfer a user
    # waits on, and through the wrappers, so the argument types are exactly the ones real
    # calls pass (numba compiles again for any other type, read-only arrays included).
    try:
        _none = np.zeros(0, dtype=np.int64)
        read_blocks(b"/", bytes(16), [], _none, _none, memoryview(bytearray(0)), False)
        write_blocks(b"/", bytes(16), [], b"0", _none, _none, memoryview(bytearray(0)), False,
                     False)
    except Exception as err:  # a numba that cannot compile this: the Python path only
        _read_batch = _write_batch = _built = None
        UNAVAILABLE_REASON = f"{type(err).__name__}: {err}"
        AVAILABLE = False
