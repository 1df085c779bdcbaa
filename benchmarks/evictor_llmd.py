"""The evictor against llm-d's PVC evictor (its anchor), on realistic trees.

Trees in the layout both evictors serve, vLLM's fs tier
(`<model>_<fingerprint>_r0/<h[0:3]>/<h[3:5]>_g0/<h>.bin`, 64-hex block hashes): by
default 120,000 files of 8 KiB and 420,000 of 4 KiB, last use spread over the files,
every directory's times set to its newest file's (as on a live volume, where a directory
changes when a file is written into it). Each tree is built once; per round it is
copied (`cp -a`: names, data and times) onto a tmpfs of its own, sized so the tree fills
90% of it, once per evictor, and each evictor is started on its copy as a process with
its defaults (high 85%, low 70%). Who goes first alternates by round.

Time: from the process start until statvfs shows the volume at or below 70% (polled
every 10 ms); kvtier's run also reports its time to exit (it then stops by itself;
llm-d's runs until told to). Files deleted: block files gone when the run ended. LRU
quality: the share of the deleted files that are among as many of the tree's least
recently used files (1.0: strict LRU; a random pick scores the share deleted). CPU:
user + system seconds of the run's processes (llm-d's: all its processes, read from
/proc when the volume reached 70%), the figure that load on a shared machine moves least.

Then, once per tree, the floors on a copy of their own: `floor` is the least a correct
LRU run does (in this process: scandir every directory, stat every block file by path,
sort, unlink as many of the oldest as kvtier deleted by path; no re-check, no directory
removal, no lock) and `find -delete` removes every block file.

llm-d's evictor (llm-d/llm-d-kv-cache `kv_connectors/pvc_evictor`, stdlib only) is not
on PyPI: it runs from a checkout named by KVTIER_BENCH_LLMD_EVICTOR (that directory;
`git clone https://github.com/llm-d/llm-d-kv-cache` gives it), with its defaults (8
crawler processes, batches of 100 through `xargs rm -f`, the folder cleaner) and its
logs discarded. Without it the case says so and runs kvtier alone.

Then the same on GlusterFS (tests/glusterfs: one brick on a loop ext4, one FUSE mount
over TCP loopback), issue #37's "also on GlusterFS at 100k files": one tree of
100,000 x 8 KiB built once through the mount with its directory times set, a ballast
file beside the brick (on its ext4, outside the volume: neither evictor sees it) brings
the volume to 90%, and the brick's image is saved; before every run the image is put
back, so each run starts from the same tree, GlusterFS's own metadata included. The
floor there is the bare loop above spread over threads (each lists and stats its share
of the tree's top directories, then unlinks its share of the oldest): on a network
volume one thread would measure round trips, not what the mount allows. Without
GlusterFS (or root) that part says why and is skipped.

    KVTIER_BENCH_LLMD_EVICTOR=.../kv_connectors/pvc_evictor python -m benchmarks evictor_llmd
    KVTIER_BENCH_LLMD_TREES=120000x8,420000x4 (files x KiB), KVTIER_BENCH_ROUNDS=3,
    KVTIER_BENCH_LLMD_FLOORS=0 (skip the floors),
    KVTIER_BENCH_LLMD_GLUSTER=100000x8 (files x KiB; 0 skips GlusterFS),
    KVTIER_BENCH_LLMD_GLUSTER_FLOOR_THREADS=16
Run the GlusterFS part under `flock /tmp/kvtier-gluster.lock` on a shared machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

LLMD = os.environ.get("KVTIER_BENCH_LLMD_EVICTOR", "")
TREES = os.environ.get("KVTIER_BENCH_LLMD_TREES", "120000x8,420000x4")
ROUNDS = int(os.environ.get("KVTIER_BENCH_ROUNDS", "3"))
FLOOR_RUNS = os.environ.get("KVTIER_BENCH_LLMD_FLOORS", "1") != "0"  # 0: skip the floors
FILL = 0.90  # of the tmpfs the tree takes
HIGH, LOW = 85.0, 70.0  # both evictors' defaults
MODEL_DIR = "Qwen_Qwen3-0.6B_0123456789ab"
CACHE = "kv"  # the cache directory on the volume (llm-d's CACHE_DIRECTORY)
POLL = 0.01
TIMEOUT = float(os.environ.get("KVTIER_BENCH_LLMD_TIMEOUT", "600"))
GLUSTER_TREE = os.environ.get("KVTIER_BENCH_LLMD_GLUSTER", "100000x8")
GLUSTER_FLOOR_THREADS = int(os.environ.get("KVTIER_BENCH_LLMD_GLUSTER_FLOOR_THREADS", "16"))
BUILD_THREADS = 32
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    seconds: float  # start to at or below LOW
    exit_seconds: float  # start to exit (kvtier) or to the stop signal (llm-d)
    deleted: int
    lru: float
    cpu: float  # user + system seconds of the run's processes


def block_hash(i: int) -> str:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).hexdigest()


def last_use(i: int, n: int, now: float) -> float:
    """Distinct and spread out (7919 is prime to both default sizes), all over 2 h old:
    past both evictors' idle guards (kvtier 10 min, llm-d 60 min)."""
    return now - 7200 - (i * 7919 % n)


