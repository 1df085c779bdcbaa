"""The store priority on an idle CPU: BlockStore store and load throughput with its store
threads at the engine's priority (store_nice 0: one pool shared by loads and stores) and
lowered (store_nice 10, the default: stores and loads on threads of their own).

A lower priority only matters when the CPU is contended; this shows what the split pool
costs when it is not. Same blocks, same 16 threads (8 + 8), in alternating rounds (who
goes first swaps), on /dev/shm and on the disk; per-round ratios, nice 10 / nice 0.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile

from kvtier_offload import volume_probe as probe
from kvtier_offload.store import StoreConfig

TOTAL = int(os.environ.get("KVTIER_BENCH_STORE_BYTES", str(512 << 20)))
ROUNDS = int(os.environ.get("KVTIER_BENCH_ROUNDS", "3"))
THREADS = 16
SETTINGS = (0, StoreConfig.store_nice)
BLOCK_SIZES = (256 << 10, 2 << 20)


def one_run(base: str, arena: probe.Arena, blocks: int, nice: int) -> probe.KvtierRun:
    root = tempfile.mkdtemp(prefix="kvtier-nice-", dir=base)
    try:
        run = probe.kvtier(root, arena, blocks, THREADS, store_nice=nice)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if run.failures:
        raise RuntimeError(f"{run.failures} blocks failed under {base} (store_nice {nice})")
    return run


def main() -> None:
    disk = os.environ.get("KVTIER_BENCH_DIR") or tempfile.gettempdir()
    low, shared = SETTINGS[1], SETTINGS[0]
    print(f"store_nice {low} / store_nice {shared}, {TOTAL >> 20} MiB per run, {THREADS} "
          f"threads, {ROUNDS} rounds; median (rounds), then GB/s of each")
    for name, base in (("/dev/shm", "/dev/shm"), ("disk", disk)):
        for block in BLOCK_SIZES:
            blocks = max(1, TOTAL // block)
            arena = probe.Arena.make(block, blocks, pin=False)
            gbps: dict[int, dict[str, list[float]]] = {
                n: {"store": [], "load": []} for n in SETTINGS}
            ratios: dict[str, list[float]] = {"store": [], "load": []}
            for r in range(ROUNDS):
                runs = {n: one_run(base, arena, blocks, n)
                        for n in (SETTINGS if r % 2 == 0 else SETTINGS[::-1])}
                for n, run in runs.items():
                    gbps[n]["store"].append(run.store_gbps)
                    gbps[n]["load"].append(run.load_gbps)
                ratios["store"].append(runs[low].store_gbps / runs[shared].store_gbps)
                ratios["load"].append(runs[low].load_gbps / runs[shared].load_gbps)
            for way in ("store", "load"):
                print(f"{name} {block >> 10} KiB {way}: {statistics.median(ratios[way]):.2f}x "
                      f"({' '.join(f'{x:.2f}' for x in ratios[way])}); GB/s "
                      f"{statistics.median(gbps[shared][way]):.2f} -> "
                      f"{statistics.median(gbps[low][way]):.2f}", flush=True)


if __name__ == "__main__":
    main()
