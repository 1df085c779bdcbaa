"""The batch path on its own: whole files in, whole files out, and anything else is
"not done" with nothing left behind."""

from __future__ import annotations

import mmap
import os
import time

import pytest

from kvtier_offload import batchio
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, decode_header, encode_header
from tests.offload.conftest import FP, round_trip_source, rows

pytestmark = pytest.mark.skipif(not batchio.AVAILABLE,
                                reason=batchio.UNAVAILABLE_REASON or "-")
SIZE = 64 * 1024
KEYS = [bytes([i]) * 36 for i in range(3)]


def headers(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n * HEADER_SIZE))


def expected(datas) -> memoryview:
    heads = headers(len(datas))
    for i, data in enumerate(datas):
        heads[i * HEADER_SIZE:(i + 1) * HEADER_SIZE] = encode_header(FP, KEYS[i], len(data), 0)
    return heads


def write(tmp_path, datas, finals=None, direct=False):
    heads = expected(datas)
    finals = finals or [str(tmp_path / f"{i}.kvb") for i in range(len(datas))]
    tmps = [f"{f}.tmp" for f in finals]
    return batchio.write_files(tmps, finals, datas, heads, direct, False), finals


@pytest.mark.parametrize("direct", [False, True])
def test_written_files_are_whole_and_read_back_bit_identical(tmp_path, direct):
    if direct and not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT")
    src = rows(3, SIZE, seed=5)
    status, finals = write(tmp_path, src, direct=direct)
    if direct and (status != batchio.DONE).all():
        pytest.skip("this filesystem refuses O_DIRECT")
    assert list(status) == [batchio.DONE] * 3
    for i, path in enumerate(finals):
        raw = open(path, "rb").read()
        assert decode_header(raw[:HEADER_SIZE], FP, KEYS[i], SIZE) == digest(src[i])
        assert raw[HEADER_SIZE:] == bytes(src[i])
    dest = rows(3, SIZE, seed=6)
    status, last_used = batchio.read_files(finals, dest, headers(3), expected(src), direct)
    assert list(status) == [batchio.DONE] * 3
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]
    assert all(abs(t - time.time_ns()) < 60e9 for t in last_used)
    assert sorted(os.listdir(tmp_path)) == ["0.kvb", "1.kvb", "2.kvb"]  # no temp left


def test_each_block_gets_its_own_time(tmp_path):
    import numpy as np

    src = rows(3, SIZE, seed=11)
    heads = expected(src)
    finals = [str(tmp_path / f"{i}.kvb") for i in range(3)]
    each = np.full(3, -1.0)
    began = time.monotonic()
    status = batchio.write_files([f"{f}.tmp" for f in finals], finals, src, heads, False,
                                 False, seconds=each)
    wall = time.monotonic() - began
    assert list(status) == [batchio.DONE] * 3
    assert (each > 0).all() and each.sum() <= wall
    each[:] = -1.0
    began = time.monotonic()
    status, _ = batchio.read_files([*finals[:2], str(tmp_path / "absent.kvb")],
                                   rows(3, SIZE), headers(3), heads, False, seconds=each)
    wall = time.monotonic() - began
    assert list(status) == [batchio.DONE, batchio.DONE, batchio.NOT_DONE]
    assert (each > 0).all() and each.sum() <= wall  # a missing file took time too


def test_a_write_that_cannot_finish_leaves_no_file(tmp_path):
    src = rows(3, SIZE, seed=7)
    finals = [str(tmp_path / "0.kvb"), str(tmp_path / "gone" / "1.kvb"),  # cannot open
              str(tmp_path / "2.kvb")]
    (tmp_path / "renamed-into-nothing").mkdir()
    tmps = [f"{finals[0]}.tmp", f"{finals[1]}.tmp", str(tmp_path / "renamed-into-nothing" / "t")]
    finals[2] = str(tmp_path / "missing-dir" / "2.kvb")  # the rename fails
    heads = headers(3)
    status = batchio.write_files(tmps, finals, src, heads, False, False)
    assert list(status) == [batchio.DONE, batchio.NOT_DONE, batchio.NOT_DONE]
    assert os.listdir(tmp_path / "renamed-into-nothing") == []  # the temp went too


