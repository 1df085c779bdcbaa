"""A/B of the offload backend against its version at another commit, in one process.

`python -m benchmarks.ab [REF]` (REF: a git commit, default KVTIER_BENCH_AB_REF or
`main`) loads REF's offload/kvtier_offload under another name (kvtier_offload_ab) next to
this tree's, and moves the same blocks with both, taking turns (who goes first alternates
by round), so drift of a shared machine hits both alike. Per block size it reports the
median GB/s of each and the median and range of the per-round ratios (this / REF) for:

- the file layer (`batchio.write_blocks` / `read_blocks`, one batch per thread) on
  /dev/shm, what `benchmarks floor` calls step 3;
- `BlockStore` store and load jobs on the disk (page cache dropped before loads where
  permitted) and on /dev/shm, what `benchmarks store` and floor's step 4 measure.

Before those, the payload digest alone (`digest.digest` of each, in-cache and 16 MiB
buffers, thread CPU time, alternating). KVTIER_BENCH_AB_CLOCK=cpu times every round in
process CPU seconds (user+sys of all threads) instead of wall seconds: on a machine
shared with other work, time spent waiting for a core then counts for neither side.

REF's package must run from its Python sources (numba, as at the merge-base of issue 22,
does); a REF that needs a C build of its own is not supported.
"""

from __future__ import annotations

import importlib
import mmap
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import numpy as np

from benchmarks.store import drop_caches, median

REF = os.environ.get("KVTIER_BENCH_AB_REF", "main")
TOTAL = int(os.environ.get("KVTIER_BENCH_AB_BYTES", str(256 << 20)))
ROUNDS = int(os.environ.get("KVTIER_BENCH_ROUNDS", "5"))
BLOCK_SIZES = (256 << 10, 2 << 20, 16 << 20)
THREADS = len(os.sched_getaffinity(0))
FP = "0123456789abcdef"
ALIAS = "kvtier_offload_ab"
CLOCK = time.process_time if os.environ.get("KVTIER_BENCH_AB_CLOCK") == "cpu" else (
    time.perf_counter)
DIGEST_SIZES = (128 << 10, 512 << 10, 16 << 20)


