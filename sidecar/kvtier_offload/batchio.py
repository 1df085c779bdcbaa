"""Whole batches of block files read or written with the GIL released.

The block store's Python path costs ~25 us of interpreter time per file, and every
syscall in it hands the GIL between I/O threads; at 256 KiB that, not the copy, bounded
throughput. Here a batch of files (open, pread/pwrite, digest, close, rename) runs as
machine code compiled by numba (a vLLM dependency) calling libc directly, so I/O threads
run truly in parallel and the interpreter is paid once per batch.

Only the common case lives here: a file that is whole, reads or writes in full and (on
load) carries exactly the header expected and a payload matching its digest. Any other
outcome (a missing, short, damaged or foreign file, an error of any kind) is reported as
"not done" and the block store redoes that block on its Python path, which owns every
error, metric and log line, so there is one place that decides what a failure means.
Linux only; `AVAILABLE` is False elsewhere or without numba, and the store then uses
its Python path for everything.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence

import numpy as np

from kvtier_offload import digest as payload_digest
from kvtier_offload.fileformat import DIGEST_OFFSET, HEADER_SIZE

DONE = 0
NOT_DONE = 1
EXISTS = 2  # a store whose final name was already there: nothing written
_AT_EMPTY_PATH, _STATX_ATIME, _STATX_MTIME = 0x1000, 0x20, 0x40
_CLOCK_MONOTONIC = 1
_STATX_ATIME_AT, _STATX_MTIME_AT = 64, 112  # struct statx is the same on every arch


def address(buffer: memoryview) -> int:
    """Where a buffer's bytes start (0 when empty)."""
    if not len(buffer):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # 5x cheaper than numpy
    except TypeError:  # read-only: numpy reads the address without asking for writes
        return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def _addresses(buffers: Sequence[memoryview]) -> np.ndarray:
    return np.array([address(b) for b in buffers], dtype=np.int64)


