"""Run every benchmark (or those named: python -m benchmarks evictor ...)."""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time

BENCHES = ["store", "floor", "tier", "busy_hit", "evictor", "evictor_llmd", "netfs_ops",
           "operator", "webhook", "observe", "gpu"]


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{platform.machine()}, {cpus} cores, Python {platform.python_version()}"


def main(argv: list[str]) -> int:
    names = argv or BENCHES
    print(f"# kvtier benchmarks on {machine()}, {time.strftime('%Y-%m-%d')}")
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"\n## {name}")
        module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