def load_ref(ref: str, into: str) -> ModuleType:
    """REF's kvtier_offload as the package kvtier_offload_ab."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                         text=True, check=True).stdout.strip()
    # The backend's folder: offload/ (sidecar/ before the rename)
    folder = next(f for f in ("offload", "sidecar") if subprocess.run(
        ["git", "-C", top, "cat-file", "-e", f"{ref}:{f}/kvtier_offload"],
        capture_output=True).returncode == 0)
    archive = subprocess.run(["git", "-C", top, "archive", ref, f"{folder}/kvtier_offload"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    src = os.path.join(into, folder, "kvtier_offload")
    if subprocess.run(["git", "-C", top, "cat-file", "-e", f"{ref}:{folder}/csrc"],
                      capture_output=True).returncode == 0:
        raise SystemExit(f"{ref} has a C extension of its own: not supported here")
    dest = os.path.join(into, ALIAS)
    os.rename(src, dest)
    for name in os.listdir(dest):
        if name.endswith(".py"):
            path = os.path.join(dest, name)
            with open(path) as f:
                text = f.read().replace("kvtier_offload", ALIAS)
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, into)
    return importlib.import_module(ALIAS)


class Side:
    """One backend (this tree's or REF's) moving n blocks of one size under root."""

    def __init__(self, package: str, root: str, block: int, rows: mmap.mmap) -> None:
        self.batchio = importlib.import_module(f"{package}.batchio")
        store_mod = importlib.import_module(f"{package}.store")
        metrics = importlib.import_module(f"{package}.metrics")
        fileformat = importlib.import_module(f"{package}.fileformat")
        layout = importlib.import_module(f"{package}.layout")
        self.block, self.n = block, max(TOTAL // block, 1)
        self.root = root
        rng = np.random.default_rng(block)
        self.keys = [rng.bytes(32) for _ in range(self.n)]
        self.layout = layout.Layout(root, FP)
        for key in self.keys:
            self.layout.ensure_dir(os.path.dirname(self.layout.path(key)))
        self.prefix = fileformat.header_prefix(FP)
        self.direct = store_mod.probe_o_direct(root)
        self.piece = store_mod.PIECE if store_mod.probe_memory_speed(root, self.direct) else 0
        rows_n = len(rows) // block
        base = self.batchio.address(memoryview(rows))
        self.addresses = np.array([base + (i % rows_n) * block for i in range(self.n)],
                                  dtype=np.int64)
        self.sizes = np.full(self.n, block, dtype=np.int64)
        self.views = [memoryview(rows)[(i % rows_n) * block:][:block] for i in range(self.n)]
        self.batches = [list(range(t, self.n, THREADS)) for t in range(THREADS)]
        self.headers = [mmap.mmap(-1, 4096 * max(len(b), 1)) for b in self.batches]
        self.store = store_mod.BlockStore(
            store_mod.StoreConfig(root=root, fingerprint=FP, write_queue_seconds=3600,
                                  lookup_hit_ttl=0, lookup_miss_ttl=0),
            metrics.Metrics(metrics.Recorder()))
        self.job = 0

    def clear(self) -> None:
        for key in self.keys:
            try:
                os.unlink(self.layout.path(key))
            except FileNotFoundError:
                pass

    def file_layer(self, store: bool) -> None:
        base = os.fsencode(self.layout.base)

        def work(batch: list[int], t: int) -> None:
            ks = [self.keys[i] for i in batch]
            headers = memoryview(self.headers[t])
            if store:
                status = self.batchio.write_blocks(
                    base, self.prefix, ks, secrets.token_hex(8).encode(),
                    self.addresses[batch], self.sizes[batch], headers, self.direct, False,
                    self.piece)
            else:
                status, _ = self.batchio.read_blocks(
                    base, self.prefix, ks, self.addresses[batch], self.sizes[batch], headers,
                    self.direct, self.piece)
            assert not np.asarray(status).any(), "a block did not move"

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(work, self.batches, range(THREADS)))

    def store_job(self, store: bool) -> None:
        self.job += 1
        items = list(zip(self.keys, self.views, strict=True))
        (self.store.store if store else self.store.load)(self.job, items)
        self.store.drain(None)
        assert all(o.success for o in self.store.finished()), "a job failed"


def timed(fn: Callable[[], None], nbytes: int) -> float:
    began = CLOCK()
    fn()
    return nbytes / (CLOCK() - began) / 1e9


def compare_digests(rounds: int = 30) -> None:
    """Each side's digest.digest over one buffer, taking turns: GB/s per core."""
    fns = {name: importlib.import_module(f"{name}.digest").digest
           for name in ("kvtier_offload", ALIAS)}
    print(f"\n### payload digest alone (digest.digest), thread CPU time, {rounds} "
          "alternating rounds")
    print("| buffer | this GB/s (median) | REF GB/s (median) | ratio (median) |")
    print("|---|---|---|---|")
    for size in DIGEST_SIZES:
        buf = np.frombuffer(os.urandom(size), np.uint8).copy()
        for fn in fns.values():
            fn(buf)  # warm
        got: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                n = max(1, (32 << 20) // size)
                began = time.thread_time()
                for _ in range(n):
                    fns[name](buf)
                got[name].append(size * n / (time.thread_time() - began) / 1e9)
        this, ref = got["kvtier_offload"], got[ALIAS]
        ratios = [a / b for a, b in zip(this, ref, strict=True)]
        print(f"| {size >> 10} KiB | {median(this):.1f} | {median(ref):.1f} | "
              f"{median(ratios):.2f}x |")


def one_round(side: Side, layer: bool, disk: bool) -> tuple[float, float]:
    """(store GB/s, load GB/s) of one side."""
    nbytes = side.n * side.block
    side.clear()
    store = timed(lambda: side.file_layer(True) if layer else side.store_job(True), nbytes)
    if disk:
        drop_caches()
    load = timed(lambda: side.file_layer(False) if layer else side.store_job(False), nbytes)
    return store, load


def compare(label: str, base: str, layer: bool, disk: bool) -> None:
    print(f"\n### {'file layer' if layer else 'BlockStore'}, {label} ({base}), "
          f"{TOTAL >> 20} MiB per run, {THREADS} threads, {ROUNDS} alternating rounds")
    print("| block | direction | this GB/s | REF GB/s | ratio (median) | ratio by round |")
    print("|---|---|---|---|---|---|")
    for block in BLOCK_SIZES:
        rows = mmap.mmap(-1, min(64, max(TOTAL // block, 1)) * block)
        rows[:] = os.urandom(len(rows))
        sides = {name: Side(name, tempfile.mkdtemp(prefix=f"{name}-", dir=base), block, rows)
                 for name in ("kvtier_offload", ALIAS)}
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        try:
            for r in range(ROUNDS):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for name in order:
                    got[name].append(one_round(sides[name], layer, disk))
        finally:
            for side in sides.values():
                side.store.close(None)
                shutil.rmtree(side.root, ignore_errors=True)
        for d, direction in enumerate(("store", "load")):
            this = [g[d] for g in got["kvtier_offload"]]
            ref = [g[d] for g in got[ALIAS]]
            ratios = [a / b for a, b in zip(this, ref, strict=True)]
            print(f"| {block >> 10} KiB | {direction} | {median(this):.2f} | {median(ref):.2f}"
                  f" | {median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f} |")


def main() -> None:
    ref = sys.argv[1] if len(sys.argv) > 1 else REF
    with tempfile.TemporaryDirectory(prefix="kvtier-ab-src-") as src:
        load_ref(ref, src)
        short = subprocess.run(["git", "rev-parse", "--short", ref], text=True,
                               capture_output=True).stdout.strip()
        print(f"this tree against REF {ref} ({short})")
        compare_digests()
        if os.path.isdir("/dev/shm"):
            shm = tempfile.mkdtemp(prefix="kvtier-ab-", dir="/dev/shm")
            try:
                compare("RAM", shm, layer=True, disk=False)
                compare("RAM", shm, layer=False, disk=False)
            finally:
                shutil.rmtree(shm, ignore_errors=True)
        disk = os.environ.get("KVTIER_BENCH_DIR") or tempfile.mkdtemp(prefix="kvtier-ab-")
        try:
            compare("disk", disk, layer=False, disk=True)
        finally:
            if not os.environ.get("KVTIER_BENCH_DIR"):
                shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
