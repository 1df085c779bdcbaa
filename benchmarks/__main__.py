"""Run every benchmark (or those named: python -m benchmarks evictor ...)."""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time

BENCHES = ["store", "floor", "tier", "busy_hit", "evictor", "evictor_llmd", "netfs_ops",
           "store_nice", "operator", "webhook", "observe", "gpu"]


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.machine()}, {cpus} cores, Python {platform.python_version()}"


def main(argv: list[str]) -> int:
    names = argv or BENCHES
    print(f"# kvtier benchmarks on {machine()}, {time.strftime('%Y-%m-%d')}")
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"\n## {name}\n\nload average before: {load()}", flush=True)
        began = time.perf_counter()
        module.main()
        print(f"\nload average after: {load()}; {name} took "
              f"{time.perf_counter() - began:.0f} s", flush=True)
    return 0


def load() -> str:
    """The 1, 5 and 15 minute load averages: the I/O benchmarks' figures mean little
    without them on a shared machine."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