def build(cache: str, n: int, size: int, now: float,
          threads: int = 1) -> dict[str, float]:
    """The tree under `cache` (block files written by `threads` threads, each its share
    of them); returns each block file's name -> last use."""
    os.makedirs(os.path.join(cache, MODEL_DIR))
    with open(os.path.join(cache, MODEL_DIR, "config.json"), "w") as f:
        f.write('{"model_name": "Qwen/Qwen3-0.6B"}\n')
    data = os.urandom(size)
    newest: dict[str, float] = {}
    used: dict[str, float] = {}
    if threads == 1:
        build_part(cache, range(n), n, data, now, used, newest)
    else:
        parts: list[tuple[dict[str, float], dict[str, float]]] = [
            ({}, {}) for _ in range(threads)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda k: build_part(cache, range(k, n, threads), n, data, now,
                                               *parts[k]), range(threads)))
        for part_used, part_newest in parts:
            used.update(part_used)
            for d, t in part_newest.items():
                newest[d] = max(newest.get(d, 0.0), t)
    dirs = sorted(newest)
    with ThreadPoolExecutor(threads) as pool:  # a directory changes when a file lands in it
        list(pool.map(lambda d: os.utime(d, (newest[d], newest[d])), dirs))
    return used


def build_part(cache: str, part: range, n: int, data: bytes, now: float,
               used: dict[str, float], newest: dict[str, float]) -> None:
    rank = os.path.join(cache, f"{MODEL_DIR}_r0")
    for i in part:
        h = block_hash(i)
        t = last_use(i, n, now)
        leaf = os.path.join(rank, h[:3], f"{h[3:5]}_g0")
        if leaf not in newest:
            os.makedirs(leaf, exist_ok=True)
        path = os.path.join(leaf, f"{h}.bin")
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, data)
        os.close(fd)
        # Times set after the close: a network client (GlusterFS's write-behind) may
        # send the data at the close, which would stamp the file's mtime "now".
        os.utime(path, (t, t))
        used[f"{h}.bin"] = t
        for d in (leaf, os.path.dirname(leaf), rank):
            newest[d] = max(newest.get(d, 0.0), t)


def usage_percent(path: str) -> float:
    st = os.statvfs(path)
    return 100.0 * (st.f_blocks - st.f_bfree) / st.f_blocks


def block_names(cache: str) -> set[str]:
    found: set[str] = set()
    for _, _, files in os.walk(cache):
        found.update(f for f in files if f.endswith(".bin"))
    return found