def test_missing_and_short_files_are_not_done(tmp_path):
    src = rows(2, SIZE, seed=8)
    _, finals = write(tmp_path, src)
    with open(finals[1], "r+b") as f:
        f.truncate(HEADER_SIZE + SIZE - 1)
    dest = rows(3, SIZE, seed=9)
    status, _ = batchio.read_files([*finals, str(tmp_path / "absent.kvb")], dest, headers(3),
                                    expected(src + src[:1]), False)
    assert list(status) == [batchio.DONE, batchio.NOT_DONE, batchio.NOT_DONE]


def test_only_whole_words_and_aligned_buffers_take_the_batch_path():
    aligned = rows(1, SIZE)[0]
    assert batchio.eligible(aligned, direct=True)
    assert batchio.eligible(aligned[8:SIZE - 8], direct=False)
    assert not batchio.eligible(aligned[8:SIZE - 8], direct=True)
    assert not batchio.eligible(aligned[:SIZE - 3], direct=False)


@pytest.mark.parametrize("damage", ["payload", "digest", "key", "fingerprint", "length",
                                    "crc", "padding"])
def test_a_file_unlike_what_was_asked_for_is_not_done(tmp_path, damage):
    src = rows(2, SIZE, seed=10)
    _, finals = write(tmp_path, src)
    with open(finals[1], "r+b") as f:
        raw = bytearray(f.read())
        at = {"payload": HEADER_SIZE + 777, "digest": 24, "key": 36, "fingerprint": 8,
              "length": 16, "crc": 34 + len(KEYS[1]), "padding": HEADER_SIZE - 1}[damage]
        raw[at] ^= 0x01
        f.seek(0)
        f.write(raw)
    dest = rows(2, SIZE, seed=11)
    status, _ = batchio.read_files(finals, dest, headers(2), expected(src), False)
    assert list(status) == [batchio.DONE, batchio.NOT_DONE]


def test_a_block_already_stored_is_not_written_again(tmp_path):
    src = rows(2, SIZE, seed=12)
    _, finals = write(tmp_path, src[:1])
    before = os.stat(finals[0])
    status, _ = write(tmp_path, rows(1, SIZE, seed=13), finals=finals)
    assert list(status) == [batchio.EXISTS]
    assert os.stat(finals[0]).st_mtime_ns == before.st_mtime_ns
    assert sorted(os.listdir(tmp_path)) == ["0.kvb"]  # no temp file either


def test_last_use_is_the_later_of_atime_and_mtime(tmp_path):
    src = rows(1, SIZE, seed=14)
    _, finals = write(tmp_path, src)
    later = time.time_ns() + 3600 * 10**9  # a read may move atime to now, never past this
    os.utime(finals[0], ns=(10**9, later))
    status, last_used = batchio.read_files(finals, rows(1, SIZE), headers(1), expected(src),
                                           False)
    assert list(status) == [batchio.DONE] and list(last_used) == [later]


def test_real_calls_use_the_code_compiled_at_import(tmp_path):
    # Argument types that differ from the warm-up's (a read-only array was one) make
    # numba compile again, inside the first transfer: ~0.3 s per process.
    compiled = (len(batchio._read_batch.signatures), len(batchio._write_batch.signatures))
    assert compiled == (1, 1)
    src = rows(1, SIZE, seed=15)
    _, finals = write(tmp_path, src)
    batchio.read_files(finals, rows(1, SIZE), headers(1), expected(src), False)
    assert (len(batchio._read_batch.signatures),
            len(batchio._write_batch.signatures)) == compiled


def test_addresses_of_writable_and_read_only_buffers():
    import numpy as np

    row = rows(1, SIZE)[0]
    want = np.frombuffer(row, np.uint8).ctypes.data
    assert batchio.address(row[64:]) == want + 64
    assert batchio.address(row.toreadonly()[64:]) == want + 64
    assert batchio.address(row[:0]) == 0


def test_paths_pack_as_c_strings_whatever_their_encoded_length():
    paths = ["/v/a", "/vé/ü€/b", "", "/v/" + "x" * 300, "/v/\udcff"]  # last: undecodable byte
    raw, starts = batchio._c_strings(paths)
    for path, start in zip(paths, starts, strict=True):
        end = bytes(raw[start:]).index(b"\0") + start
        assert bytes(raw[start:end]) == os.fsencode(path)
    assert batchio._c_strings([])[1].size == 0
    with pytest.raises(ValueError, match="NUL"):
        batchio._c_strings(["/v/a\0b", "/v/c"])


