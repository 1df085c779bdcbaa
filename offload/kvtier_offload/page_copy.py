"""KV pages <-> staging rows with one call per piece, by address (issue #36, R3/R4).

Each (block, canonical tensor) page is one descriptor: its address in the KV cache, its
address in the block's staging row, its size. One batch call copies them all: on a GPU,
vLLM's own `swap_blocks_batch` (cuMemcpyBatchAsync where CUDA has it), which keeps the
bytes on the copy engines (no gather or scatter kernel on the SMs, no extra pass through
HBM, no block ids copied to the device) and costs the engine thread one call instead of
one per tensor. On CPU memory the same descriptors are copied by memmove, which lets a
CPU test check the address arithmetic bit for bit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

BatchCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]


class PageAddresses:
    """The descriptors of pieces of a worker: `views` are its canonical tensors as
    (num_blocks, page) views, `rows` the staging region's (num_rows, row) rows, each
    row holding every view's page back to back."""

    def __init__(self, views: list[torch.Tensor], rows: torch.Tensor) -> None:
        self.base = np.array([v.data_ptr() for v in views], dtype=np.int64)
        self.stride = np.array([v.stride(0) * v.element_size() for v in views], dtype=np.int64)
        self.size = np.array([v.shape[1] * v.element_size() for v in views], dtype=np.int64)
        self.offset = np.concatenate(([0], np.cumsum(self.size)[:-1])).astype(np.int64)
        self.row_base = rows.data_ptr()
        self.row_bytes = rows.stride(0) * rows.element_size()
        if int(self.size.sum()) > self.row_bytes:
            raise ValueError("the staging rows are shorter than a block's pages")

    def of(self, block_ids: np.ndarray, rows: int | np.ndarray) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cache addresses, staging addresses, sizes) of the blocks block_ids, staged in
        the staging rows `rows` (one per block), or in consecutive rows from row `rows`:
        int64 CPU tensors, block-major."""
        ids = np.asarray(block_ids, dtype=np.int64)[:, None]
        if isinstance(rows, (int, np.integer)):
            rows = np.arange(rows, rows + len(ids), dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)[:, None]
        cache = (self.base + ids * self.stride).ravel()
        staging = (self.row_base + rows * self.row_bytes + self.offset).ravel()
        sizes = np.tile(self.size, len(ids))
        return torch.from_numpy(cache), torch.from_numpy(staging), torch.from_numpy(sizes)


def vllm_batch_copy() -> BatchCopy | None:
    """vLLM's swap_blocks_batch where this vLLM build has its CUDA op, else None."""
    try:
        from vllm import _custom_ops as ops

        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018 (CUDA builds only)
    except (ImportError, AttributeError, RuntimeError):
        return None
    swap: BatchCopy = ops.swap_blocks_batch
    return swap


def memmove_batch_copy(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor,
                       any_order: bool = False) -> None:
    """The same descriptors between CPU memory (the KV cache on CPU, staging)."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)
