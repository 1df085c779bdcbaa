"""A job's blocks in memory on their own: which blocks the C extension may take, and
where their bytes are."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvtier_offload import batchio
from kvtier_offload.buffers import BufferList, RowArray


def page_rows(n: int, row: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n * row), np.uint8).reshape(n, row)


def test_rows_are_checked_when_the_job_is_made():
    with pytest.raises(ValueError, match="2-D uint8"):
        RowArray(np.zeros((2, 8), dtype=np.uint16), np.arange(2))
    with pytest.raises(ValueError, match="2-D uint8"):
        RowArray(np.zeros(16, dtype=np.uint8), np.arange(2))
    rows = page_rows(4, 4096)
    for bad in ([4], [-1]):  # past the end, or negative (which would index from the end)
        with pytest.raises(IndexError):
            RowArray(rows, np.array(bad, dtype=np.int64))


def test_row_addresses_come_from_their_ids():
    rows = page_rows(4, 8192)
    blocks = RowArray(rows, np.array([3, 0, 2], dtype=np.int64))
    indices, addresses = blocks.batchable(range(1, 3), direct=True)
    base = rows.ctypes.data
    assert indices == [1, 2] and addresses.tolist() == [base, base + 2 * 8192]
    assert blocks.total() == 3 * 8192 and blocks.sizes([0, 2]).tolist() == [8192, 8192]
    assert blocks.size(0) == 8192
    rows[3, :4] = [1, 2, 3, 4]
    assert bytes(blocks.view(0)[:4]) == b"\x01\x02\x03\x04"


def test_rows_the_extension_cannot_take_are_left_to_the_python_path():
    ids = np.arange(2, dtype=np.int64)
    odd = RowArray(page_rows(2, 4100)[:, :4100], ids)  # not whole 8-byte words
    assert odd.batchable(range(2), direct=False)[0] == []
    buffered_only = RowArray(page_rows(2, 4104), ids)  # 8-byte words, not 4 KiB
    assert buffered_only.batchable(range(2), direct=False)[0] == [0, 1]
    assert buffered_only.batchable(range(2), direct=True)[0] == []
    strided = RowArray(page_rows(2, 8192)[:, ::2], ids)  # not contiguous
    assert strided.batchable(range(2), direct=False)[0] == []
    frozen = page_rows(2, 4096)
    frozen.flags.writeable = False
    frozen_rows = RowArray(frozen, ids)
    assert frozen_rows.batchable(range(2), direct=True)[0] == []  # never loaded into
    assert frozen_rows.batchable(range(2), direct=True, writes_into=False)[0] == [0, 1]


def test_buffers_each_judged_on_their_own():
    aligned = memoryview(mmap.mmap(-1, 8192))
    unaligned = memoryview(bytearray(8192 + 1))[1:]
    frozen = memoryview(mmap.mmap(-1, 4096)).toreadonly()
    blocks = BufferList([aligned, unaligned, frozen])
    assert blocks.total() == 8192 + 8192 + 4096
    assert blocks.sizes([0, 2]).tolist() == [8192, 4096] and blocks.size(1) == 8192
    indices, addresses = blocks.batchable(range(3), direct=True)
    assert indices == [0] and addresses.tolist() == [batchio.address(aligned)]
    assert blocks.batchable(range(3), direct=False)[0] == [0, 1]  # a load: not frozen
    assert blocks.batchable(range(3), direct=False, writes_into=False)[0] == [0, 1, 2]
    assert blocks.batchable(range(1, 3), direct=True, writes_into=False)[0] == [2]
