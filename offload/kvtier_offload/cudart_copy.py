"""vLLM's swap_blocks_batch without vLLM (issue #36, R3/R4): the CUDA runtime's own
batched copy, `cudaMemcpyBatchAsync` (CUDA 12.8 and later), called through ctypes on the
runtime library PyTorch has already loaded.

One call per piece copies every (block, tensor) page by address between the KV cache and
pinned staging, on the copy engines (no gather or scatter kernel on the SMs, no extra pass
through HBM), as vLLM's op does with the driver's cuMemcpyBatchAsync. It takes the same
descriptors (page_copy.PageAddresses) and has the same signature, so the worker uses
either. PyTorch itself has no batched copy (torch 2.13's Python API and headers hold none),
and a copy_ per page would cost the engine thread one call per page.

The runtime's signature depends on its major version (cudaRuntimeGetVersion): 12.x takes
a failIdx out-parameter before the stream, 13.x does not. The legacy default stream is
refused by the runtime for batched copies: the copies run on the worker's own streams. A runtime
older than 12.8, or none loaded, means no batched copy (the worker then uses kernels).
Where a device is given, one small copy through the staging and back is checked at
start-up (the worker's construction, where synchronising is allowed), so a runtime that
misbehaves is never used.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger("kvtier_offload")

MIN_RUNTIME = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the source as the stream left it
ACCESS_ORDER_ANY = 3  # cudaMemcpySrcAccessOrderAny: the source does not change meanwhile
FLAG_PREFER_OVERLAP = 1  # cudaMemcpyFlagPreferOverlapWithCompute: a copy engine, not SMs
_CUDART = re.compile(r"/libcudart\.so\.(\d+)(?:[.\d]*)$")


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (CUDA 12.8 and 13)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation),
                ("dstLocHint", MemLocation), ("flags", ctypes.c_uint)]


def loaded_runtime(maps: str = "/proc/self/maps") -> str | None:
    """The path of the CUDA runtime library this process has mapped (PyTorch's), if any."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").rpartition(" ")[2]
                if _CUDART.search(path):
                    return path
    except OSError:
        return None
    return None


class RuntimeBatchCopy:
    """cudaMemcpyBatchAsync on the current CUDA stream, as a page_copy.BatchCopy."""

    def __init__(self, lib: Any, version: int, stream: Callable[[], int]) -> None:
        self._fn = lib.cudaMemcpyBatchAsync
        self._fail_index = version < 13000  # 12.8 - 12.x: a failIdx before the stream
        self._error: Any = getattr(lib, "cudaGetErrorString", None)
        if self._error is not None:
            with contextlib.suppress(AttributeError):  # a ctypes function: returns text
                self._error.restype = ctypes.c_char_p
        self._stream = stream
        self._attrs = {order: MemcpyAttributes(order, MemLocation(0, 0), MemLocation(0, 0),
                                               FLAG_PREFER_OVERLAP)
                       for order in (ACCESS_ORDER_STREAM, ACCESS_ORDER_ANY)}
        self._attr_index = ctypes.c_size_t(0)
        self.calls = 0

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor,
                 any_order: bool = False) -> None:
        count = int(sizes.shape[0])
        if count == 0:
            return
        attrs = self._attrs[ACCESS_ORDER_ANY if any_order else ACCESS_ORDER_STREAM]
        args: list[Any] = [ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()),
                           ctypes.c_void_p(sizes.data_ptr()), ctypes.c_size_t(count),
                           ctypes.byref(attrs), ctypes.byref(self._attr_index),
                           ctypes.c_size_t(1)]
        failed_at = ctypes.c_size_t(0)
        if self._fail_index:
            args.append(ctypes.byref(failed_at))
        stream = self._stream()
        if not stream:
            raise RuntimeError("cudaMemcpyBatchAsync needs a stream of its own: the runtime "
                               "refuses the legacy default stream")
        args.append(ctypes.c_void_p(stream))
        self.calls += 1
        status = self._fn(*args)
        if status != 0:
            raise RuntimeError(f"cudaMemcpyBatchAsync of {count} pages failed: "
                               f"{self._describe(status)}")

    def _describe(self, status: int) -> str:
        if self._error is None:
            return f"error {status}"
        text = self._error(ctypes.c_int(status))
        return f"error {status} ({text.decode(errors='replace') if text else '?'})"


def runtime_batch_copy(device: torch.device | None = None,
                       pinned: torch.Tensor | None = None) -> RuntimeBatchCopy | None:
    """The CUDA runtime's batched copy where PyTorch has loaded a runtime that has it (and,
    with a device, where a round trip through the first 128 bytes of `pinned`, the
    worker's staging, checks out); else None."""
    path = loaded_runtime()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < MIN_RUNTIME:
            return None
        lib.cudaMemcpyBatchAsync  # noqa: B018 (absent before 12.8)
    except (OSError, AttributeError):
        return None
    copy = RuntimeBatchCopy(lib, version.value, lambda: torch.cuda.current_stream().cuda_stream)
    if device is not None and (pinned is None or not _round_trips(copy, device, pinned)):
        log.warning("kvtier: the CUDA runtime's cudaMemcpyBatchAsync (%s, version %d) did "
                    "not copy a test page back intact; copying pages with kernels", path,
                    version.value)
        return None
    return copy


def _round_trips(copy: RuntimeBatchCopy, device: torch.device, pinned: torch.Tensor) -> bool:
    """64 bytes of pinned staging to the device and back, in two pages each way, once at
    start-up (nothing is pinned for it: the staging is all kvtier pins)."""
    if pinned.numel() * pinned.element_size() < 128:
        return False
    host = pinned.view(torch.uint8)[:128]
    there = torch.zeros(64, dtype=torch.uint8, device=device)
    host[:64] = torch.arange(1, 65, dtype=torch.uint8)
    host[64:] = 0
    sizes = torch.tensor([32, 32], dtype=torch.int64)

    def at(t: torch.Tensor, *offsets: int) -> torch.Tensor:
        return torch.tensor([t.data_ptr() + o for o in offsets], dtype=torch.int64)

    try:
        # On a stream of its own, as the worker's copies run (its store and load streams):
        # the runtime refuses the legacy default stream for batched copies.
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            copy(at(host, 0, 32), at(there, 32, 0), sizes, True)
            copy(at(there, 32, 0), at(host, 64, 96), sizes, False)
            stream.synchronize()
    except RuntimeError as err:
        log.warning("kvtier: cudaMemcpyBatchAsync failed its start-up check: %s", err)
        return False
    return bool(np.array_equal(host[64:].numpy(), host[:64].numpy()))
