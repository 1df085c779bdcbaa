"""Where kvtier's time goes on a memory-speed volume, against vLLM 0.32's fs tier I/O.

On a device both systems wait on the same hardware; in RAM (tmpfs) the work is CPU and
every extra step shows. This moves the same blocks four ways, each adding one thing to the
one before, interleaved in one process (the VM's speed drifts between minutes):

1. vLLM's C reader/writer (`fs_io_C` via `tiering.fs.io`) on its own files: the anchor;
2. the same C code moving kvtier's files as raw bytes (header page + payload, kvtier's
   directory layout), checking nothing: what kvtier's file format costs;
3. kvtier's file layer (`batchio`): + building and checking the header, hashing every
   byte (the digest), statx for last use: what verification costs;
4. kvtier's `BlockStore` with one job: + jobs, tasks, lookup cache, metrics.

Every variant runs on as many threads as the machine has cores (what the store itself
picks on a memory-speed volume; vLLM's reader gains nothing from more here, see the store
benchmark), each thread with one batch. Step 3 is kvtier's verified I/O with nothing
around it: the store (step 4) cannot beat it, and no faster checking means no faster step 3.
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.store import ARENA_ROWS, BLOCK_SIZES, ROUNDS, keys, median, vllm_paths
from kvtier_offload import batchio
from kvtier_offload.fileformat import HEADER_SIZE, header_prefix
from kvtier_offload.layout import Layout
from kvtier_offload.store import PIECE, BlockStore, StoreConfig, probe_o_direct

TOTAL = int(os.environ.get("KVTIER_BENCH_FLOOR_BYTES", str(512 << 20)))
THREADS = len(os.sched_getaffinity(0))
FINGERPRINT = "0123456789abcdef"
STEPS = ("vLLM C, its files", "vLLM C, kvtier's files", "kvtier file layer", "kvtier store")


class Blocks:
    """One block size's files, buffers and keys under root, for both systems."""

    def __init__(self, root: str, block: int) -> None:
        self.block, self.n = block, max(TOTAL // block, 1)
        self.direct = probe_o_direct(root)
        self.vllm_paths = vllm_paths(os.path.join(root, "vllm"), keys(self.n, "vllm"))
        self.keys = keys(self.n, "kvtier")
        # One store for every round, as in a vLLM process; its lookup cache forgets at once,
        # so a round's stores are not skipped as already there (the files were removed).
        self.config = StoreConfig(root=os.path.join(root, "kvtier"), fingerprint=FINGERPRINT,
                                  write_queue_seconds=3600, lookup_hit_ttl=0)
        self.layout = Layout(self.config.root, FINGERPRINT)
        self.layout_paths = [self.layout.path(k) for k in self.keys]
        self.rows = mmap.mmap(-1, ARENA_ROWS * block)
        self.rows[:] = os.urandom(ARENA_ROWS * block)
        self.files = mmap.mmap(-1, ARENA_ROWS * (HEADER_SIZE + block))  # whole kvtier files
        self.files[:] = os.urandom(len(self.files))
        base = batchio.address(memoryview(self.rows))
        self.addresses = np.array([base + (i % ARENA_ROWS) * block for i in range(self.n)],
                                  dtype=np.int64)
        self.sizes = np.full(self.n, block, dtype=np.int64)
        self.batches = [list(range(t, self.n, THREADS)) for t in range(THREADS)]
        self.headers = [mmap.mmap(-1, HEADER_SIZE * len(b)) for b in self.batches]
        for headers in self.headers:
            headers[:] = bytes(len(headers))  # touched now, not in the first timed run
        for path in self.vllm_paths + self.layout_paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self._job = 0
        self.store = BlockStore(self.config)

    def clear(self, paths: list[str]) -> None:
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def threads(self, work: Callable[[list[int], int], None]) -> None:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(work, self.batches, range(THREADS)))

    def vllm_c(self, store: bool, kvtier_files: bool) -> None:
        paths = self.layout_paths if kvtier_files else self.vllm_paths
        size = HEADER_SIZE + self.block if kvtier_files else self.block
        view = memoryview(self.files if kvtier_files else self.rows)
        move = vllm_io().batch_store_block if store else vllm_io().batch_load_block
        self.threads(lambda batch, _: move([paths[i] for i in batch], view,
                                           [(i % ARENA_ROWS) * size for i in batch], size,
                                           self.direct))

    def file_layer(self, store: bool) -> None:
        base, prefix = os.fsencode(self.layout.base), header_prefix(FINGERPRINT)

        def work(batch: list[int], t: int) -> None:
            ks = [self.keys[i] for i in batch]
            headers = memoryview(self.headers[t])
            if store:
                status = batchio.write_blocks(base, prefix, ks, secrets.token_hex(8).encode(),
                                              self.addresses[batch], self.sizes[batch],
                                              headers, self.direct, False, PIECE)
            else:
                status, _ = batchio.read_blocks(base, prefix, ks, self.addresses[batch],
                                                self.sizes[batch], headers, self.direct,
                                                PIECE)
            assert not status.any(), "the file layer did not move every block"

        self.threads(work)

    def store_job(self, stores: bool) -> None:
        store = self.store
        self._job += 1
        view = memoryview(self.rows)
        items = [(k, view[(i % ARENA_ROWS) * self.block:][:self.block])
                 for i, k in enumerate(self.keys)]
        (store.store if stores else store.load)(self._job, items)
        store.drain()
        assert all(r.success for r in store.finished()), "the store did not move every block"


