"""A job's blocks in memory: a load's destinations or a store's sources.

Two shapes, one protocol (`BlockBuffers`): a list of buffer objects, one per block
(`BufferList`), or rows of one 2-D uint8 array addressed by row index (`RowArray`, vLLM's
CPU tier). Each says which of a batch's blocks the C extension may take and where their
bytes start, so the batch path works on raw addresses and the Python path on views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvtier_offload import batchio

Addresses = np.ndarray  # int64, one address per block


class BlockBuffers(Protocol):
    def view(self, index: int) -> memoryview:
        """Block index's bytes."""
        ...

    def size(self, index: int) -> int:
        ...

    def sizes(self, indices: list[int]) -> np.ndarray:
        """The sizes of these blocks (int64)."""
        ...

    def total(self) -> int:
        """Bytes in all blocks."""
        ...

    def batchable(self, batch: range, direct: bool,
                  writes_into: bool = True) -> tuple[list[int], Addresses]:
        """The blocks of batch the C extension may take (write into, where writes_into:
        a load's destinations), and their addresses; direct: O_DIRECT alignment too."""
        ...


class BufferList:
    """Blocks as buffer objects, one per block, each of any size and alignment."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self._buffers = buffers

    def view(self, index: int) -> memoryview:
        return memoryview(self._buffers[index])

    def size(self, index: int) -> int:
        return len(self._buffers[index])

    def sizes(self, indices: list[int]) -> np.ndarray:
        return np.array([len(self._buffers[i]) for i in indices], dtype=np.int64)

    def total(self) -> int:
        return sum(len(b) for b in self._buffers)

    def batchable(self, batch: range, direct: bool,
                  writes_into: bool = True) -> tuple[list[int], Addresses]:
        indices: list[int] = []
        addresses: list[int] = []
        for index in batch:
            buffer = self._buffers[index]
            if writes_into and memoryview(buffer).readonly:
                continue
            at = batchio.address(buffer)
            if batchio.eligible(buffer, direct, at):
                indices.append(index)
                addresses.append(at)
        return indices, np.array(addresses, dtype=np.int64)


class RowArray:
    """Blocks as rows of one 2-D uint8 array: block i is row ids[i]. Every row has the
    same size and alignment, so one check covers them all, and an address is
    base + id * stride (no buffer object per block)."""

    def __init__(self, rows: np.ndarray, ids: np.ndarray) -> None:
        if rows.ndim != 2 or rows.dtype != np.uint8:
            raise ValueError(f"rows must be a 2-D uint8 array, not {rows.ndim}-D {rows.dtype}")
        if len(ids) and ids.view(np.uint64).max() >= rows.shape[0]:  # negatives wrap: huge
            raise IndexError(f"row ids must lie in [0, {rows.shape[0]})")
        self._rows, self._ids = rows, ids
        self._row = int(rows.shape[1])
        self._base = int(rows.ctypes.data)
        self._stride = int(rows.strides[0])
        self._contiguous = rows.strides[1] == 1
        self._writable = bool(rows.flags.writeable)

    def view(self, index: int) -> memoryview:
        return memoryview(self._rows[self._ids[index]])

    def size(self, index: int) -> int:
        return self._row

    def sizes(self, indices: list[int]) -> np.ndarray:
        return np.full(len(indices), self._row, dtype=np.int64)

    def total(self) -> int:
        return len(self._ids) * self._row

    def batchable(self, batch: range, direct: bool,
                  writes_into: bool = True) -> tuple[list[int], Addresses]:
        # The extension moves whole 8-byte words; O_DIRECT wants 4 KiB alignment.
        aligned = self._row % 8 == 0 and (not direct or (
            self._row % 4096 == 0 and self._base % 4096 == 0 and self._stride % 4096 == 0))
        usable = self._contiguous and (self._writable or not writes_into)
        if not (usable and aligned and self._row):
            return [], np.zeros(0, dtype=np.int64)
        return list(batch), self._base + self._ids[batch.start:batch.stop] * self._stride
