"""Block store vs vLLM 0.32's built-in fs tier I/O vs the raw device, in one run.

Same directory, same block sizes, same total thread count, O_DIRECT wherever the
filesystem takes it (both probe it). kvtier computes and verifies a 64-bit digest per block;
vLLM's tier (its fs_io_C extension where built) writes and reads raw bytes. The raw
device figure is one sequential O_DIRECT stream over one file, no per-block files.
Both systems run through the storage probe's own functions (kvtier_offload.volume_probe: rows
of one page-aligned array, one job or call per thread's share), so `python -m
kvtier_offload probe --vllm` on a volume measures what this measures there.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable

from kvtier_offload import volume_probe as probe
from kvtier_offload.fileformat import HEADER_SIZE as HEADER
from kvtier_offload.store import probe_o_direct
from kvtier_offload.volume_probe import Arena, vllm_paths  # noqa: F401 (floor imports it here)

TOTAL = int(os.environ.get("KVTIER_BENCH_STORE_BYTES", str(2 << 30)))
THREADS = int(os.environ.get("KVTIER_BENCH_THREADS", "16"))
BLOCK_SIZES = (256 << 10, 2 << 20, 16 << 20)
ARENA_ROWS = 64
# GlusterFS (FUSE over TCP loopback): every open/rename/stat a round trip; smaller runs.
GLUSTER_TOTAL = int(os.environ.get("KVTIER_BENCH_GLUSTER_BYTES", str(512 << 20)))
GLUSTER_BLOCK_SIZES = tuple(int(k) << 10 for k in os.environ.get(  # KiB; 64 MiB: 32B, 256 tok
    "KVTIER_BENCH_GLUSTER_BLOCKS", "256,2048,16384,65536").split(","))
GLUSTER_ROUNDS = int(os.environ.get("KVTIER_BENCH_GLUSTER_ROUNDS", "2"))
# Where `python -m benchmarks store` runs: any of disk, ram, glusterfs (comma-separated).
WHERE = set(os.environ.get("KVTIER_BENCH_STORE_ON", "disk,ram,glusterfs").split(","))


def drop_caches() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass  # not root: loads may then be served partly from the page cache


def keys(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() + b"\0\0\0\0" for i in range(n)]


def vllm_fs(root: str, block: int, n: int, arena: Arena) -> tuple[float, float]:
    run = probe.vllm(root, arena, n, THREADS, between=drop_caches)
    return run.store_gbps, run.load_gbps


def kvtier(root: str, block: int, n: int, arena: Arena) -> tuple[float, float]:
    """The store as kvtier's vLLM tier drives it (the probe's own measurement: one job
    per thread's share, rows of one page-aligned array); every block must succeed."""
    run = probe.kvtier(root, arena, n, THREADS, between=drop_caches)
    assert run.failures == 0, f"{run.failures} blocks failed"
    return run.store_gbps, run.load_gbps


