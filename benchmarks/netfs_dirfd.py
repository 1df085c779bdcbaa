"""Would opening a block relative to a held directory descriptor save brick requests on
GlusterFS? Loads (open + close) of N blocks in kvtier's two-level fan-out, by full path
vs openat() on an O_PATH descriptor of each block's leaf directory, once the FUSE
client's entry and attribute timeouts (1 s) have expired and once within them; requests
per block from the brick's `volume profile`.

    python -m benchmarks netfs_dirfd   (root, glusterfs-server; else it says why)
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.netfs_ops import Profile

N = int(os.environ.get("KVTIER_BENCH_OPS_BLOCKS", "512"))
SIZE = 8192  # the payload does not matter here: no read is made
FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
EXPIRED = 1.5  # seconds: past GlusterFS's FUSE entry and attribute timeouts


def main() -> None:
    from tests.glusterfs import GlusterUnavailable, _gluster, gluster_volume

    try:
        with gluster_volume(Path(tempfile.mkdtemp(prefix="kvtier-bench-dirfd-")),
                            size_mib=512, mounts=1) as vol:
            profile = Profile(lambda *a: _gluster(vol.base, *a), vol.name)
            run(profile, os.path.join(str(vol.mounts[0]), "kvtier", "v1", "0" * 16))
    except GlusterUnavailable as err:
        print(f"netfs_dirfd: skipped ({err})")


def run(profile: Profile, base: str) -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(N)]
    dirs = [os.path.join(base, k[:2], k[2:4]) for k in keys]
    data = os.urandom(SIZE)
    for directory, key in zip(dirs, keys, strict=True):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{key}.kvb"), "wb") as f:
            f.write(data)
    fds: dict[str, int] = {}

    def by_path() -> None:
        for directory, key in zip(dirs, keys, strict=True):
            os.close(os.open(os.path.join(directory, f"{key}.kvb"), FLAGS))

    def open_dirs() -> None:
        for directory in dirs:
            fds.setdefault(directory, os.open(directory, os.O_PATH | os.O_DIRECTORY))

    def by_fd() -> None:
        for directory, key in zip(dirs, keys, strict=True):
            os.close(os.open(f"{key}.kvb", FLAGS, dir_fd=fds[directory]))

    print(f"\n### {N} block opens on GlusterFS (kvtier's two-level fan-out): requests at "
          "the brick per block\n")
    print("| open | all | by request |\n|---|---|---|")

    def count(name: str, step: Callable[[], None], wait: float) -> None:
        time.sleep(wait)
        profile.take()
        step()
        calls = {fop: n / N for fop, (n, _) in profile.take().items() if n}
        print(f"| {name} | {sum(calls.values()):.2f} | "
              + ", ".join(f"{fop} {v:.2f}" for fop, v in sorted(calls.items())) + " |")

    try:
        count("by path, timeouts expired", by_path, EXPIRED)
        count("by path, within the timeouts", by_path, 0)
        count("opening the leaf directories' O_PATH fds", open_dirs, EXPIRED)
        count("openat(leaf fd), timeouts expired", by_fd, EXPIRED)
        count("openat(leaf fd), within the timeouts", by_fd, 0)
    finally:
        for fd in fds.values():
            os.close(fd)


if __name__ == "__main__":
    main()