def lru_quality(used: dict[str, float], left: set[str]) -> tuple[int, float]:
    deleted = [name for name in used if name not in left]
    if not deleted:
        return 0, 1.0
    oldest = set(sorted(used, key=used.__getitem__)[:len(deleted)])
    return len(deleted), sum(name in oldest for name in deleted) / len(deleted)


def watch(proc: subprocess.Popen[bytes], mount: str, began: float) -> float:
    """Seconds from `began` until the volume is at or below LOW (or the process ends)."""
    while time.perf_counter() - began < TIMEOUT:
        if usage_percent(mount) <= LOW:
            return time.perf_counter() - began
        if proc.poll() is not None:
            return time.perf_counter() - began
        time.sleep(POLL)
    raise TimeoutError(f"not at {LOW}% after {TIMEOUT}s")


def run_kvtier(mount: str) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "evictor"))
    summary = tempfile.NamedTemporaryFile(prefix="kvtier-bench-llmd-summary-", delete=False)
    summary.close()
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier_evictor", "--root",
                             os.path.join(mount, CACHE), "--layout", "vllm-fs",
                             "--high-watermark", str(HIGH), "--low-watermark", str(LOW),
                             "--termination-log", summary.name],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reached = watch(proc, mount, began)
    proc.wait(TIMEOUT)
    ended = time.perf_counter() - began
    try:  # what the run says of itself: passes and skipped files explain its LRU figure
        import json
        with open(summary.name) as f:
            got = json.load(f)
        print("kvtier's summary: " + ", ".join(
            f"{k} {got.get(k)}" for k in ("threads", "passes", "files_deleted",
                                         "skipped_recent", "skipped_changed",
                                         "dirs_removed", "errors")), file=sys.stderr)
    except (OSError, ValueError):
        pass
    finally:
        os.unlink(summary.name)
    return reached, ended