def raw_device(root: str, total: int) -> tuple[float, float]:
    chunk = 16 << 20
    buf = mmap.mmap(-1, chunk)
    buf[:] = os.urandom(chunk)
    path = os.path.join(root, "raw.bin")
    flags = os.O_DIRECT if probe_o_direct(root) else 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | flags, 0o600)
    start = time.perf_counter()
    for _ in range(total // chunk):
        os.write(fd, buf)
    os.close(fd)
    write_s = time.perf_counter() - start
    drop_caches()
    fd = os.open(path, os.O_RDONLY | flags)
    start = time.perf_counter()
    while os.readv(fd, [buf]) > 0:
        pass
    os.close(fd)
    read_s = time.perf_counter() - start
    return total / write_s / 1e9, total / read_s / 1e9


ROUNDS = int(os.environ.get("KVTIER_BENCH_ROUNDS", "3"))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


Rounds = dict[str, list[tuple[float, float]]]  # system: (store, load) GB/s of each round


def alternate(run: Callable[[str], tuple[float, float]], rounds: int = ROUNDS) -> Rounds:
    """`rounds` rounds of run("vllm") and run("kvtier"). Each goes first in every other
    round: the VM disk's burst budget favours whoever runs first after a pause."""
    results: Rounds = {"vllm": [], "kvtier": []}
    for round_ in range(rounds):
        for name in ("vllm", "kvtier") if round_ % 2 == 0 else ("kvtier", "vllm"):
            results[name].append(run(name))
    return results


def side_by_side(results: Rounds) -> tuple[list[float], str]:
    """Medians [vLLM store, kvtier store, vLLM load, kvtier load] and the table cells
    "ratio | ... | store ratios | load ratios" (every round) that follow them. The two ran
    back to back in each round: the spread of the per-round ratios says how far the medians can be
    trusted on a machine whose speed drifts."""
    v_store, v_load = (median([r[i] for r in results["vllm"]]) for i in (0, 1))
    k_store, k_load = (median([r[i] for r in results["kvtier"]]) for i in (0, 1))
    pairs = list(zip(results["kvtier"], results["vllm"], strict=True))
    stores = [k[0] / v[0] for k, v in pairs]
    loads = [k[1] / v[1] for k, v in pairs]
    return [v_store, k_store, v_load, k_load], (
        f"{by_round(stores)} | {by_round(loads)} |")


def by_round(ratios: list[float]) -> str:
    """Every round's ratio, in the order the rounds ran."""
    return " ".join(f"{r:.2f}" for r in ratios)


def on_disk_and_in_ram(compare: Callable[[str, str], object], prefix: str) -> None:
    """compare(directory, label) on the disk (KVTIER_BENCH_DIR, else a temp dir) and on
    /dev/shm where there is one."""
    if "disk" in WHERE:
        disk = os.environ.get("KVTIER_BENCH_DIR") or tempfile.mkdtemp(prefix=prefix)
        try:
            compare(disk, "disk")
        finally:
            if not os.environ.get("KVTIER_BENCH_DIR"):
                shutil.rmtree(disk, ignore_errors=True)
    if "ram" in WHERE and os.path.isdir("/dev/shm"):
        ram = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
        try:
            compare(ram, "RAM (/dev/shm: no device, software cost only)")
        finally:
            shutil.rmtree(ram, ignore_errors=True)


def on_glusterfs(compare: Callable[[str, str], None], prefix: str, size_mib: int) -> None:
    """compare(directory, label) on a throwaway one-brick GlusterFS volume (tests/glusterfs:
    glusterd, a loop ext4 brick, a FUSE client mount), where one can be started here."""
    from pathlib import Path

    from tests.glusterfs import GlusterUnavailable, gluster_volume

    try:
        with gluster_volume(Path(tempfile.mkdtemp(prefix=prefix)), size_mib=size_mib,
                            mounts=1) as vol:
            compare(str(vol.mounts[0]), "GlusterFS (one brick, FUSE over TCP loopback)")
    except GlusterUnavailable as err:
        print(f"\n### GlusterFS: skipped ({err})")


def compare(base: str, label: str, total: int = TOTAL,
            sizes: tuple[int, ...] = BLOCK_SIZES, rounds: int = ROUNDS,
            keep: bool = False) -> dict[int, list[float]]:
    """Alternate vLLM and kvtier for `rounds` rounds per block size, swapping who goes
    first; medians (the VM disks these run on swing by 2-5x between minutes, so single
    runs mislead) and every round's ratio. keep: leave each run's files (a throwaway
    volume where removing them costs more than the run)."""
    print(f"\n### {label}: {base}, O_DIRECT {'yes' if probe_o_direct(base) else 'no'}, "
          f"{total >> 20} MiB per run, {THREADS} threads, median of {rounds} alternating rounds")
    raw = [raw_device(base, total) for _ in range(rounds)]
    os.unlink(os.path.join(base, "raw.bin"))
    raw_w, raw_r = median([w for w, _ in raw]), median([r for _, r in raw])
    print(f"raw (one O_DIRECT stream): write {raw_w:.2f} GB/s, read {raw_r:.2f} GB/s\n")
    print("| block | vLLM fs store | kvtier store | ratio | vLLM fs load | kvtier load | ratio |"
          " kvtier/raw store | kvtier/raw load | store ratio by round | load ratio by round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    medians: dict[int, list[float]] = {}
    for block in sizes:
        n = max(total // block, 1)
        arena = Arena.make(block, n)

        def run(name: str, block: int = block, n: int = n, arena: Arena = arena) -> (
                tuple[float, float]):
            root = tempfile.mkdtemp(prefix=f"{name}-", dir=base)
            try:
                return {"vllm": vllm_fs, "kvtier": kvtier}[name](root, block, n, arena)
            finally:
                if not keep:
                    shutil.rmtree(root, ignore_errors=True)

        (v_store, k_store, v_load, k_load), ranges = side_by_side(alternate(run, rounds))
        medians[block] = [v_store, k_store, v_load, k_load]
        print(f"| {block >> 10} KiB | {v_store:.2f} GB/s | {k_store:.2f} GB/s | "
              f"{k_store / v_store:.2f}x | {v_load:.2f} GB/s | {k_load:.2f} GB/s | "
              f"{k_load / v_load:.2f}x | {k_store / raw_w:.2f} | {k_load / raw_r:.2f} | {ranges}",
              flush=True)
    return medians


def compare_glusterfs(base: str, label: str) -> None:
    medians = compare(base, label, GLUSTER_TOTAL, GLUSTER_BLOCK_SIZES, GLUSTER_ROUNDS,
                      keep=True)
    load_floor(base, GLUSTER_TOTAL, FLOOR_BLOCK_SIZES, GLUSTER_ROUNDS, medians)


# The load floor (issue #37): the same bytes read through the same mount by the cheapest
# correct design, beside the systems' loads above.
FLOOR_BLOCK_SIZES = tuple(b for b in (256 << 10, 2 << 20) if b in GLUSTER_BLOCK_SIZES)
FLOOR_WAYS = ("bare", "header", "cat")


def load_floor(base: str, total: int, sizes: tuple[int, ...], rounds: int,
               loads: dict[int, list[float]]) -> None:
    """Per block size, files of the payload alone and files of a 4 KiB header + the
    payload (kvtier's layout: header, then the block), written once in 256 directories;
    then `rounds` rounds, the order rotating, page cache dropped before each read of:
    `bare`: THREADS threads each open, read the whole payload-only file in one read and
    close it (O_DIRECT where the volume takes it, as both systems); `header`: the same on
    the header files, reading the 4 KiB header first, then the payload (what a verified
    load must at least do; nothing is checked); `cat`: one `cat` of every payload-only
    file (buffered, one process). GB/s of payload; ratios to the vLLM fs tier's median
    load measured above in the same run."""
    direct = probe_o_direct(base)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    print(f"\n#### Load floor: {total >> 20} MiB per read, {THREADS} threads, O_DIRECT "
          f"{'yes' if direct else 'no'}, median of {rounds} rounds (order rotating)\n")
    print("| block | vLLM fs load | kvtier load | floor: open+read+close | floor: + 4 KiB "
          "header read first | floor: `cat` | header/bare | kvtier/vLLM | bare/vLLM | "
          "header/vLLM | bare by round | header by round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for block in sizes:
        got = floor_rounds(base, block, max(total // block, 1), rounds, flags)
        bare, header, cat = (median(got[way]) for way in FLOOR_WAYS)
        v_load, k_load = loads[block][2], loads[block][3]
        print(f"| {block >> 10} KiB | {v_load:.2f} GB/s | {k_load:.2f} GB/s | {bare:.2f} GB/s "
              f"| {header:.2f} GB/s | {cat:.2f} GB/s | {header / bare:.2f}x | "
              f"{k_load / v_load:.2f}x | {bare / v_load:.2f}x | {header / v_load:.2f}x | "
              f"{by_round(got['bare'])} | {by_round(got['header'])} |", flush=True)


def floor_rounds(base: str, block: int, n: int, rounds: int,
                 flags: int) -> dict[str, list[float]]:
    """load_floor's files for one block size and its rounds: GB/s of each way by round."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    root = tempfile.mkdtemp(prefix="floor-", dir=base)
    payload = mmap.mmap(-1, block + HEADER)
    payload[:] = os.urandom(block + HEADER)
    files: dict[str, list[str]] = {"bare": [], "header": []}
    for i in range(n):
        d = os.path.join(root, f"{i % 256:02x}")
        os.makedirs(d, exist_ok=True)
        for way, size in (("bare", block), ("header", block + HEADER)):
            path = os.path.join(d, f"{way}-{i}.bin")
            with open(path, "wb") as f:
                f.write(payload[:size])
            files[way].append(path)

    def read_share(way: str, paths: list[str]) -> None:
        head = mmap.mmap(-1, HEADER)
        buf = mmap.mmap(-1, block)
        for path in paths:
            fd = os.open(path, flags)
            try:
                if way == "header":
                    os.preadv(fd, [head], 0)
                    got = os.preadv(fd, [buf], HEADER)
                else:
                    got = os.preadv(fd, [buf], 0)
                assert got == block, (path, got)
            finally:
                os.close(fd)

    def read_all(way: str) -> float:
        drop_caches()
        start = time.perf_counter()
        if way == "cat":
            subprocess.run(["xargs", "-0", "cat"], input="\0".join(files["bare"]).encode(),
                           stdout=subprocess.DEVNULL, check=True)
        else:
            paths = files[way]
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(read_share, [way] * THREADS,
                              [paths[k::THREADS] for k in range(THREADS)]))
        return n * block / (time.perf_counter() - start) / 1e9

    got: dict[str, list[float]] = {way: [] for way in FLOOR_WAYS}
    for r in range(rounds):
        k = r % len(FLOOR_WAYS)
        for way in FLOOR_WAYS[k:] + FLOOR_WAYS[:k]:
            got[way].append(read_all(way))
    return got


def gluster_volume_mib() -> int:
    """Room for every run's files (they are kept: the volume goes at the end) and the raw
    stream's file."""
    runs = 2 * GLUSTER_ROUNDS * len(GLUSTER_BLOCK_SIZES) + 2 * len(FLOOR_BLOCK_SIZES)
    return (runs + 1) * (GLUSTER_TOTAL >> 20) * 17 // 16 + 512


def main() -> None:
    on_disk_and_in_ram(compare, "kvtier-bench-store-")
    if "glusterfs" in WHERE:
        on_glusterfs(compare_glusterfs, "kvtier-bench-store-gluster-",
                     size_mib=gluster_volume_mib())
