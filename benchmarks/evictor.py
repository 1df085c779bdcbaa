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
GLUSTER_FILES = int(os.environ.get("KVTIER_BENCH_GLUSTER_FILES", "100000"))
# 0: the evictor's own choice (its latency probe); the floor uses what the evictor used
GLUSTER_THREADS = int(os.environ.get("KVTIER_BENCH_GLUSTER_THREADS", "0"))
BUILD_THREADS = 32
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
        fd = os.open(os.path.join(d, f"{k}.kvb"), os.O_CREAT | os.O_WRONLY, 0o644)
        t = now - 3600 - (i * 7919 % n)  # access times spread over n seconds
        os.utime(fd, (t, t))
        os.close(fd)


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


def leaf_dirs(root: str) -> list[str]:
    base = os.path.join(root, "kvtier", "v1", "0123456789abcdef")
    return [os.path.join(base, a, b) for a in sorted(os.listdir(base))
            for b in sorted(os.listdir(os.path.join(base, a)))]


def floor(root: str, threads: int, fraction: float) -> tuple[float, int, int]:
    """The least a scan+unlink of the same tree can do here: threads list every leaf
    directory and stat each file (by path), then unlink the oldest `fraction` of them by
    path, directory by directory; no LRU heap, no re-check, no directory handles, no
    directory removal. (seconds, files scanned, files deleted)."""
    from concurrent.futures import ThreadPoolExecutor

    def scan_dir(d: str) -> list[tuple[float, str]]:
        with os.scandir(d) as it:
            return [(max(st.st_atime, st.st_mtime), e.path) for e in it
                    for st in (e.stat(follow_symlinks=False),)]

    def unlink_all(paths: list[str]) -> None:
        for path in paths:
            os.unlink(path)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        dirs = leaf_dirs(root)
        found = [f for files in pool.map(scan_dir, dirs, chunksize=16) for f in files]
        found.sort()
        doomed = sorted(path for _, path in found[:int(len(found) * fraction)])
        per = max(1, len(doomed) // (threads * 8))
        list(pool.map(unlink_all, [doomed[i:i + per] for i in range(0, len(doomed), per)]))
    return time.perf_counter() - start, len(found), len(doomed)


def glusterfs(n: int = GLUSTER_FILES) -> None:
    """The evictor on a one-brick GlusterFS volume (tests/glusterfs): threads chosen by its
    own latency probe; time from above the high to below the low (inode) watermark; then
    the floor (a plain threaded scan+unlink) on what the evictor left (70% of the tree),
    compared per file: building a second tree costs as long as both runs."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from tests.glusterfs import GlusterUnavailable, gluster_volume

    now = time.time()
    # inodes: per file one, per directory two (GlusterFS keeps a gfid link per directory
    # in the brick), and GlusterFS's own 65,536 gfid fan-out directories
    size_mib = max(512, (n + 3 * 65536) * 4096 // 2**20 * 5 // 4)
    try:
        with gluster_volume(Path(tempfile.mkdtemp(prefix="kvtier-bench-evictor-gluster-")),
                            size_mib=size_mib, mounts=1, bytes_per_inode=4096) as vol:
            roots = [str(vol.mounts[0] / "a")]
            t = time.perf_counter()
            with ThreadPoolExecutor(BUILD_THREADS) as pool:
                list(pool.map(lambda job: build(job[0], n, now,
                                                range(job[1], n, BUILD_THREADS)),
                              [(r, s) for r in roots for s in range(BUILD_THREADS)]))
            print(f"\n{n:,} files on GlusterFS (one brick, FUSE over TCP loopback),"
                  f" built in {time.perf_counter() - t:.1f}s")

            def usage() -> Usage:
                return Usage(used_bytes=0, capacity_bytes=1, used_inodes=n,
                             capacity_inodes=n)

            config = Config(root=roots[0], layout=KVTIER, high_watermark=99,
                            low_watermark=98, inode_high_watermark=90,
                            inode_low_watermark=100 * (1 - FREE_FRACTION),
                            min_idle_seconds=600, threads=GLUSTER_THREADS)
            start = time.perf_counter()
            report = Run(config, usage_source=usage).execute()
            took = time.perf_counter() - start
            assert report.files_scanned == n, report
            deleting = took - report.scan_seconds
            print(f"evictor on GlusterFS ({report.threads} threads"
                  f"{' by its latency probe' if not GLUSTER_THREADS else ''}): {took:.2f}s "
                  f"from above high to below low; scan {report.scan_seconds:.2f}s "
                  f"({n / report.scan_seconds:,.0f} files/s), delete {deleting:.2f}s "
                  f"({report.files_deleted:,} files, {report.dirs_removed:,} emptied "
                  f"directories: {report.files_deleted / deleting:,.0f} files/s); "
                  f"{n / took:,.0f} files/s overall; 1M files at this rate: "
                  f"{1e6 / (n / took) / 60:.1f} min")
            floor_threads = report.threads
            floor_s, scanned, deleted = floor(roots[0], floor_threads, FREE_FRACTION)
            print(f"floor on the {scanned:,} files left (plain scan+stat of every file, "
                  f"unlink the oldest {FREE_FRACTION:.0%} by path, {floor_threads} threads):"
                  f" {floor_s:.2f}s, {deleted:,} deleted; {scanned / floor_s:,.0f} files/s "
                  f"overall; evictor/floor time per file: "
                  f"{(took / n) / (floor_s / scanned):.2f}x")
    except GlusterUnavailable as err:
        print(f"\nevictor on GlusterFS: skipped ({err})")
