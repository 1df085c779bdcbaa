"""The batch path on its own: whole files in, whole files out, and anything else is
"not done" with nothing left behind."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

from kvtier_offload import batchio
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, decode_header, encode_header, header_prefix
from kvtier_offload.layout import Layout
from tests.offload.conftest import FP, round_trip_source, rows

pytestmark = pytest.mark.skipif(not batchio.AVAILABLE,
                                reason=batchio.UNAVAILABLE_REASON or "-")
SIZE = 64 * 1024
KEYS = [bytes([i]) * 36 for i in range(3)]
PREFIX = header_prefix(FP)


def headers(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n * HEADER_SIZE))


def at(buffers) -> np.ndarray:
    return np.array([batchio.address(b) for b in buffers], dtype=np.int64)


def sizes(buffers) -> np.ndarray:
    return np.array([len(b) for b in buffers], dtype=np.int64)


def layout(tmp_path, keys=KEYS) -> Layout:
    out = Layout(str(tmp_path), FP)
    for key in keys:
        out.ensure_dir(os.path.dirname(out.path(key)))
    return out


def write(lay: Layout, datas, keys=KEYS, direct=False, piece=0, seconds=None):
    return batchio.write_blocks(os.fsencode(lay.base), PREFIX, keys[:len(datas)], b"feed",
                                at(datas), sizes(datas), headers(len(datas)), direct, False,
                                piece, seconds)


def read(lay: Layout, dests, keys=KEYS, direct=False, piece=0, seconds=None):
    return batchio.read_blocks(os.fsencode(lay.base), PREFIX, keys[:len(dests)], at(dests),
                               sizes(dests), headers(len(dests)), direct, piece, seconds)


def files(lay: Layout) -> list[str]:
    return sorted(name for _, _, names in os.walk(lay.base) for name in names)


@pytest.mark.parametrize("direct", [False, True])
def test_written_files_are_whole_and_read_back_bit_identical(tmp_path, direct):
    if direct and not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT")
    lay = layout(tmp_path)
    src = rows(3, SIZE, seed=5)
    status = write(lay, src, direct=direct)
    if direct and (status != batchio.DONE).all():
        pytest.skip("this filesystem refuses O_DIRECT")
    assert list(status) == [batchio.DONE] * 3
    for i, key in enumerate(KEYS):
        raw = open(lay.path(key), "rb").read()  # at the name Layout gives it
        assert decode_header(raw[:HEADER_SIZE], FP, key, SIZE) == digest(src[i])
        assert raw[HEADER_SIZE:] == bytes(src[i])
    dest = rows(3, SIZE, seed=6)
    status, last_used = read(lay, dest, direct=direct)
    assert list(status) == [batchio.DONE] * 3
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]
    assert all(abs(t - time.time_ns()) < 60e9 for t in last_used)
    assert files(lay) == sorted(os.path.basename(lay.path(k)) for k in KEYS)  # no temp left


@pytest.mark.parametrize("key", [b"\x01\x02\x03\x04", bytes(range(36)), b"\xff" * 114],
                         ids=["4 bytes", "36 bytes", "114 bytes"])
def test_paths_and_headers_are_the_ones_layout_and_fileformat_make(key):
    lay = Layout("/vol/ünï/çödé", FP)  # not ASCII: the base goes over as encoded bytes
    base = os.fsencode(lay.base)
    for size in (8, SIZE, 1 << 40):
        path, header = batchio.built_for(base, PREFIX, key, size)
        assert path == os.fsencode(lay.path(key))
        assert header == encode_header(FP, key, size, 0)
    temp, _ = batchio.built_for(base, PREFIX, key, SIZE, b"0123abcd")
    assert temp == os.fsencode(lay.temp_path(key, "0123abcd"))


@pytest.mark.parametrize("key", [b"", b"\x01", b"\xab\xcd\xef", b"\xff" * 115])
def test_keys_outside_the_layout_are_refused_like_layout_refuses_them(key):
    lay = Layout("/vol", FP)
    with pytest.raises(ValueError, match="key"):
        lay.path(key)
    with pytest.raises(ValueError, match="than"):
        batchio.built_for(os.fsencode(lay.base), PREFIX, key, SIZE)


def test_keys_of_different_lengths_in_one_batch_over_a_dirty_buffer(tmp_path):
    ks = [b"\x07" * 36, b"\x08" * 5, b"\x09" * 100]
    lay = layout(tmp_path, ks)
    src = rows(3, SIZE, seed=3)
    heads = headers(3)
    heads[:] = b"\xff" * len(heads)  # a reused buffer: stale bytes must not survive
    status = batchio.write_blocks(os.fsencode(lay.base), PREFIX, ks, b"feed", at(src),
                                  sizes(src), heads, False, False)
    assert list(status) == [batchio.DONE] * 3
    for key, data in zip(ks, src, strict=True):
        assert open(lay.path(key), "rb").read(HEADER_SIZE) == encode_header(
            FP, key, SIZE, digest(data))
    dest = rows(3, SIZE, seed=4)
    status, _ = read(lay, dest, ks)
    assert list(status) == [batchio.DONE] * 3
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]


def test_each_block_gets_its_own_time(tmp_path):
    lay = layout(tmp_path)
    src = rows(3, SIZE, seed=11)
    each = np.full(3, -1.0)
    began = time.monotonic()
    status = write(lay, src, seconds=each)
    wall = time.monotonic() - began
    assert list(status) == [batchio.DONE] * 3
    assert (each > 0).all() and each.sum() <= wall
    os.unlink(lay.path(KEYS[2]))
    each[:] = -1.0
    began = time.monotonic()
    status, _ = read(lay, rows(3, SIZE), seconds=each)
    wall = time.monotonic() - began
    assert list(status) == [batchio.DONE, batchio.DONE, batchio.NOT_DONE]
    assert (each > 0).all() and each.sum() <= wall  # a missing file took time too


def test_a_write_whose_directory_is_gone_is_not_done(tmp_path):
    lay = layout(tmp_path, KEYS[:2])  # the third block's fan-out directory is not there
    status = write(lay, rows(3, SIZE, seed=7))
    assert list(status) == [batchio.DONE, batchio.DONE, batchio.NOT_DONE]
    assert len(files(lay)) == 2


def test_a_write_that_runs_out_of_space_leaves_no_file(tmp_path):
    from tests.mounts import tmpfs

    with tmpfs(tmp_path / "vol", "1m") as vol:
        lay = layout(vol)
        src = rows(2, 768 << 10, seed=7)  # the second does not fit
        status = write(lay, src)
        assert list(status) == [batchio.DONE, batchio.NOT_DONE]
        assert files(lay) == [os.path.basename(lay.path(KEYS[0]))]  # its temp went too


def test_missing_and_short_files_are_not_done(tmp_path):
    lay = layout(tmp_path)
    src = rows(2, SIZE, seed=8)
    write(lay, src)
    with open(lay.path(KEYS[1]), "r+b") as f:
        f.truncate(HEADER_SIZE + SIZE - 1)
    status, _ = read(lay, rows(3, SIZE, seed=9))
    assert list(status) == [batchio.DONE, batchio.NOT_DONE, batchio.NOT_DONE]


def test_any_buffer_takes_the_batch_path_but_o_direct_wants_whole_aligned_pages(tmp_path):
    aligned = rows(1, SIZE)[0]
    assert batchio.eligible(aligned, direct=True)
    assert batchio.eligible(aligned[8:SIZE - 8], direct=False)
    assert not batchio.eligible(aligned[8:SIZE - 8], direct=True)
    assert batchio.eligible(aligned[3:SIZE - 2], direct=False)  # XXH3 takes any length
    lay = layout(tmp_path)
    odd = aligned[3:SIZE - 2]
    assert list(write(lay, [odd])) == [batchio.DONE]
    dest = rows(1, SIZE, seed=3)[0][5:SIZE - 0]
    status, _ = read(lay, [dest[:len(odd)]])
    assert list(status) == [batchio.DONE] and bytes(dest[:len(odd)]) == bytes(odd)


@pytest.mark.parametrize("damage", ["payload", "digest", "key", "fingerprint", "length",
                                    "crc", "padding"])
def test_a_file_unlike_what_was_asked_for_is_not_done(tmp_path, damage):
    lay = layout(tmp_path)
    write(lay, rows(2, SIZE, seed=10))
    with open(lay.path(KEYS[1]), "r+b") as f:
        raw = bytearray(f.read())
        where = {"payload": HEADER_SIZE + 777, "digest": 24, "key": 36, "fingerprint": 8,
                 "length": 16, "crc": 34 + len(KEYS[1]), "padding": HEADER_SIZE - 1}[damage]
        raw[where] ^= 0x01
        f.seek(0)
        f.write(raw)
    status, _ = read(lay, rows(2, SIZE, seed=11))
    assert list(status) == [batchio.DONE, batchio.NOT_DONE]


def test_a_file_of_another_key_or_size_is_not_done(tmp_path):
    lay = layout(tmp_path)
    write(lay, rows(2, SIZE, seed=10))
    os.replace(lay.path(KEYS[0]), lay.path(KEYS[1]))  # a whole, valid file: another key's
    assert list(read(lay, rows(2, SIZE))[0]) == [batchio.NOT_DONE] * 2
    write(lay, rows(1, SIZE, seed=10))
    assert list(read(lay, [rows(1, SIZE + 4096)[0]])[0]) == [batchio.NOT_DONE]  # other size


def test_a_block_already_stored_is_not_written_again(tmp_path):
    lay = layout(tmp_path)
    write(lay, rows(1, SIZE, seed=12))
    before = os.stat(lay.path(KEYS[0]))
    assert list(write(lay, rows(1, SIZE, seed=13))) == [batchio.EXISTS]
    assert os.stat(lay.path(KEYS[0])).st_mtime_ns == before.st_mtime_ns
    assert len(files(lay)) == 1  # no temp file either


def test_last_use_is_the_later_of_atime_and_mtime(tmp_path):
    lay = layout(tmp_path)
    write(lay, rows(1, SIZE, seed=14))
    later = time.time_ns() + 3600 * 10**9  # a read may move atime to now, never past this
    os.utime(lay.path(KEYS[0]), ns=(10**9, later))
    status, last_used = read(lay, rows(1, SIZE))
    assert list(status) == [batchio.DONE] and list(last_used) == [later]


def test_addresses_of_writable_and_read_only_buffers():
    row = rows(1, SIZE)[0]
    want = np.frombuffer(row, np.uint8).ctypes.data
    assert batchio.address(row[64:]) == want + 64
    assert batchio.address(row.toreadonly()[64:]) == want + 64
    assert batchio.address(row[:0]) == 0


def test_given_addresses_are_used_and_must_match_the_keys(tmp_path):
    lay = layout(tmp_path)
    src = rows(2, SIZE, seed=7)
    assert list(write(lay, src)) == [batchio.DONE] * 2
    dests = rows(2, SIZE, seed=8)
    # Swapped addresses: each file lands in the other buffer, so they are the ones used.
    got, _ = batchio.read_blocks(os.fsencode(lay.base), PREFIX, KEYS[:2], at(dests[::-1]),
                                 sizes(dests), headers(2), False)
    assert list(got) == [batchio.DONE] * 2
    assert bytes(dests[0]) == bytes(src[1]) and bytes(dests[1]) == bytes(src[0])
    with pytest.raises(ValueError, match="addresses"):
        batchio.read_blocks(os.fsencode(lay.base), PREFIX, KEYS[:2], at(dests[:1]),
                            sizes(dests), headers(2), False)


def test_bad_names_are_refused_before_any_io(tmp_path):
    lay = layout(tmp_path)
    src = rows(1, SIZE)
    with pytest.raises(ValueError, match="NUL"):
        read(Layout(str(tmp_path) + "\0x", FP), src)
    with pytest.raises(ValueError, match="longer than"):
        write(lay, src, keys=[b"k" * 5000])
    assert files(lay) == []


@pytest.mark.parametrize("how", ["env", "import"])
@pytest.mark.slow
def test_without_the_extension_the_python_path_runs_and_says_why(tmp_path, how):
    import subprocess
    import sys

    # "env": turned off by KVTIER_OFFLOAD_NATIVE=0; "import": a .so that does not load
    # (another platform's). Either way the backend imports, stores and loads on its
    # Python path (digest by the stand-in below where python-xxhash is missing).
    code = f"""
