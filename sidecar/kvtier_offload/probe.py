"""Measure a volume: store and load GB/s with the block store, and whether loading a
cached prefix beats recomputing it."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import numpy as np

from kvtier_offload.store import BlockStore, StoreConfig


@dataclass
class ProbeResult:
    path: str
    o_direct: bool
    block_bytes: int
    blocks: int
    threads: int
    store_gbps: float
    load_gbps: float
    failures: int

    def breakeven_tokens_per_second(self, kv_bytes_per_token: int) -> float:
        """Prefill rate above which recomputing is faster than loading."""
        return self.load_gbps * 1e9 / kv_bytes_per_token


def probe(path: str, block_bytes: int = 16 << 20, total_bytes: int = 1 << 30,
          threads: int = 16) -> ProbeResult:
    blocks = max(total_bytes // block_bytes, 1)
    workdir = os.path.join(path, f".kvtier-probe-{os.getpid()}")
    os.makedirs(workdir, exist_ok=True)
    # Page-aligned rows, as vLLM's CPU tier hands them over.
    arena = np.frombuffer(bytearray(os.urandom(block_bytes)) * 1, dtype=np.uint8)
    rows = [arena.data for _ in range(blocks)]
    keys = [os.urandom(36) for _ in range(blocks)]
    store = BlockStore(StoreConfig(root=workdir, fingerprint="f" * 16, read_threads=threads,
                                   write_threads=threads, write_queue_seconds=3600))
    try:
        start = time.perf_counter()
        store.store(1, list(zip(keys, rows, strict=True)))
        store.drain(timeout=None)
        store_s = time.perf_counter() - start
        stored = store.finished()[0]
        dests = [memoryview(bytearray(block_bytes)) for _ in range(min(blocks, threads * 2))]
        start = time.perf_counter()
        store.load(2, [(k, dests[i % len(dests)]) for i, k in enumerate(keys)])
        store.drain(timeout=None)
        load_s = time.perf_counter() - start
        loaded = store.finished()[0]
        failures = stored.ok.count(False) + loaded.ok.count(False)
        return ProbeResult(path, store.o_direct, block_bytes, blocks, threads,
                           blocks * block_bytes / store_s / 1e9,
                           blocks * block_bytes / load_s / 1e9, failures)
    finally:
        store.close(timeout=None)
        shutil.rmtree(workdir, ignore_errors=True)
