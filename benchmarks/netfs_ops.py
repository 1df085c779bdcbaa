"""Where a block's time goes on a network filesystem, and what the cheapest correct
design could do there: on a one-brick GlusterFS volume, the requests each system sends
to the brick per stored and per loaded block (GlusterFS's own `volume profile`: every
file operation that reached the server, counted and timed there), and the floor.

Each request is a round trip through the FUSE client, TCP and the brick daemon; on this
2-core machine also CPU time in both daemons, so on this volume fewer requests per block
is what makes a store or load faster, more than more of them in flight.

The floor is the cheapest design that keeps every publish atomic and every load
verified, in the same fresh directory tree as the store benchmark: one fan-out level of
256 directories (made on first use, cached), a store = create a temp file + one write +
close + rename; a load = open + one read + close (the digest check is CPU, no request).
Its threads: the best of FLOOR_THREADS.

    python -m benchmarks netfs_ops   (root, glusterfs-server; else it says why)
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = int(os.environ.get("KVTIER_BENCH_OPS_BLOCK", str(256 << 10)))
N = int(os.environ.get("KVTIER_BENCH_OPS_BLOCKS", "512"))
THREADS = 16
FLOOR_THREADS = tuple(int(t) for t in os.environ.get("KVTIER_BENCH_FLOOR_THREADS",
                                                     "16,64").split(","))
HEADER = 4096
# Requests to report, in the order a block meets them.
FOPS = ("LOOKUP", "MKDIR", "SETATTR", "CREATE", "OPEN", "FSTAT", "STAT", "WRITE", "READ",
        "FLUSH", "FSYNC", "RENAME", "RELEASE", "SETXATTR", "GETXATTR", "ENTRYLK", "INODELK",
        "STATFS", "UNLINK", "OPENDIR", "READDIRP", "RELEASEDIR", "ACCESS")

Counts = dict[str, tuple[int, float]]  # fop: (calls, mean latency at the brick in us)


def keys(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() + b"\0\0\0\0" for i in range(n)]


class Profile:
    """The brick's request counts between two calls (`volume profile ... incremental`)."""

    def __init__(self, gluster: Callable[..., str], volume: str) -> None:
        self._gluster, self._volume = gluster, volume
        gluster("volume", "profile", volume, "start")
        self.take()

    def take(self) -> Counts:
        out = self._gluster("volume", "profile", self._volume, "info", "incremental")
        counts: Counts = {}
        # "%-latency  Avg-latency  Min-Latency  Max-Latency  No. of calls  Fop" rows,
        # once for the interval (and nothing cumulative with `incremental`).
        for m in re.finditer(r"^\s*[\d.]+\s+([\d.]+) (ns|us|ms)\s+.*?\s(\d+)\s+([A-Z]+)\s*$",
                             out, re.M):
            avg = float(m.group(1)) * {"ns": 1e-3, "us": 1.0, "ms": 1e3}[m.group(2)]
            calls, fop = int(m.group(3)), m.group(4)
            old = counts.get(fop, (0, 0.0))
            total = old[0] + calls
            counts[fop] = (total, (old[0] * old[1] + calls * avg) / total)
        return counts


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def arena() -> mmap.mmap:
    buf = mmap.mmap(-1, 8 * BLOCK)
    buf[:] = os.urandom(len(buf))
    return buf


def kvtier(root: str, store: bool, rows: mmap.mmap, o_direct: str = "auto") -> None:
    from kvtier_offload.store import BlockStore, StoreConfig

    s = BlockStore(StoreConfig(root=root, fingerprint="0123456789abcdef",
                               write_queue_seconds=3600, o_direct=o_direct))
    try:
        view = memoryview(rows)
        items = [(k, view[(i % 8) * BLOCK:][:BLOCK]) for i, k in enumerate(keys(N, "k"))]
        (s.store if store else s.load)(1, items)
        assert s.drain(None) and s.finished()[0].success
    finally:
        s.close()


def vllm(root: str, store: bool, rows: mmap.mmap) -> None:
    from vllm.v1.kv_offload.tiering.fs import io

    from benchmarks.store import vllm_paths

    paths = vllm_paths(root, keys(N, "v"))
    os.makedirs(root, exist_ok=True)  # before its O_DIRECT probe, which writes there
    batches = [list(range(t, N, THREADS)) for t in range(THREADS)]
    move = io.batch_store_block if store else io.batch_load_block
    direct = io.probe_o_direct(root)
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda b: move([paths[i] for i in b], memoryview(rows),
                                     [(i % 8) * BLOCK for i in b], BLOCK, direct), batches))


