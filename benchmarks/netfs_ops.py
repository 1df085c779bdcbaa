"""Where a block's time goes on a network filesystem: kvtier's system calls per stored
and per loaded block on a one-brick GlusterFS volume, counted and timed by `strace -c -f
-w` (wall time in each call, so a round trip shows up where it is paid).

    python -m benchmarks netfs_ops     (root, strace, glusterfs-server; else it says why)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BLOCK = int(os.environ.get("KVTIER_BENCH_OPS_BLOCK", str(2 << 20)))
N = int(os.environ.get("KVTIER_BENCH_OPS_BLOCKS", "64"))
CALLS = ("mkdir", "openat", "write", "pwrite64", "writev", "pwritev", "pwritev2",
         "fdatasync", "fsync", "rename", "renameat2", "statx", "newfstatat", "fstat",
         "utimensat", "read", "pread64", "readv", "preadv", "preadv2", "close", "unlink",
         "lstat")

SNIPPET = """
import hashlib, mmap, sys
from kvtier_offload.store import BlockStore, StoreConfig
root, block, n, phase = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
batch = sys.argv[5] == "1"
arena = mmap.mmap(-1, block * 8); arena[:] = bytes(range(256)) * (len(arena) // 256)
rows = [memoryview(arena)[i * block:(i + 1) * block] for i in range(8)]
keys = [hashlib.sha256(str(i).encode()).digest() + bytes(4) for i in range(n)]
s = BlockStore(StoreConfig(root=root, fingerprint="0123456789abcdef", read_threads=8,
                           write_threads=8, batch_io=batch))
if phase != "none":  # none: start-up and imports only, subtracted from the others
    getattr(s, phase)(1, [(k, rows[i % 8]) for i, k in enumerate(keys)])
    assert s.drain(None) and s.finished()[0].success
s.close()
"""


def trace(root: str, phase: str, batch: bool) -> dict[str, tuple[int, float]]:
    out = Path(root).parent / f"strace-{phase}.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run(["strace", "-f", "-c", "-w", "-o", str(out), sys.executable, "-c",
                    SNIPPET, root, str(BLOCK), str(N), phase, "1" if batch else "0"],
                   check=True, env=env, capture_output=True)
    calls: dict[str, tuple[int, float]] = {}
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] in CALLS and parts[0][0].isdigit():
            seconds, count = float(parts[1]), int(parts[3])
            calls[parts[-1]] = (count, seconds)
    out.unlink()
    return calls


def minus(calls: dict[str, tuple[int, float]], base: dict[str, tuple[int, float]]
          ) -> dict[str, tuple[int, float]]:
    """Calls beyond the start-up's (imports, the store's own probes)."""
    out = {}
    for name, (count, seconds) in calls.items():
        b = base.get(name, (0, 0.0))
        if count - b[0] > 0:
            out[name] = (count - b[0], max(seconds - b[1], 0.0))
    return out


def main() -> None:
    from tests.glusterfs import GlusterUnavailable, gluster_volume

    if shutil.which("strace") is None:
        print("netfs_ops: skipped (no strace)")
        return
    try:
        with gluster_volume(Path(tempfile.mkdtemp(prefix="kvtier-bench-ops-")),
                            size_mib=3 * N * BLOCK // (1 << 20) + 256, mounts=1) as vol:
            for batch in (True, False):
                root = str(vol.mounts[0] / f"run-{int(batch)}")
                base = trace(root, "none", batch)
                stores = minus(trace(root, "store", batch), base)
                subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"],
                               check=False)
                loads = minus(trace(root, "load", batch), base)
                path = "batch (batchio)" if batch else "Python"
                print(f"\n### {path} path, {N} blocks of {BLOCK >> 10} KiB on GlusterFS: "
                      "calls per block, wall ms per call (16 threads in flight)")
                print("| call | per stored block | ms per call | per loaded block | "
                      "ms per call |\n|---|---|---|---|---|")
                for name in CALLS:
                    s, ld = stores.get(name), loads.get(name)
                    if not s and not ld:
                        continue
                    cells = []
                    for v in (s, ld):
                        cells += ([f"{v[0] / N:.2f}", f"{1000 * v[1] / v[0]:.2f}"] if v
                                  else ["-", "-"])
                    print(f"| {name} | " + " | ".join(cells) + " |")
    except GlusterUnavailable as err:
        print(f"netfs_ops: skipped ({err})")


if __name__ == "__main__":
    main()