def vllm_io() -> Any:
    from vllm.v1.kv_offload.tiering.fs import io

    return io


def one_round(blocks: Blocks, first: int) -> dict[tuple[str, str], float]:
    """GB/s of every step, stores then loads (the loads read the last stores' files),
    the loads starting with step `first`."""
    out: dict[tuple[str, str], float] = {}

    def timed(direction: str, step: str, run: Callable[[], None]) -> None:
        start = time.perf_counter()
        run()
        out[direction, step] = blocks.n * blocks.block / (time.perf_counter() - start) / 1e9

    blocks.clear(blocks.vllm_paths)
    timed("store", STEPS[0], lambda: blocks.vllm_c(True, False))
    for step, run in ((STEPS[1], lambda: blocks.vllm_c(True, True)),
                      (STEPS[2], lambda: blocks.file_layer(True))):
        blocks.clear(blocks.layout_paths)
        timed("store", step, run)
    blocks.clear(blocks.layout_paths)
    timed("store", STEPS[3], lambda: blocks.store_job(True))
    # Untimed: the first read of a freshly written tmpfs page costs more than later
    # ones (probably the kernel's LRU bookkeeping), and vLLM's files are read once per
    # round, kvtier's three times: every timed load reads files read before.
    blocks.vllm_c(False, False)
    blocks.vllm_c(False, True)
    loads = [lambda: blocks.vllm_c(False, False), lambda: blocks.vllm_c(False, True),
             lambda: blocks.file_layer(False), lambda: blocks.store_job(False)]
    for step in STEPS[first:] + STEPS[:first]:  # each goes first in turn
        timed("load", step, loads[STEPS.index(step)])
    return out


def main() -> None:
    if not os.path.isdir("/dev/shm"):
        print("no /dev/shm here: this benchmark needs a memory-speed volume")
        return
    vllm_io()  # imported now, not inside the first timed run
    print(f"\n### RAM (/dev/shm), {TOTAL >> 20} MiB per run, {THREADS} threads, "
          f"median of {ROUNDS} interleaved rounds; GB/s (median of the rounds' ratios to step 1)\n")
    print("| block | direction | " + " | ".join(STEPS) + " |")
    print("|---|---|" + "---|" * len(STEPS))
    for block in BLOCK_SIZES:
        root = tempfile.mkdtemp(prefix="kvtier-bench-floor-", dir="/dev/shm")
        try:
            blocks = Blocks(root, block)
            try:
                rounds = [one_round(blocks, r % len(STEPS)) for r in range(ROUNDS)]
            finally:
                blocks.store.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for direction in ("store", "load"):
            # Ratios within a round (the steps ran back to back), then their median.
            cells = " | ".join(
                f"{median([r[direction, step] for r in rounds]):.2f} "
                f"({median([r[direction, step] / r[direction, STEPS[0]] for r in rounds]):.2f}x)"
                for step in STEPS)
            print(f"| {block >> 10} KiB | {direction} | {cells} |")