def _c_strings(paths: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """NUL-terminated paths packed into one array, and where each starts (encoded in one
    call, the starts found from the NULs)."""
    raw = np.frombuffer(os.fsencode("\0".join(paths) + "\0"), dtype=np.uint8)
    ends = np.flatnonzero(raw == 0)
    if len(ends) != max(len(paths), 1):
        raise ValueError("a path holds a NUL byte")
    starts = np.zeros(len(paths), dtype=np.int64)
    starts[1:] = ends[:-1][:len(paths) - 1] + 1
    return raw, starts


def _build() -> tuple[object, object]:
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
    c_access = c("access", c_int, word, c_int)
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
            if not header_and_payload(fd, header, payload, first, False):
                return False
        while done < size:
            n = min(piece, size - done)
            if not write and done and not transfer(fd, payload + done, n, 4096 + done, False):
                return False
            digest_absorb(lanes, numba.carray(words_at(payload + done), n // 8), secret)
            if write and not transfer(fd, payload + done, n, 4096 + done, True):
                return False
            done += n
        cut = size // 256 * 256  # words past the last whole stripe (of the last piece)
        digest[0] = digest_finish(lanes, numba.carray(words_at(payload + cut), (size - cut) // 8),
                                  np.uint64(0), np.uint64(size))
        if write:
            numba.carray(words_at(header), 4096 // 8)[DIGEST_OFFSET // 8] = digest[0]
            return transfer(fd, header, 4096, 0, True)
        return True

    @numba.njit(nogil=True)
    def now_ns(timespec: np.ndarray) -> int:  # pragma: no cover (machine code)
        c_clock_gettime(_CLOCK_MONOTONIC, timespec.ctypes.data)
        return timespec[0] * 10**9 + timespec[1]

    @numba.njit(nogil=True)
    def header_expected(got: np.ndarray, want: np.ndarray, first: int) -> bool:  # pragma: no cover
        # Every word as expected except the payload digest, checked against the payload.
        digest_word = first + DIGEST_OFFSET // 8
        for w in range(first, first + HEADER_SIZE // 8):
            if w != digest_word and got[w] != want[w]:
                return False
        return True

    @numba.njit(nogil=True)
    def read_batch(paths: np.ndarray, starts: np.ndarray, dests: np.ndarray,
                   sizes: np.ndarray, headers: np.ndarray, expected: np.ndarray, flags: int,
                   piece: int, secret: np.ndarray, status: np.ndarray,
                   last_used: np.ndarray, elapsed: np.ndarray) -> None:  # pragma: no cover
        got, want = headers.view(np.uint64), expected.view(np.uint64)
        stx = np.zeros(256 // 8, np.int64)
        digest = np.zeros(1, np.uint64)
        clock = np.zeros(2, np.int64)
        for i in range(starts.shape[0]):
            status[i] = 1
            began = now_ns(clock)
            fd = c_open(paths.ctypes.data + starts[i], flags, 0)
            if fd < 0:
                elapsed[i] = now_ns(clock) - began
                continue
            if 0 < piece < sizes[i]:
                whole = in_pieces(fd, headers.ctypes.data + i * 4096, dests[i], sizes[i], piece,
                                  False, secret, digest)
            else:
                whole = header_and_payload(fd, headers.ctypes.data + i * 4096, dests[i],
                                           sizes[i], False)
                if whole:
                    digest[0] = digest_at(dests[i], sizes[i], secret)
            if whole and c_statx(fd, empty.ctypes.data, _AT_EMPTY_PATH,
                                 _STATX_ATIME | _STATX_MTIME, stx.ctypes.data) == 0:
                atime = stx[_STATX_ATIME_AT // 8] * 10**9 + (stx[_STATX_ATIME_AT // 8 + 1]
                                                            & 0xFFFFFFFF)
                mtime = stx[_STATX_MTIME_AT // 8] * 10**9 + (stx[_STATX_MTIME_AT // 8 + 1]
                                                            & 0xFFFFFFFF)
                last_used[i] = max(atime, mtime)
            c_close(fd)  # read-only: nothing to lose on a failed close
            first = i * (HEADER_SIZE // 8)
            if whole and header_expected(got, want, first) and got[
                    first + DIGEST_OFFSET // 8] == digest[0]:
                status[i] = 0
            elapsed[i] = now_ns(clock) - began

    @numba.njit(nogil=True)
    def write_batch(tmps: np.ndarray, tmp_starts: np.ndarray, finals: np.ndarray,
                    final_starts: np.ndarray, datas: np.ndarray, sizes: np.ndarray,
                    headers: np.ndarray, flags: int, fsync: bool, piece: int,
                    secret: np.ndarray, status: np.ndarray,
                    elapsed: np.ndarray) -> None:  # pragma: no cover
        digest_slots = headers.view(np.uint64)
        digest = np.zeros(1, np.uint64)
        clock = np.zeros(2, np.int64)
        for i in range(tmp_starts.shape[0]):
            status[i] = 1
            began = now_ns(clock)
            final = finals.ctypes.data + final_starts[i]
            if c_access(final, 0) == 0:  # another writer got there first: same bytes
                status[i] = 2
                elapsed[i] = now_ns(clock) - began
                continue
            pieces = 0 < piece < sizes[i]
            if not pieces:
                digest_slots[(i * 4096 + 24) // 8] = digest_at(datas[i], sizes[i], secret)
            tmp = tmps.ctypes.data + tmp_starts[i]
            fd = c_open(tmp, flags, 0o664)
            if fd < 0:
                elapsed[i] = now_ns(clock) - began
                continue
            if pieces:
                ok = in_pieces(fd, headers.ctypes.data + i * 4096, datas[i], sizes[i], piece,
                               True, secret, digest)
            else:
                ok = header_and_payload(fd, headers.ctypes.data + i * 4096, datas[i],
                                        sizes[i], True)
            if ok and fsync:
                ok = c_fdatasync(fd) == 0
            ok = c_close(fd) == 0 and ok  # NFS reports ENOSPC at close
            if ok and c_rename(tmp, final) == 0:
                status[i] = 0
            else:
                c_unlink(tmp)
            elapsed[i] = now_ns(clock) - began

    assert DIGEST_OFFSET == 24 and HEADER_SIZE == 4096  # as compiled above
    return read_batch, write_batch


try:
    _read_batch, _write_batch = _build()
    UNAVAILABLE_REASON = ""
except Exception as err:  # no numba, not Linux, a libc without these symbols
    _read_batch = _write_batch = None
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


def read_files(paths: Sequence[str], dests: Sequence[memoryview], headers: memoryview,
               expected: memoryview, direct: bool, piece: int = 0,
               seconds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read each file's header into headers[i * 4096:] and its payload into dests[i], and
    check them: the header must equal expected[i * 4096:] but for its digest field, which
    must equal the payload's digest. Returns (status, last use): DONE where all of that
    holds, else NOT_DONE; last use is the later of the file's atime and mtime in ns, 0
    where statx could not say. With direct, dests and headers must be 4 KiB aligned.
    piece: payloads larger than this move in pieces of it (a multiple of 4 KiB), each
    hashed while in cache; 0: one read per file (what a device wants). seconds: where
    given, filled with each block's time (open to close), for the latency histogram."""
    return read_at(paths, _addresses(dests),
                   np.array([len(d) for d in dests], dtype=np.int64), headers, expected,
                   direct, piece, seconds)


def read_at(paths: Sequence[str], addresses: np.ndarray, sizes: np.ndarray,
            headers: memoryview, expected: memoryview, direct: bool, piece: int = 0,
            seconds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """read_files into raw memory: payload i goes to addresses[i] (int64), sizes[i] bytes
    (int64, a multiple of 8). The caller vouches that each range is writable memory it
    owns, and with direct, 4 KiB aligned."""
    _check_piece(piece)
    n = len(paths)
    if len(addresses) != n or len(sizes) != n:
        raise ValueError(f"{len(addresses)} addresses and {len(sizes)} sizes for {n} paths")
    raw, starts = _c_strings(paths)
    status = np.ones(n, dtype=np.int64)
    last_used = np.zeros(n, dtype=np.int64)
    elapsed = np.zeros(n, dtype=np.int64)
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    _read_batch(raw, starts, np.ascontiguousarray(addresses, dtype=np.int64),  # type: ignore[misc]
                np.ascontiguousarray(sizes, dtype=np.int64), np.frombuffer(headers, np.uint8),
                np.frombuffer(expected, np.uint8), flags, piece, payload_digest.SECRET, status,
                last_used, elapsed)
    if seconds is not None:
        seconds[:] = elapsed * 1e-9
    return status, last_used


def write_files(tmps: Sequence[str], finals: Sequence[str], datas: Sequence[memoryview],
                headers: memoryview, direct: bool, fsync: bool, piece: int = 0,
                seconds: np.ndarray | None = None) -> np.ndarray:
    """Write each block to its temp name (header from headers[i * 4096:], its digest
    filled in here; then the payload), close, and rename it to its final name. Returns
    per block DONE, EXISTS (its final name was already there: nothing written) or
    NOT_DONE; a block not done leaves no file behind. piece, seconds (here: from the
    existence check to the rename): as for read_files."""
    return write_at(tmps, finals, _addresses(datas),
                    np.array([len(d) for d in datas], dtype=np.int64), headers, direct, fsync,
                    piece, seconds)


def write_at(tmps: Sequence[str], finals: Sequence[str], addresses: np.ndarray,
             sizes: np.ndarray, headers: memoryview, direct: bool, fsync: bool,
             piece: int = 0, seconds: np.ndarray | None = None) -> np.ndarray:
    """write_files from raw memory: payload i is sizes[i] bytes (int64, a multiple of 8)
    at addresses[i] (int64), memory the caller vouches for (4 KiB aligned with direct)."""
    _check_piece(piece)
    n = len(tmps)
    if len(finals) != n or len(addresses) != n or len(sizes) != n:
        raise ValueError(f"{len(finals)} final names, {len(addresses)} addresses and "
                         f"{len(sizes)} sizes for {n} temp names")
    tmp_raw, tmp_starts = _c_strings(tmps)
    final_raw, final_starts = _c_strings(finals)
    status = np.ones(n, dtype=np.int64)
    elapsed = np.zeros(n, dtype=np.int64)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | (
        os.O_DIRECT if direct else 0)
    _write_batch(tmp_raw, tmp_starts, final_raw, final_starts,  # type: ignore[misc]
                 np.ascontiguousarray(addresses, dtype=np.int64),
                 np.ascontiguousarray(sizes, dtype=np.int64), np.frombuffer(headers, np.uint8),
                 flags, fsync, piece, payload_digest.SECRET, status, elapsed)
    if seconds is not None:
        seconds[:] = elapsed * 1e-9
    return status


if AVAILABLE:
    # Compile now (about 3 s, once per process), not inside the first transfer a user
    # waits on, and through the wrappers, so the argument types are exactly the ones real
    # calls pass (numba compiles again for any other type, read-only arrays included).
    try:
        _none = memoryview(bytearray(0))
        read_files([], [], _none, _none, False)
        write_files([], [], [], _none, False, False)
    except Exception as err:  # a numba that cannot compile this: the Python path only
        _read_batch = _write_batch = None
        UNAVAILABLE_REASON = f"{type(err).__name__}: {err}"
        AVAILABLE = False