import sys, types
import kvtier_offload, kvtier_offload._native as real
if "{how}" == "import":
    del kvtier_offload._native
    sys.modules["kvtier_offload._native"] = None  # importing it now fails
try:
    import xxhash
except ImportError:
    sys.modules["xxhash"] = types.SimpleNamespace(xxh3_64_intdigest=real.digest)
from kvtier_offload import batchio, native
print(batchio.AVAILABLE, native.CODE)
""" + round_trip_source(str(tmp_path))
    env = {**os.environ, "KVTIER_OFFLOAD_NATIVE": "0" if how == "env" else "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "turned-off" if how == "env" else "not-built"]
    assert "kvtier block store: Python path" in out.stderr
    assert ("KVTIER_OFFLOAD_NATIVE=0" if how == "env" else "does not import") in out.stderr


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("size", [SIZE, SIZE + 3 * 4096, SIZE + 24])
def test_pieces_write_the_same_files_and_read_them_back(tmp_path, direct, size):
    if direct and (size % 4096 or not hasattr(os, "O_DIRECT")):
        pytest.skip("O_DIRECT takes whole 4 KiB blocks only")
    src = rows(1, size + (-size % 4096), seed=16)[0][:size]
    whole, pieces = layout(tmp_path / "whole"), layout(tmp_path / "pieces")
    status = write(whole, [src], direct=direct)
    if direct and (status != batchio.DONE).all():
        pytest.skip("this filesystem refuses O_DIRECT")
    assert list(status) == [batchio.DONE]
    assert list(write(pieces, [src], direct=direct, piece=8192)) == [batchio.DONE]
    raw = open(pieces.path(KEYS[0]), "rb").read()
    assert raw == open(whole.path(KEYS[0]), "rb").read()  # same bytes, header digest included
    assert decode_header(raw[:HEADER_SIZE], FP, KEYS[0], size) == digest(src)
    for piece in (0, 8192, 4096):
        dest = rows(1, size + (-size % 4096), seed=17)[0][:size]
        status, _ = read(pieces, [dest], direct=direct, piece=piece)
        assert list(status) == [batchio.DONE] and bytes(dest) == bytes(src)


@pytest.mark.parametrize("where", [HEADER_SIZE, HEADER_SIZE + SIZE // 2,
                                   HEADER_SIZE + SIZE - 1])
def test_damage_in_any_piece_is_not_done(tmp_path, where):
    lay = layout(tmp_path)
    write(lay, rows(1, SIZE, seed=18))
    with open(lay.path(KEYS[0]), "r+b") as f:
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x80]))
    status, _ = read(lay, rows(1, SIZE), piece=8192)
    assert list(status) == [batchio.NOT_DONE]


def test_a_piece_is_whole_pages():
    none = np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match="multiple of 4096"):
        batchio.read_blocks(b"/", PREFIX, [], none, none, headers(1), False, piece=1000)
    with pytest.raises(ValueError, match="multiple of 4096"):
        batchio.write_blocks(b"/", PREFIX, [], b"0", none, none, headers(1), False, False,
                             piece=-4096)


def test_block_times_reach_any_float_array_and_a_wrong_length_is_refused(tmp_path):
    lay = layout(tmp_path)
    write(lay, rows(2, SIZE, seed=19))
    each = np.zeros(2, dtype=np.float32)  # not what the machine code writes: copied back
    status, _ = read(lay, rows(2, SIZE), seconds=each)
    assert list(status) == [batchio.DONE] * 2 and (each > 0).all() and (each < 60).all()
    with pytest.raises(ValueError, match="seconds"):
        read(lay, rows(2, SIZE), seconds=np.zeros(3))
