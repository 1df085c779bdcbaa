"""The batch path on its own: whole files in, whole files out, and anything else is
"not done" with nothing left behind."""

from __future__ import annotations

import mmap
import os

import pytest

from kvtier_offload import batchio
from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, decode_header, encode_header
from tests.offload.conftest import FP, rows

pytestmark = pytest.mark.skipif(not batchio.AVAILABLE,
                                reason=batchio.UNAVAILABLE_REASON or "-")
SIZE = 64 * 1024
KEYS = [bytes([i]) * 36 for i in range(3)]


def headers(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n * HEADER_SIZE))


def write(tmp_path, datas, finals=None, direct=False):
    heads = headers(len(datas))
    for i, data in enumerate(datas):
        heads[i * HEADER_SIZE:(i + 1) * HEADER_SIZE] = encode_header(FP, KEYS[i], len(data), 0)
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
    status, digests = batchio.read_files(finals, dest, headers(3), direct)
    assert list(status) == [batchio.DONE] * 3
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]
    assert [int(d) for d in digests] == [digest(s) for s in src]
    assert sorted(os.listdir(tmp_path)) == ["0.kvb", "1.kvb", "2.kvb"]  # no temp left


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
                                    False)
    assert list(status) == [batchio.DONE, batchio.NOT_DONE, batchio.NOT_DONE]


def test_only_whole_words_and_aligned_buffers_take_the_batch_path():
    aligned = rows(1, SIZE)[0]
    assert batchio.eligible(aligned, direct=True)
    assert batchio.eligible(aligned[8:SIZE - 8], direct=False)
    assert not batchio.eligible(aligned[8:SIZE - 8], direct=True)
    assert not batchio.eligible(aligned[:SIZE - 3], direct=False)