def session_cpu(sid: int) -> float:
    """CPU seconds of the live processes of session `sid` (llm-d's evictor and the
    processes it started), from /proc: taken before it is stopped, as it stands then."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # session id; utime, stime, cutime, cstime follow
            total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def run_llmd(mount: str) -> tuple[float, float, float]:
    env = dict(os.environ, PVC_MOUNT_PATH=mount, CACHE_DIRECTORY=CACHE,
               CLEANUP_THRESHOLD=str(HIGH), TARGET_THRESHOLD=str(LOW))
    env.pop("PYTHONPATH", None)
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "evictor.py"], cwd=LLMD, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        reached = watch(proc, mount, began)
        stopped = time.perf_counter() - began
        cpu = session_cpu(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)  # its own graceful shutdown
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # Its crawlers and deleters may outlive the main process; on GlusterFS one left
        # in the mount kept the next restore_brick from unmounting it (the GlusterFS
        # floor then found the volume at 70%, not restored).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return reached, stopped, cpu


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_floor(mount: str, count: int) -> tuple[float, float]:
    """The least a correct LRU run does here, in this process: os.scandir of every
    directory and a stat of every block file by path, a sort, and an unlink by path of
    the `count` oldest (no re-check, no directory removal, no lock, no report)."""
    began = time.perf_counter()
    cpu = time.process_time()
    found: list[tuple[float, str]] = []
    stack = [os.path.join(mount, CACHE)]
    while stack:
        files, dirs = _scan_dir(stack.pop())
        found += files
        stack += dirs
    found.sort()
    for _, path in found[:count]:
        os.unlink(path)
    return time.perf_counter() - began, time.process_time() - cpu


def _scan_dir(directory: str) -> tuple[list[tuple[float, str]], list[str]]:
    """One directory of the floors' bare loop: its block files, (last use, path) from a
    stat by path each, and its subdirectories."""
    files, dirs = [], []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                dirs.append(entry.path)
            elif entry.name.endswith(".bin"):
                st = os.stat(entry.path, follow_symlinks=False)
                files.append((max(st.st_atime, st.st_mtime), entry.path))
    return files, dirs


def run_floor_threaded(mount: str, count: int, threads: int) -> tuple[float, float]:
    """run_floor's bare loop over `threads` threads, a directory level at a time: each
    lists its share of the level's directories (os.scandir) and stats their block files
    by path; then a sort, and each unlinks its share of the `count` oldest by path."""
    began = time.perf_counter()
    cpu = time.process_time()

    def unlink_all(paths: list[str]) -> None:
        for path in paths:
            os.unlink(path)

    found: list[tuple[float, str]] = []
    level = [os.path.join(mount, CACHE)]
    with ThreadPoolExecutor(threads) as pool:
        while level:
            next_level: list[str] = []
            for files, dirs in pool.map(_scan_dir, level, chunksize=max(1, len(level) // (
                    threads * 8))):
                found += files
                next_level += dirs
            level = next_level
        found.sort()
        doomed = [path for _, path in found[:count]]
        per = max(1, len(doomed) // (threads * 8))
        list(pool.map(unlink_all, [doomed[i:i + per] for i in range(0, len(doomed), per)]))
    return time.perf_counter() - began, time.process_time() - cpu


def run_side(side: str, mount: str, count: int) -> tuple[float, float, float]:
    """(seconds to <= LOW, seconds to exit or stop, CPU seconds) of one side's run on
    the volume at `mount`; the floors delete `count` files."""
    if side == "floor":
        reached, cpu = run_floor(mount, count)
        return reached, reached, cpu
    if side == "threaded floor":
        reached, cpu = run_floor_threaded(mount, count, GLUSTER_FLOOR_THREADS)
        return reached, reached, cpu
    if side == "find -delete":
        began = time.perf_counter()
        cpu = children_cpu()
        subprocess.run(["find", os.path.join(mount, CACHE), "-name", "*.bin", "-delete"],
                       check=True)
        reached = time.perf_counter() - began
        return reached, reached, children_cpu() - cpu
    if side == "llm-d":
        return run_llmd(mount)
    cpu = children_cpu()
    reached, ended = run_kvtier(mount)
    return reached, ended, children_cpu() - cpu


def one_run(side: str, template: str, used: dict[str, float], tree_bytes: int,
            count: int = 0) -> Result:
    mount = tempfile.mkdtemp(prefix=f"kvtier-bench-llmd-{side}-")
    size_kib = int(tree_bytes / FILL) // 1024
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,nr_inodes=4m", "tmpfs",
                    mount], check=True)
    try:
        subprocess.run(["cp", "-a", os.path.join(template, CACHE), mount], check=True)
        before = usage_percent(mount)
        if before <= HIGH:
            raise RuntimeError(f"the copy fills {before:.1f}%, not above {HIGH}%")
        reached, ended, cpu = run_side(side, mount, count)
        deleted, lru = lru_quality(used, block_names(os.path.join(mount, CACHE)))
        return Result(reached, ended, deleted, lru, cpu)
    finally:
        subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(mount, ignore_errors=True)


def main() -> None:
    if os.geteuid() != 0:
        print("evictor_llmd: skipped (needs root to mount a tmpfs per run)")
        return
    sides = ["kvtier"]
    if LLMD and os.path.isfile(os.path.join(LLMD, "evictor.py")):
        sides.append("llm-d")
    else:
        print("llm-d's evictor: not run (set KVTIER_BENCH_LLMD_EVICTOR to a checkout's "
              "kv_connectors/pvc_evictor); kvtier alone")
    for spec in filter(None, TREES.split(",")):
        files, kib = (int(x) for x in spec.lower().split("x"))
        tree(files, kib * 1024, sides)
    if GLUSTER_TREE != "0":
        files, kib = (int(x) for x in GLUSTER_TREE.lower().split("x"))
        glusterfs(files, kib * 1024, sides)


FLOORS = ("floor", "find -delete")


def show(r: int, side: str, res: Result) -> None:
    print(f"| {r} | {side} | {res.seconds:.2f} | {res.exit_seconds:.2f} | {res.cpu:.2f} "
          f"| {res.deleted:,} | {'-' if side == 'find -delete' else f'{res.lru:.3f}'} |",
          flush=True)


def summary(got: dict[str, list[Result]]) -> None:
    ratios = [a.seconds / b.seconds for a, b in zip(got["kvtier"], got["llm-d"], strict=True)]
    exits = [a.exit_seconds / b.seconds for a, b in zip(got["kvtier"], got["llm-d"],
                                                        strict=True)]
    files = [a.deleted / b.deleted for a, b in zip(got["kvtier"], got["llm-d"], strict=True)]
    print(f"\nkvtier/llm-d time to <= {LOW:.0f}%: "
          f"{' '.join(f'{x:.2f}' for x in ratios)} (median {median(ratios):.2f}x); "
          f"kvtier to exit / llm-d to <= {LOW:.0f}%: median {median(exits):.2f}x; "
          f"CPU {median(g.cpu for g in got['kvtier']):.2f}s vs "
          f"{median(g.cpu for g in got['llm-d']):.2f}s; "
          f"files deleted {median(files):.2f}x; LRU quality "
          f"{median([g.lru for g in got['kvtier']]):.3f} vs "
          f"{median([g.lru for g in got['llm-d']]):.3f}", flush=True)


def gluster_image_mib(n: int, size: int) -> int:
    """The brick's ext4 image, sized so that the tree fills about 65% of what statvfs
    shows (ext4 shows ~90% of its image). Measured at 5,000 files of 8 KiB: 34.8 KB of the
    brick per file: its blocks, mostly a leaf directory of its own, the xattr blocks
    GlusterFS adds to both, and GlusterFS's gfid directories (two levels of 256, 4 KiB
    each, all there at 100,000 files). A ballast then brings the volume to exactly FILL."""
    tree = n * ((size + 4095) // 4096 * 4096 + (18 << 10)) + (256 + 65536) * 4096
    return max(64, int(tree / 0.65 / 0.90) >> 20)


@contextlib.contextmanager
def gluster_tree(n: int, size: int) -> Iterator[tuple[Any, str, dict[str, float], float]]:
    """A GlusterFS volume holding the tree at FILL, its brick's image saved: (volume,
    the image, last uses, seconds the build took). GlusterUnavailable where none can
    start here."""
    from tests.glusterfs import gluster_volume

    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-llmd-gluster-"))
    with gluster_volume(base, size_mib=gluster_image_mib(n, size), mounts=1,
                        bytes_per_inode=4096) as vol:
        mount = str(vol.mounts[0])
        began = time.perf_counter()
        used = build(os.path.join(mount, CACHE), n, size, time.time(), BUILD_THREADS)
        built = time.perf_counter() - began
        tree_percent = usage_percent(mount)
        if not 100 * (FILL - 2 * (FILL - LOW / 100)) < tree_percent < HIGH:
            raise RuntimeError(f"the tree fills {tree_percent:.1f}% of the volume: too "
                               f"little to free {FILL:.0%} to {LOW:.0f}% from it, or over "
                               f"{HIGH}% (gluster_image_mib's estimate is off)")
        # The ballast: on the brick's ext4 beside the brick directory, so the volume's
        # statvfs counts it and neither evictor can see or delete it.
        st = os.statvfs(vol.brick.parent)
        want = int(st.f_blocks * FILL) - (st.f_blocks - st.f_bfree)
        fd = os.open(vol.brick.parent / "ballast", os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, want * st.f_frsize)
        finally:
            os.close(fd)
        image = base / "template.img"
        vol.save_brick(image)
        yield vol, str(image), used, built


def glusterfs(n: int, size: int, sides: list[str]) -> None:
    """Issue #37's evictor case on GlusterFS: the same runs as tree(), each on the
    volume put back to the saved tree, then the threaded floor."""
    from tests.glusterfs import GlusterUnavailable

    try:
        with gluster_tree(n, size) as (vol, image, used, built):
            mount = str(vol.mounts[0])
            print(f"\n### GlusterFS (one brick, FUSE over TCP loopback): {n:,} files x "
                  f"{size // 1024} KiB (vLLM fs layout), built through the mount in "
                  f"{built:.1f}s, volume at {usage_percent(mount):.1f}% (ballast beside the"
                  f" brick), freed to {LOW:.0f}%; the brick's image put back before every "
                  f"run; {ROUNDS} alternating rounds\n")
            got = alternating_rounds(sides, lambda side: gluster_run(vol, image, side, used))
            if FLOOR_RUNS:
                res = gluster_run(vol, image, "threaded floor", used,
                                  int(median(g.deleted for g in got["kvtier"])))
                show(ROUNDS, f"floor ({GLUSTER_FLOOR_THREADS} threads)", res)
                kv = median(g.seconds for g in got["kvtier"])
                print(f"\nkvtier/floor time: {kv / res.seconds:.2f}x (kvtier median "
                      f"{kv:.2f}s, floor {res.seconds:.2f}s for as many files)")
            if "llm-d" in got:
                summary(got)
    except GlusterUnavailable as err:
        print(f"\n### GlusterFS: skipped ({err})")


def alternating_rounds(sides: list[str],
                       run: Callable[[str], Result]) -> dict[str, list[Result]]:
    """The table's header, then ROUNDS rounds of one run per side (who goes first
    alternates by round), each row printed as it ends; every side's results."""
    print("| round | evictor | to <= 70% s | to exit s | CPU s | files deleted "
          "| LRU quality |")
    print("|---|---|---|---|---|---|---|", flush=True)
    got: dict[str, list[Result]] = {side: [] for side in sides}
    for r in range(ROUNDS):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            res = run(side)
            got[side].append(res)
            show(r + 1, side, res)
    return got