class Floor:
    """The cheapest correct design (see the module's docstring), O_DIRECT as probed."""

    def __init__(self, threads: int, direct: bool, look_first: bool = False) -> None:
        self.threads, self.look_first = threads, look_first
        self.flag = os.O_DIRECT if direct else 0
        self.made: set[str] = set()

    def run(self, root: str, store: bool, rows: mmap.mmap) -> None:
        paths = [os.path.join(root, k[:1].hex(), k.hex()) for k in keys(N, "f")]
        batches = [list(range(t, N, self.threads)) for t in range(self.threads)]

        def one(batch: list[int]) -> None:
            head = mmap.mmap(-1, HEADER)  # a page-aligned header per thread
            view = memoryview(rows)
            for i in batch:
                path, payload = paths[i], view[(i % 8) * BLOCK:][:BLOCK]
                if store:
                    directory = os.path.dirname(path)
                    if directory not in self.made:
                        os.makedirs(directory, exist_ok=True)
                        self.made.add(directory)
                    if self.look_first and os.path.lexists(path):
                        continue  # what vLLM's tier and kvtier's batch path check first
                    tmp = f"{path}.{os.getpid()}.tmp"
                    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | self.flag, 0o664)
                    try:
                        assert os.pwritev(fd, [head, payload], 0) == HEADER + BLOCK
                    finally:
                        os.close(fd)
                    os.rename(tmp, path)
                else:
                    fd = os.open(path, os.O_RDONLY | self.flag)
                    try:
                        assert os.preadv(fd, [head, payload], 0) == HEADER + BLOCK
                    finally:
                        os.close(fd)

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(one, batches))


def per_block(counts: Counts) -> dict[str, tuple[float, float]]:
    return {fop: (calls / N, us) for fop, (calls, us) in counts.items()}


def main() -> None:
    from tests.glusterfs import GlusterUnavailable, _gluster, gluster_volume

    size_mib = 2 * (5 + len(FLOOR_THREADS)) * N * (BLOCK + HEADER) // (1 << 20) + 512
    try:
        with gluster_volume(Path(tempfile.mkdtemp(prefix="kvtier-bench-ops-")),
                            size_mib=size_mib, mounts=1) as vol:
            profile = Profile(lambda *a: _gluster(vol.base, *a), vol.name)
            rows = arena()
            mount = str(vol.mounts[0])
            from kvtier_offload.store import probe_o_direct
            direct = probe_o_direct(mount)
            # A fresh volume's first files cost more (the brick's image grows): untimed.
            Floor(THREADS, direct).run(os.path.join(mount, "warm-up"), True, rows)
            systems: dict[str, Callable[[str, bool, mmap.mmap], None]] = {
                "vLLM fs tier": vllm, "kvtier": kvtier,
                "kvtier, O_DIRECT off": lambda r, s, b: kvtier(r, s, b, "off")}
            for t in FLOOR_THREADS:
                floor = Floor(t, direct)
                systems[f"floor, {t} threads"] = floor.run
            systems["floor + exists check"] = Floor(THREADS, direct, look_first=True).run
            table: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}
            rates: dict[str, dict[str, float]] = {}
            for name, run in systems.items():
                root = os.path.join(mount, re.sub(r"\W+", "-", name))
                for direction in ("store", "load"):
                    if direction == "load":
                        drop_caches()
                    profile.take()
                    start = time.perf_counter()
                    run(root, direction == "store", rows)
                    took = time.perf_counter() - start
                    table.setdefault(name, {})[direction] = per_block(profile.take())
                    rates.setdefault(name, {})[direction] = N * BLOCK / took / 1e9
            report(table, rates, direct)
    except GlusterUnavailable as err:
        print(f"netfs_ops: skipped ({err})")


def report(table: dict[str, dict[str, dict[str, tuple[float, float]]]],
           rates: dict[str, dict[str, float]], direct: bool) -> None:
    names = list(table)
    print(f"\n### {N} blocks of {BLOCK >> 10} KiB on GlusterFS, O_DIRECT "
          f"{'yes' if direct else 'no'}: requests at the brick per block "
          "(mean brick-side us per request), fresh directory tree")
    for direction in ("store", "load"):
        print(f"\n{direction}s:\n")
        print("| request | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for fop in FOPS + tuple(sorted({f for n in names for f in table[n][direction]}
                                       - set(FOPS))):
            cells = [table[n][direction].get(fop) for n in names]
            if not any(c and c[0] >= 0.01 for c in cells):
                continue
            print(f"| {fop} | " + " | ".join(f"{c[0]:.2f} ({c[1]:.0f})" if c else "-"
                                             for c in cells) + " |")
        total = [sum(c for c, _ in table[n][direction].values()) for n in names]
        print("| **all** | " + " | ".join(f"**{t:.2f}**" for t in total) + " |")
        print("| GB/s (one run) | " + " | ".join(f"{rates[n][direction]:.3f}"
                                                for n in names) + " |")


if __name__ == "__main__":
    main()
