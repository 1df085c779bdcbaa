"""Measure a volume as vLLM will use it: store and load GB/s of the block store driven
the way kvtier's vLLM tier drives it, and (where vLLM is installed, on request) vLLM's
own fs tier I/O on the same volume in the same run, so the two can be compared.

What "the way vLLM drives it" means here:
- buffers: rows of one page-aligned 2-D uint8 array, as vLLM's CPU tier hands them over
  (pinned host memory where CUDA is available, page-aligned anonymous memory otherwise);
- jobs: the blocks split into one job per I/O thread's share, all submitted at once
  through store_rows/load_rows (the tier's calls), not one job for everything;
- the I/O path reported (O_DIRECT or not, the C batch path or Python) is what the store
  used for these buffers, not what the volume would take;
- vLLM's tier (`--vllm`): its `batch_store_block`/`batch_load_block` on the same rows,
  one call per thread's share on as many threads, alternating with kvtier round by round.

The benchmarks (`python -m benchmarks store`) measure through these same functions.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier_offload.buffers import RowArray
from kvtier_offload.store import BlockStore, StoreConfig

ARENA_BYTES = 512 << 20  # rows at most this much together (blocks reuse rows)
ARENA_ROWS = 64


@dataclass
class Arena:
    """Rows of KV bytes as vLLM's CPU tier holds them: one 2-D uint8 array."""

    rows: np.ndarray
    pinned: bool
    _keep: Any = None  # what owns the memory (an mmap or a pinned tensor)

    @classmethod
    def make(cls, block_bytes: int, blocks: int, pin: bool | None = None) -> Arena:
        """min(blocks, ARENA_ROWS, ARENA_BYTES / block) rows of random bytes; pinned
        where pin is True, or None and CUDA is available."""
        count = max(1, min(blocks, ARENA_ROWS, ARENA_BYTES // max(block_bytes, 1)))
        if pin is None:
            pin = cuda_available()
        if pin:
            import torch

            tensor = torch.empty((count, block_bytes), dtype=torch.uint8, pin_memory=True)
            rows = tensor.numpy()
            keep: Any = tensor
        else:
            keep = mmap.mmap(-1, count * block_bytes)  # page-aligned
            rows = np.frombuffer(keep, dtype=np.uint8).reshape(count, block_bytes)
        rows[:] = np.frombuffer(os.urandom(block_bytes), dtype=np.uint8)
        rows[:, :8] = np.arange(count, dtype=np.uint64).view(np.uint8).reshape(count, 8)
        return cls(rows, bool(pin), keep)

    def row_ids(self, blocks: int) -> np.ndarray:
        return np.arange(blocks, dtype=np.int64) % self.rows.shape[0]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def shares(count: int, threads: int) -> list[range]:
    """One contiguous share of the blocks per thread (the tier's jobs)."""
    per = -(-count // max(threads, 1))
    return [range(i, min(i + per, count)) for i in range(0, count, per)]


def block_keys(count: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() + bytes(4) for i in range(count)]


@dataclass
class Run:
    """One system's store and load of the same blocks."""

    store_gbps: float
    load_gbps: float
    failures: int = 0


@dataclass
class KvtierRun(Run):
    o_direct: bool = False
    batch_path: bool = False


def kvtier(root: str, arena: Arena, blocks: int, threads: int,
           between: Callable[[], None] = lambda: None, store_nice: int = 0) -> KvtierRun:
    """Store then load `blocks` blocks from/into arena's rows under root, one job per
    thread's share; between: called after the stores (the benchmark drops caches).
    store_nice 0 by default: every thread takes either kind at the caller's priority, as
    vLLM's fs tier's threads do, so the two compare like for like (what a store priority
    costs on an idle CPU: benchmarks/store_nice.py)."""
    half = max(threads // 2, 1)
    store = BlockStore(StoreConfig(root=root, fingerprint="0123456789abcdef",
                                   read_threads=half, write_threads=max(threads - half, 0),
                                   write_queue_seconds=3600, store_nice=store_nice))
    rows, block = arena.rows, arena.rows.shape[1]
    keys, ids = block_keys(blocks, "kvtier"), arena.row_ids(blocks)
    jobs = shares(blocks, threads)
    try:
        def run(submit: Callable[..., None], first_job: int) -> tuple[float, int]:
            start = time.perf_counter()
            for n, share in enumerate(jobs):
                submit(first_job + n, keys[share.start:share.stop], rows,
                       ids[share.start:share.stop])
            store.drain(timeout=None)
            seconds = time.perf_counter() - start
            return seconds, sum(r.ok.count(False) for r in store.finished())

        store_s, store_failed = run(store.store_rows, 0)
        between()
        load_s, load_failed = run(store.load_rows, len(jobs))
        # The C batch path took these rows only where the store has it and they pass its
        # alignment check for the O_DIRECT setting it runs with (else: Python path).
        batched, _ = RowArray(rows, ids).batchable(range(blocks), store.o_direct)
        return KvtierRun(blocks * block / store_s / 1e9, blocks * block / load_s / 1e9,
                         store_failed + load_failed, store.o_direct,
                         store.batch_io and len(batched) == blocks)
    finally:
        store.close(timeout=None)


def vllm_available() -> bool:
    try:
        from vllm.v1.kv_offload.tiering.fs import io  # noqa: F401
    except ImportError:
        return False
    return True


def vllm_paths(root: str, keys: list[bytes]) -> list[str]:
    """Where vLLM 0.32's fs tier files these keys (rank, then two hash levels)."""
    out = []
    for key in keys:
        h = key[:32].hex()
        out.append(os.path.join(root, "vllm_r0", h[:3], f"{h[3:5]}_g0", f"{h}.bin"))
    return out


@dataclass
class VllmRun(Run):
    o_direct: bool = False


def vllm(root: str, arena: Arena, blocks: int, threads: int,
         between: Callable[[], None] = lambda: None) -> VllmRun:
    """vLLM's fs tier I/O on the same rows: one batch call per thread's share, each on
    its own thread (the tier runs one call per job on its pool). Raises on any failure
    (vLLM's calls do)."""
    from vllm.v1.kv_offload.tiering.fs import io

    os.makedirs(root, exist_ok=True)  # before the probe: it writes a file there
    direct = io.probe_o_direct(root)
    block = arena.rows.shape[1]
    view = arena.rows.reshape(-1).data
    paths = vllm_paths(root, block_keys(blocks, "vllm"))
    offsets = (arena.row_ids(blocks) * block).tolist()
    jobs = shares(blocks, threads)

    def run(move: Callable[..., None]) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda s: move(paths[s.start:s.stop], view,
                                         offsets[s.start:s.stop], block, direct), jobs))
        return time.perf_counter() - start

    store_s = run(io.batch_store_block)
    between()
    load_s = run(io.batch_load_block)
    return VllmRun(blocks * block / store_s / 1e9, blocks * block / load_s / 1e9, 0, direct)


@dataclass
class ProbeResult:
    path: str
    o_direct: bool  # what the store used for these buffers
    batch_path: bool  # the C extension (True) or the Python path
    pinned: bool
    block_bytes: int
    blocks: int
    threads: int
    jobs: int
    store_gbps: float  # medians over the rounds
    load_gbps: float
    failures: int
    vllm: list[VllmRun] = field(default_factory=list)  # per round, with --vllm
    kvtier_rounds: list[KvtierRun] = field(default_factory=list)

    def breakeven_tokens_per_second(self, kv_bytes_per_token: int) -> float:
        """Prefill rate above which recomputing is faster than loading."""
        return self.load_gbps * 1e9 / kv_bytes_per_token

    def ratios(self) -> list[tuple[float, float]]:
        """kvtier/vLLM (store, load) of each round: the two ran back to back."""
        return [(k.store_gbps / v.store_gbps, k.load_gbps / v.load_gbps)
                for k, v in zip(self.kvtier_rounds, self.vllm, strict=True)]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def probe(path: str, block_bytes: int = 16 << 20, total_bytes: int = 1 << 30,
          threads: int = 16, compare_vllm: bool = False, rounds: int = 1,
          pin: bool | None = None,
          between: Callable[[], None] = lambda: None) -> ProbeResult:
    """Measure path (see the module docstring); compare_vllm: vLLM's tier too, alternating
    with kvtier (each first in every other round). Leaves nothing behind."""
    if compare_vllm and not vllm_available():
        raise RuntimeError("--vllm needs vLLM (0.32's fs tier) installed here")
    if block_bytes <= 0 or block_bytes % 4096:
        raise ValueError(f"block_bytes must be a positive multiple of 4096, not {block_bytes}")
    blocks = max(total_bytes // block_bytes, 1)
    workdir = os.path.join(path, f".kvtier-probe-{os.getpid()}")
    os.makedirs(workdir, exist_ok=True)
    arena = Arena.make(block_bytes, blocks, pin)
    kv_runs: list[KvtierRun] = []
    v_runs: list[VllmRun] = []
    try:
        for round_ in range(max(rounds, 1)):
            order = ["kvtier", "vllm"] if round_ % 2 == 0 else ["vllm", "kvtier"]
            for name in order:
                root = os.path.join(workdir, f"{name}-{round_}")
                if name == "kvtier":
                    kv_runs.append(kvtier(root, arena, blocks, threads, between))
                elif compare_vllm:
                    v_runs.append(vllm(root, arena, blocks, threads, between))
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return ProbeResult(path, kv_runs[0].o_direct, kv_runs[0].batch_path, arena.pinned,
                       block_bytes, blocks, threads, len(shares(blocks, threads)),
                       median([r.store_gbps for r in kv_runs]),
                       median([r.load_gbps for r in kv_runs]),
                       sum(r.failures for r in kv_runs), v_runs, kv_runs)
