"""A/B of the evictor against its version at another commit, on identical tmpfs trees.

`python -m benchmarks.evictor_ab [REF]` (REF: a git commit, default KVTIER_BENCH_AB_REF
or `main`) takes REF's evictor/kvtier_evictor out of git, builds one tree of
KVTIER_BENCH_FILES (default 500,000) empty block files in the kvtier layout on a tmpfs
(as `benchmarks evictor` does), and per round copies it once per side (`cp -a
--attributes-only`: same names and times, and no read that would bump the template's
atimes) and runs each side's evictor on its copy in a fresh interpreter, who goes first
alternating by round, so drift of a shared machine hits both alike. Each
run frees 30% of the inodes in LRU order. Per round it prints both sides' total, scan
(the `scan` call) and rest (everything after it: plan, re-stat, unlink, rmdir) seconds,
files deleted per second of the rest, and this/REF time ratios; then the medians.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.common import scratch_dir
from benchmarks.evictor import FREE_FRACTION, build
from benchmarks.store import median

REF = os.environ.get("KVTIER_BENCH_AB_REF", "main")
FILES = int(os.environ.get("KVTIER_BENCH_FILES", "500000"))
ROUNDS = int(os.environ.get("KVTIER_BENCH_ROUNDS", "3"))

# Run in a fresh interpreter with one side's evictor first on sys.path.
CHILD = """
import json, sys, time
from kvtier_evictor import evict
from kvtier_evictor.layouts import KVTIER
from kvtier_evictor.report import Usage

root, n, fraction = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
scan_s = 0.0
real_scan = evict.scan

def timed_scan(*args, **kwargs):
    global scan_s
    began = time.perf_counter()
    try:
        return real_scan(*args, **kwargs)
    finally:
        scan_s += time.perf_counter() - began

evict.scan = timed_scan

def usage():
    return Usage(used_bytes=0, capacity_bytes=1, used_inodes=n, capacity_inodes=n)

config = evict.Config(root=root, layout=KVTIER, high_watermark=99, low_watermark=98,
                      inode_high_watermark=90, inode_low_watermark=100 * (1 - fraction),
                      min_idle_seconds=600)
began = time.perf_counter()
report = evict.Run(config, usage_source=usage).execute()
total = time.perf_counter() - began
assert report.files_scanned == n, report
print(json.dumps({"total": total, "scan": scan_s, "deleted": report.files_deleted,
                  "dirs": report.dirs_removed}))
"""


def ref_sources(ref: str, into: str) -> str:
    """REF's evictor/ (the directory to put on sys.path) under `into`."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                         text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", top, "archive", ref, "evictor/kvtier_evictor"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "evictor")


def run_side(source: str, root: str, n: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=source)
    out = subprocess.run([sys.executable, "-c", CHILD, root, str(n), str(FREE_FRACTION)],
                         env=env, capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    got["rest"] = got["total"] - got["scan"]
    return got


def main() -> None:
    ref = sys.argv[1] if len(sys.argv) > 1 else REF
    short = subprocess.run(["git", "rev-parse", "--short", ref], capture_output=True,
                           text=True, check=True).stdout.strip()
    this = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "evictor")
    n = FILES
    with tempfile.TemporaryDirectory(prefix="kvtier-evictor-ab-src-") as src, \
            scratch_dir("16g", "kvtier-evictor-ab-", inodes="8m") as (scratch, where):
        sides = {"this": this, "REF": ref_sources(ref, src)}
        template = os.path.join(scratch, "template")
        began = time.perf_counter()
        build(template, n, time.time())
        print(f"this tree against REF {ref} ({short}); {n:,} files on {where}, built in "
              f"{time.perf_counter() - began:.1f}s; {ROUNDS} alternating rounds, "
              f"{FREE_FRACTION:.0%} of the inodes freed per run")
        print("| round | side | total s | scan s | rest s | deleted | dirs removed "
              "| deleted/s (rest) |")
        print("|---|---|---|---|---|---|---|---|")
        got: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for r in range(ROUNDS):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                tree = os.path.join(scratch, name)
                subprocess.run(["cp", "-a", "--attributes-only", template, tree], check=True)
                result = run_side(sides[name], tree, n)
                shutil.rmtree(tree)
                got[name].append(result)
                print(f"| {r + 1} | {name} | {result['total']:.2f} | {result['scan']:.2f} "
                      f"| {result['rest']:.2f} | {result['deleted']:,} | {result['dirs']:,} "
                      f"| {result['deleted'] / result['rest']:,.0f} |", flush=True)
        print("\n| measure | this (median) | REF (median) | this/REF time by round "
              "| median |")
        print("|---|---|---|---|---|")
        for key in ("total", "scan", "rest"):
            ratios = [a[key] / b[key] for a, b in zip(got["this"], got["REF"], strict=True)]
            print(f"| {key} s | {median([g[key] for g in got['this']]):.2f} "
                  f"| {median([g[key] for g in got['REF']]):.2f} "
                  f"| {' '.join(f'{x:.2f}' for x in ratios)} | {median(ratios):.2f}x |")
        rates = {name: median([g["deleted"] / g["rest"] for g in got[name]])
                 for name in sides}
        print(f"| deleted/s in the rest | {rates['this']:,.0f} | {rates['REF']:,.0f} | | "
              f"{rates['this'] / rates['REF']:.2f}x |")


if __name__ == "__main__":
    main()