def gluster_run(vol: Any, image: str, side: str, used: dict[str, float],
                count: int = 0) -> Result:
    vol.restore_brick(Path(image))
    mount = str(vol.mounts[0])
    if usage_percent(mount) <= HIGH:
        raise RuntimeError(f"the volume is at {usage_percent(mount):.1f}%, not above {HIGH}%")
    reached, ended, cpu = run_side(side, mount, count)
    # What is left, read from the brick's own directory (no round trips through FUSE).
    deleted, lru = lru_quality(used, block_names(str(vol.brick / CACHE)))
    return Result(reached, ended, deleted, lru, cpu)


def tree(n: int, size: int, sides: list[str]) -> None:
    template = tempfile.mkdtemp(prefix="kvtier-bench-llmd-template-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g,nr_inodes=4m,noatime", "tmpfs",
                    template],
                   check=True)
    try:
        began = time.perf_counter()
        used = build(os.path.join(template, CACHE), n, size, time.time())
        tree_bytes = n * ((size + 4095) // 4096 * 4096)
        print(f"\n### {n:,} files x {size // 1024} KiB (vLLM fs layout), tmpfs at "
              f"{FILL:.0%}, freed to {LOW:.0f}%: built in {time.perf_counter() - began:.1f}s;"
              f" {ROUNDS} alternating rounds\n")
        got = alternating_rounds(sides, lambda side: one_run(side, template, used,
                                                             tree_bytes))
        # The floors, once: what the cheapest correct LRU run and deleting everything
        # cost on the same volume (the LRU floor deletes as many files as kvtier did).
        for side in FLOORS if FLOOR_RUNS else ():
            show(ROUNDS, side, one_run(side, template, used, tree_bytes,
                                       got["kvtier"][-1].deleted))
        if "llm-d" in got:
            summary(got)
    finally:
        subprocess.run(["umount", "-l", template], check=False)
        shutil.rmtree(template, ignore_errors=True)


if __name__ == "__main__":
    main()
