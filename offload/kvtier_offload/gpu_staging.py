"""The staging region of kvtier's offloading worker: one host buffer of at most
`max_staging_bytes`, allocated once when the worker starts (pinned when the KV cache is
on a GPU), from which transfers borrow contiguous runs of rows.

Every transfer, of any size, goes through it piece by piece, so pinned memory never
grows after start-up. PyTorch's pinned allocator rounds each allocation up to a power
of two and keeps it for the life of the process, so the region asks for exactly the
largest power of two that fits the bound: what it asks for is what gets pinned.

Each row holds one file: `slots_per_row` KV blocks (GPU blocks) in token order, each
block every canonical tensor's page back to back; the same bytes are also seen as slots,
one GPU block each. Beside the rows the region keeps one int64 per slot for that block's
GPU block id, so the ids of a run reach the GPU by an asynchronous copy from pinned
memory that stays valid for as long as the run is borrowed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

INDEX_BYTES = 8  # one int64 GPU block id per row


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class Run:
    """Rows [start, start + rows) of the region, borrowed by one piece of a transfer."""

    start: int
    rows: int

    @property
    def stop(self) -> int:
        return self.start + self.rows


class StagingArena:
    """One staging buffer, allocated in the constructor and never again; hands out runs
    of consecutive rows (first fit) and takes them back (merging neighbours). A row is
    one file of `slots_per_row` GPU blocks; `slots` sees the same bytes one block a row."""

    def __init__(self, row_bytes: int, pinned: bool, max_bytes: int,
                 slots_per_row: int = 1) -> None:
        if row_bytes <= 0 or slots_per_row <= 0 or row_bytes % slots_per_row:
            raise ValueError(f"row_bytes ({row_bytes}) must be a positive multiple of "
                             f"slots_per_row ({slots_per_row})")
        index_bytes = INDEX_BYTES * slots_per_row
        if max_bytes < row_bytes + index_bytes:
            raise ValueError(
                f"max_staging_bytes ({max_bytes}) cannot hold one file of {row_bytes} "
                f"bytes: raise max_staging_bytes in kv_connector_extra_config to at least "
                f"{_pow2_floor(row_bytes + index_bytes) * 2}, or make the files smaller "
                "(block_size)")
        total = _pow2_floor(max_bytes)
        rows = total // (row_bytes + index_bytes)
        while rows and _align8(rows * row_bytes) + rows * index_bytes > total:
            rows -= 1
        if rows < 1:
            raise ValueError(
                f"max_staging_bytes ({max_bytes}) cannot hold one file of {row_bytes} "
                f"bytes once rounded down to a power of two ({total}): raise it to at "
                f"least {total * 2}")
        self.row_bytes, self.pinned, self.nbytes, self.num_rows = row_bytes, pinned, total, rows
        self.slots_per_row = slots_per_row
        # The only allocation: every run, index slot and file I/O lives in this buffer.
        self.buffer = torch.empty(total, dtype=torch.int8, pin_memory=pinned)
        self.rows = self.buffer[:rows * row_bytes].view(rows, row_bytes)
        self.slots = self.rows.view(rows * slots_per_row, row_bytes // slots_per_row)
        at = _align8(rows * row_bytes)
        self.index = self.buffer[at:at + rows * index_bytes].view(torch.int64)
        self.row_array = self.rows.numpy().view(np.uint8)  # what the block store reads/writes
        self.slot_array = self.slots.numpy().view(np.uint8)
        self.index_array = self.index.numpy()  # one GPU block id per slot
        self._free: list[tuple[int, int]] = [(0, rows)]  # sorted (start, rows)
        self.free_rows = rows

    def take(self, want: int) -> Run | None:
        """A run of `want` rows (the first that fits), else the largest free run that is
        shorter; None when nothing is free."""
        if want <= 0 or not self._free:
            return None
        best = -1
        for i, (_start, rows) in enumerate(self._free):
            if rows >= want:
                best = i
                break
            if best < 0 or rows > self._free[best][1]:
                best = i
        start, rows = self._free[best]
        got = min(rows, want)
        if got == rows:
            del self._free[best]
        else:
            self._free[best] = (start + got, rows - got)
        self.free_rows -= got
        return Run(start, got)

    def give(self, run: Run) -> None:
        """Return a run: the device copy and the file I/O that used it are over."""
        i = bisect.bisect_left(self._free, (run.start, 0))
        start, rows = run.start, run.rows
        if i < len(self._free) and self._free[i][0] == run.stop:  # merge the next run
            rows += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the previous
            start, rows = self._free[i - 1][0], self._free[i - 1][1] + rows
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, rows))
        self.free_rows += run.rows

    def row_ids(self, run: Run) -> np.ndarray:
        return np.arange(run.start, run.stop, dtype=np.int64)


def widest_views(tensors: list[torch.Tensor], pages: list[int],
                 row_bytes: int) -> tuple[torch.dtype, list[torch.Tensor]]:
    """Each canonical int8 tensor as (num_blocks, page) in the widest integer type that
    every page, row stride and address allows: the gather and scatter kernels then move
    8 bytes per element instead of 1. Raises if a tensor's rows are not viewable 2-D."""
    flat = []
    for tensor, page in zip(tensors, pages, strict=True):
        if tensor.dtype != torch.int8:
            tensor = tensor.view(torch.int8)
        two_d = tensor if tensor.dim() == 2 else tensor.view(tensor.shape[0], -1)
        if two_d.stride(1) != 1 or two_d.shape[1] < page:
            raise ValueError(f"a canonical KV tensor {tuple(tensor.shape)} has no contiguous "
                             f"page of {page} bytes per block")
        flat.append(two_d[:, :page])
    for dtype in (torch.int64, torch.int32, torch.int16):
        width = dtype.itemsize
        if row_bytes % width == 0 and all(
                v.shape[1] % width == 0 and v.stride(0) % width == 0
                and v.data_ptr() % width == 0 for v in flat):
            return dtype, [v.view(dtype) for v in flat]
    return torch.int8, flat