def test_given_addresses_are_used_and_must_match_the_paths(tmp_path):
    import numpy as np

    def at(buffers) -> np.ndarray:
        return np.array([batchio.address(b) for b in buffers], dtype=np.int64)

    src = rows(2, SIZE, seed=7)
    sizes = np.full(2, SIZE, dtype=np.int64)
    finals = [str(tmp_path / f"{i}.kvb") for i in range(2)]
    status = batchio.write_at([f"{f}.tmp" for f in finals], finals, at(src), sizes,
                              expected(src), False, False)
    assert list(status) == [batchio.DONE] * 2
    dests = rows(2, SIZE, seed=8)
    # Swapped addresses: each file lands in the other buffer, so they are the ones used.
    got, _ = batchio.read_at(finals, at(dests[::-1]), sizes, headers(2), expected(src), False)
    assert list(got) == [batchio.DONE] * 2
    assert bytes(dests[0]) == bytes(src[1]) and bytes(dests[1]) == bytes(src[0])
    with pytest.raises(ValueError, match="addresses"):
        batchio.read_at(finals, at(dests[:1]), sizes, headers(2), expected(src), False)


def test_a_compile_failure_at_import_leaves_the_python_path_not_a_broken_import(tmp_path):
    import subprocess
    import sys

    # The warm-up call through the wrappers is the first to compile for real arguments;
    # make numba refuse it and the backend must still import, store and load.
    code = """
from numba.core import dispatcher
real = dispatcher.Dispatcher._compile_for_args
def refuse(self, *args, **kws):
    if self.py_func.__name__ in ("read_batch", "write_batch"):
        raise RuntimeError("no compiler here")
    return real(self, *args, **kws)
dispatcher.Dispatcher._compile_for_args = refuse
from kvtier_offload import batchio
print(batchio.AVAILABLE, batchio.UNAVAILABLE_REASON)
""" + round_trip_source(str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False RuntimeError: no compiler here")
    assert "batch I/O unavailable" in out.stderr


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("size", [SIZE, SIZE + 3 * 4096, SIZE + 24])
def test_pieces_write_the_same_files_and_read_them_back(tmp_path, direct, size):
    if direct and (size % 4096 or not hasattr(os, "O_DIRECT")):
        pytest.skip("O_DIRECT takes whole 4 KiB blocks only")
    src = rows(1, size + (-size % 4096), seed=16)[0][:size]
    whole = [str(tmp_path / "whole.kvb")]
    pieces = [str(tmp_path / "pieces.kvb")]
    status = batchio.write_files([whole[0] + ".tmp"], whole, [src], expected([src]), direct,
                                 False)
    if direct and (status != batchio.DONE).all():
        pytest.skip("this filesystem refuses O_DIRECT")
    assert list(status) == [batchio.DONE]
    assert list(batchio.write_files([pieces[0] + ".tmp"], pieces, [src], expected([src]),
                                    direct, False, piece=8192)) == [batchio.DONE]
    raw = open(pieces[0], "rb").read()
    assert raw == open(whole[0], "rb").read()  # same bytes, header digest included
    assert decode_header(raw[:HEADER_SIZE], FP, KEYS[0], size) == digest(src)
    for piece in (0, 8192, 4096):
        dest = rows(1, size + (-size % 4096), seed=17)[0][:size]
        status, _ = batchio.read_files(pieces, [dest], headers(1), expected([src]), direct,
                                       piece=piece)
        assert list(status) == [batchio.DONE] and bytes(dest) == bytes(src)


@pytest.mark.parametrize("at", [HEADER_SIZE, HEADER_SIZE + SIZE // 2, HEADER_SIZE + SIZE - 1])
def test_damage_in_any_piece_is_not_done(tmp_path, at):
    src = rows(1, SIZE, seed=18)
    _, finals = write(tmp_path, src)
    with open(finals[0], "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x80]))
    status, _ = batchio.read_files(finals, rows(1, SIZE), headers(1), expected(src), False,
                                   piece=8192)
    assert list(status) == [batchio.NOT_DONE]


def test_a_piece_is_whole_pages():
    none = memoryview(bytearray(0))
    with pytest.raises(ValueError, match="multiple of 4096"):
        batchio.read_files([], [], none, none, False, piece=1000)
    with pytest.raises(ValueError, match="multiple of 4096"):
        batchio.write_files([], [], [], none, False, False, piece=-4096)
