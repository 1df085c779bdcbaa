"""Evictor scan+delete rate on a large synthetic tree vs `find … -delete` on the same tree.

Both trees hold the same N one-block files in the kvtier layout with spread-out access
times. The evictor must free 30% of them in LRU order (scan all, select, re-stat,
delete); the baselines are GNU find deleting every file (no LRU, no re-check: a floor on
the metadata cost of touching each file once) and an LRU shell pipeline (find -printf |
sort | head | xargs rm).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time

from benchmarks.common import scratch_dir
from kvtier_evictor.evict import Config, Run
from kvtier_evictor.layouts import KVTIER
from kvtier_evictor.report import Usage

FILES = int(os.environ.get("KVTIER_BENCH_FILES", "1000000"))
# Creating files on GlusterFS costs round trips: a smaller tree there by default.
GLUSTER_FILES = int(os.environ.get("KVTIER_BENCH_GLUSTER_FILES", "20000"))
FREE_FRACTION = 0.30


def build(root: str, n: int, now: float, part: range | None = None) -> None:
    base = os.path.join(root, "kvtier", "v1", "0123456789abcdef")
    made: set[str] = set()
    for i in part or range(n):
        k = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()
        d = os.path.join(base, k[:2], k[2:4])
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        path = os.path.join(d, f"{k}.kvb")
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
        t = now - 3600 - (i * 7919 % n)  # access times spread over n seconds
        os.utime(path, (t, t))


def time_cmd(cmd: str) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    n = FILES
    now = time.time()
    with scratch_dir("8g", "kvtier-bench-evictor-", inodes="8m") as (root, where):
        print(f"{n:,} files on {where}")
        t = time.perf_counter()
        build(os.path.join(root, "a"), n, now)
        build(os.path.join(root, "b"), n, now)
        build(os.path.join(root, "c"), n, now)
        print(f"built 3 trees in {time.perf_counter() - t:.1f}s")

        # Usage counted in files (inodes): the evictor must delete 30% of them.
        def usage() -> Usage:
            return Usage(used_bytes=0, capacity_bytes=1, used_inodes=n, capacity_inodes=n)

        config = Config(root=os.path.join(root, "a"), layout=KVTIER, high_watermark=99,
                        low_watermark=98, inode_high_watermark=90,
                        inode_low_watermark=100 * (1 - FREE_FRACTION), min_idle_seconds=600)
        start = time.perf_counter()
        report = Run(config, usage_source=usage).execute()
        evictor_s = time.perf_counter() - start
        assert report.files_scanned == n, report
        deleted = report.files_deleted

        find_s = time_cmd(f"find {root}/b -type f -name '*.kvb' -delete")
        lru_s = time_cmd(
            f"find {root}/c -type f -name '*.kvb' -printf '%A@ %p\\n' | sort -n | "
            f"head -n {deleted} | cut -d' ' -f2 | xargs -r rm -f"
        )
    ev_rate = n / evictor_s
    print(f"evictor (LRU, re-stat, {deleted:,} deleted): {evictor_s:.2f}s, "
          f"{ev_rate:,.0f} files/s scanned, {deleted / evictor_s:,.0f} files/s deleted")
    print(f"find -delete (all {n:,}, no LRU): {find_s:.2f}s, {n / find_s:,.0f} files/s")
    print(f"find|sort|head|xargs rm (LRU pipeline, {deleted:,}): {lru_s:.2f}s, "
          f"{n / lru_s:,.0f} files/s scanned")
    print(f"ratio evictor/find-delete time: {evictor_s / find_s:.2f}x; "
          f"evictor/LRU-pipeline time: {evictor_s / lru_s:.2f}x")
    glusterfs()


def glusterfs(n: int = GLUSTER_FILES) -> None:
    """The evictor on a one-brick GlusterFS volume (tests/glusterfs): threads chosen by its
    own latency probe; time from above the high to below the low (inode) watermark."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from tests.glusterfs import GlusterUnavailable, gluster_volume

    now = time.time()
    try:
        with gluster_volume(Path(tempfile.mkdtemp(prefix="kvtier-bench-evictor-gluster-")),
                            size_mib=512, mounts=1, bytes_per_inode=4096) as vol:
            root = str(vol.mounts[0] / "a")
            t = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda s: build(root, n, now, range(s, n, 16)), range(16)))
            print(f"\n{n:,} files on GlusterFS (one brick, FUSE over TCP loopback), "
                  f"built in {time.perf_counter() - t:.1f}s")

            def usage() -> Usage:
                return Usage(used_bytes=0, capacity_bytes=1, used_inodes=n,
                             capacity_inodes=n)

            config = Config(root=root, layout=KVTIER, high_watermark=99, low_watermark=98,
                            inode_high_watermark=90,
                            inode_low_watermark=100 * (1 - FREE_FRACTION),
                            min_idle_seconds=600)
            start = time.perf_counter()
            report = Run(config, usage_source=usage).execute()
            took = time.perf_counter() - start
            assert report.files_scanned == n, report
            print(f"evictor on GlusterFS (threads by its latency probe): {took:.2f}s from "
                  f"above high to below low, {n / took:,.0f} files/s scanned, "
                  f"{report.files_deleted:,} deleted ({report.files_deleted / took:,.0f}/s);"
                  f" 1M files at this rate: {1e6 / (n / took) / 60:.1f} min")
    except GlusterUnavailable as err:
        print(f"\nevictor on GlusterFS: skipped ({err})")
