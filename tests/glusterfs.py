"""A throwaway single-brick GlusterFS volume, FUSE-mounted over TCP loopback: a real
network filesystem (every open, rename and stat is a round trip) that the test suite and
the benchmarks start and stop themselves.

    with gluster_volume(Path("/tmp/x")) as vol:
        vol.mounts[0], vol.mounts[1]   # two client mounts: two "nodes", own caches
        with vol.mount(Path("/tmp/x/c")) as third: ...

The brick lives on a small loop-mounted ext4 image, so statvfs on the mounts shows a
small volume (ENOSPC and watermark tests). glusterd runs in the foreground as our child
with its own working directory under the base path, so no state of it survives in
/var/lib/glusterd; files it and the brick leave in /var/log/glusterfs and /var/run/gluster
are removed on teardown (only those that appeared during our run). Where it cannot run
(no root, no FUSE, packages missing, a glusterd already running, glusterd failing),
GlusterUnavailable says why; `leftovers()` lists what a volume left behind (nothing).

Packages: Debian's glusterfs-server and glusterfs-client (`make test` installs them where
it runs as root with apt-get; see the Makefile's glusterfs-packages target).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

GLUSTERD_PORT = 24007
STATE_DIRS = (Path("/var/log/glusterfs"), Path("/var/run/gluster"))
PACKAGES = ("glusterfs-server", "glusterfs-client")
INSTALL_HINT = ("install Debian's glusterfs-server and glusterfs-client "
                "(make test does, as root)")


class GlusterUnavailable(RuntimeError):
    """A GlusterFS volume cannot be started here; the message says why."""


@dataclass
class GlusterVolume:
    name: str
    base: Path
    host: str
    brick: Path
    mounts: tuple[Path, ...]
    _extra: list[Path] = field(default_factory=list)

    @contextlib.contextmanager
    def mount(self, path: Path) -> Iterator[Path]:
        """One more client mount (another "node") for the duration of the block."""
        _mount_client(self.name, path, self.base)
        self._extra.append(path)
        try:
            yield path
        finally:
            _umount(path)
            self._extra.remove(path)

    def save_brick(self, image: Path) -> None:
        """Copy the brick's whole filesystem image to `image` (sparse), the volume
        stopped meanwhile: with restore_brick, the same tree for several runs (names,
        data, times, GlusterFS's own xattrs and gfid links) in seconds, where building
        a large tree again through FUSE takes minutes."""
        with self._offline():
            _run(["cp", "--sparse=always", str(self.base / "brick.img"), str(image)],
                 timeout=600)

    def restore_brick(self, image: Path) -> None:
        """Put back an image that save_brick took of this volume's brick."""
        with self._offline():
            _run(["cp", "--sparse=always", str(image), str(self.base / "brick.img")],
                 timeout=600)

    @contextlib.contextmanager
    def _offline(self) -> Iterator[None]:
        """The volume stopped, its client mounts and the brick unmounted; all back on
        exit, at the same paths."""
        clients = [*self.mounts, *self._extra]
        for path in clients:
            _umount(path)
        _gluster(self.base, "volume", "stop", self.name, "force")
        brick_mnt = self.brick.parent
        _umount(brick_mnt)
        try:
            yield
        finally:
            _run(["mount", "-o", "loop", str(self.base / "brick.img"), str(brick_mnt)])
            _gluster(self.base, "volume", "start", self.name, "force")
            for path in clients:
                _mount_client(self.name, path, self.base)


def unavailable_reason() -> str | None:
    """Why a volume cannot be started here, or None when it can be tried."""
    if os.geteuid() != 0:
        return "GlusterFS needs root (glusterd, loop devices, FUSE mounts)"
    missing = [b for b in ("glusterd", "gluster", "mount.glusterfs", "mkfs.ext4",
                           "losetup") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not found: {INSTALL_HINT}"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: the GlusterFS client is a FUSE filesystem"
    if _port_open(GLUSTERD_PORT):
        return f"a glusterd already listens on port {GLUSTERD_PORT}; not touching it"
    return None


@contextlib.contextmanager
def gluster_volume(base: Path, size_mib: int = 256, mounts: int = 2,
                   name: str | None = None,
                   bytes_per_inode: int | None = None) -> Iterator[GlusterVolume]:
    """Start glusterd, create and start a one-brick volume of about size_mib on a loop
    ext4 image under base, mount it `mounts` times; undo all of it on exit."""
    reason = unavailable_reason()
    if reason:
        shutil.rmtree(base, ignore_errors=True)  # the caller's scratch directory
        raise GlusterUnavailable(reason)
    name = name or f"kvtier{os.getpid()}"
    base.mkdir(parents=True, exist_ok=True)
    before = _state_files()
    undo: list = []
    try:
        host = _brick_host()
        image, brick_mnt = base / "brick.img", base / "brick"
        _run(["truncate", "-s", f"{size_mib}M", str(image)])
        undo.append(lambda: image.unlink(missing_ok=True))
        # Many small files need more inodes than ext4's default (one per 16 KiB); GlusterFS
        # adds a directory per gfid prefix of its own in the brick.
        inodes = ["-i", str(bytes_per_inode)] if bytes_per_inode else []
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", *inodes, str(image)])
        brick_mnt.mkdir(exist_ok=True)
        _run(["mount", "-o", "loop", str(image), str(brick_mnt)])
        undo.append(lambda: _umount(brick_mnt))
        brick = brick_mnt / "b"
        brick.mkdir()
        glusterd = _start_glusterd(base)
        undo.append(lambda: _stop(glusterd))
        _gluster(base, "volume", "create", name, f"{host}:{brick}", "force")
        undo.append(lambda: _gluster(base, "volume", "delete", name, check=False))
        _gluster(base, "volume", "start", name)
        undo.append(lambda: _gluster(base, "volume", "stop", name, "force", check=False))
        paths = []
        for i in range(mounts):
            path = base / f"node{'abcdefgh'[i]}"
            _mount_client(name, path, base)
            undo.append(lambda p=path: _umount(p))
            paths.append(path)
        vol = GlusterVolume(name, base, host, brick, tuple(paths))
        yield vol
    finally:
        for step in reversed(undo):
            with contextlib.suppress(Exception):
                step()
        _remove_new_state_files(before)
        shutil.rmtree(base, ignore_errors=True)


def leftovers(base: Path, name: str) -> list[str]:
    """What a finished volume left behind: mounts, processes, loop devices, files."""
    found = []
    mounts = Path("/proc/self/mounts").read_text()
    found += [f"mount {line.split()[1]}" for line in mounts.splitlines()
              if str(base) in line.split()[1] or line.split()[0].endswith(f":/{name}")]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "gluster" in cmd and (str(base) in cmd or name in cmd):
                found.append(f"process {pid}: {cmd.strip()}")
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    found += [f"loop {line}" for line in loops.splitlines() if str(base) in line]
    if base.exists():
        found.append(f"directory {base}")
    for d in STATE_DIRS:
        if d.exists():
            dashed = str(base).strip("/").replace("/", "-")  # how gluster names logs
            found += [f"file {p}" for p in d.rglob("*") if name in p.name or dashed in p.name]
    return found


def _run(cmd: list[str], check: bool = True, timeout: float = 60) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise GlusterUnavailable(f"{' '.join(cmd)} failed: "
                                 f"{(result.stderr or result.stdout).strip()}")
    return result.stdout


def _gluster(base: Path, *args: str, check: bool = True) -> str:
    return _run(["gluster", "--mode=script", f"--log-file={base}/cli.log", *args],
                check=check)


def _start_glusterd(base: Path) -> subprocess.Popen:
    workdir = base / "glusterd"
    workdir.mkdir(exist_ok=True)
    vol = base / "glusterd.vol"
    vol.write_text(
        "volume management\n"
        "    type mgmt/glusterd\n"
        f"    option working-directory {workdir}\n"
        "    option transport-type socket\n"
        f"    option transport.socket.listen-port {GLUSTERD_PORT}\n"
        "    option ping-timeout 0\n"
        "    option event-threads 1\n"
        "end-volume\n")
    proc = subprocess.Popen(["glusterd", "-N", "-f", str(vol), "-l",
                             str(base / "glusterd.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = (base / "glusterd.log").read_text(errors="replace")[-500:] \
                if (base / "glusterd.log").exists() else ""
            raise GlusterUnavailable(f"glusterd exited ({proc.returncode}): {log}")
        if _port_open(GLUSTERD_PORT) and subprocess.run(
                ["gluster", "--mode=script", f"--log-file={base}/cli.log", "pool",
                 "list"], capture_output=True).returncode == 0:
            return proc
        time.sleep(0.2)
    _stop(proc)
    raise GlusterUnavailable("glusterd did not answer within 30 s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _mount_client(name: str, path: Path, base: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    log = base / f"client-{path.name}.log"
    _run(["mount", "-t", "glusterfs", "-o", f"log-file={log}", f"127.0.0.1:/{name}",
          str(path)])
    deadline = time.monotonic() + 20  # the FUSE client connects in the background
    while not os.path.ismount(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not os.path.ismount(path):
        raise GlusterUnavailable(f"the GlusterFS client mount at {path} did not come up")


def _umount(path: Path) -> None:
    if os.path.ismount(path):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _brick_host() -> str:
    """glusterd refuses loopback brick addresses: use this machine's first address."""
    for cmd in (["hostname", "-I"], ["hostname", "-i"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            for addr in subprocess.run(cmd, capture_output=True, text=True).stdout.split():
                if not addr.startswith("127.") and addr != "::1" and ":" not in addr:
                    return addr
    raise GlusterUnavailable("no non-loopback IPv4 address for the brick")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _state_files() -> set[Path]:
    return {p for d in STATE_DIRS if d.exists() for p in d.rglob("*")}


def _remove_new_state_files(before: set[Path]) -> None:
    new = sorted(_state_files() - before, key=lambda p: len(p.parts), reverse=True)
    for p in new:
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink()


def main() -> None:
    """`python -m tests.glusterfs`: start a volume, print its mounts, wait for Enter."""
    import tempfile
    with gluster_volume(Path(tempfile.mkdtemp(prefix="kvtier-gluster-"))) as vol:
        print(f"volume {vol.name}: mounts {', '.join(map(str, vol.mounts))}; "
              "Enter stops it")
        input()


if __name__ == "__main__":
    main()
