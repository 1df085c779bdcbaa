"""Slowness made for real, for the recompute-bound comparisons (#37): each a context manager
that starts what it needs, yields, and removes it all in `finally`; where it cannot run
here it raises Unavailable with the reason (the tests skip with it).

- delayed_fuse: a passthrough FUSE mount whose every reply waits (tests/e2e/delayed_fuse.py);
- netem_on_port: `tc netem` delay on loopback, ONLY for TCP traffic to or from one port (a
  prio qdisc whose extra band holds the netem, u32 filters on that port); other traffic
  on `lo` keeps the default bands;
- writer: a process streaming large files with fsync into a directory (a busy volume);
- cpu_hogs: processes that spin on the cores.

Processes are ended by their own ids; nothing here touches another process or any
machine-wide setting but the one port's filter.

    python -m tests.e2e.injection write DIR FILE_MIB    (the writer's own loop)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import ROOT


class Unavailable(RuntimeError):
    """This slowness cannot be made here; the message says why."""


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


@contextlib.contextmanager
def delayed_fuse(source: Path, mountpoint: Path, delay_ms: float) -> Iterator[Path]:
    """source seen through mountpoint, every FUSE request answered delay_ms late."""
    if not Path("/dev/fuse").exists():
        raise Unavailable("no /dev/fuse")
    try:
        import fuse  # noqa: F401 (fusepy: loads libfuse.so.2 when imported)
    except (ImportError, OSError) as err:
        raise Unavailable(f"fusepy over libfuse2 not importable: {err}") from err
    mountpoint.mkdir(parents=True, exist_ok=True)
    proc = _start([sys.executable, "-m", "tests.e2e.delayed_fuse", str(source),
                   str(mountpoint), str(delay_ms)])
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
                raise Unavailable(f"the FUSE mount did not come up: {err}")
            time.sleep(0.05)
        yield mountpoint
    finally:
        if os.path.ismount(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], check=False,
                           capture_output=True, timeout=30)
        _end(proc)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], check=check, capture_output=True, text=True,
                          timeout=30)


def _probe_qdiscs() -> None:
    """Whether this kernel has the prio and netem qdiscs, tried on the loopback of a
    network namespace of our own (never on the machine's): a kernel built without
    sch_netem (as some VM kernels are) refuses the kind."""
    if shutil.which("unshare") is None:
        return  # tried on the device itself, below
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", "ip link set lo up && "
         "tc qdisc add dev lo root handle 1: prio bands 4 && "
         "tc qdisc add dev lo parent 1:4 handle 40: netem delay 1ms"],
        capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        raise Unavailable("sch_netem (or sch_prio) is not available in this kernel "
                          f"({os.uname().release}): {probe.stderr.strip()}")


@contextlib.contextmanager
def netem_on_port(port: int, delay_ms: float, device: str = "lo") -> Iterator[None]:
    """TCP traffic on device to or from port delayed by delay_ms each way; nothing else.
    Needs root, tc, the prio and netem qdiscs, and device's root qdisc to be the default
    (another's shaping is never replaced)."""
    if shutil.which("tc") is None:
        raise Unavailable("no tc (Debian's iproute2)")
    _probe_qdiscs()
    shown = _tc("qdisc", "show", "dev", device, check=False)
    if shown.returncode != 0:
        raise Unavailable(f"tc cannot read {device}'s qdiscs: {shown.stderr.strip()}")
    root = shown.stdout.splitlines()[0] if shown.stdout else ""
    if " root " in root and not root.startswith(("qdisc noqueue", "qdisc pfifo_fast",
                                                 "qdisc fq_codel", "qdisc mq")):
        raise Unavailable(f"{device} already has a root qdisc of someone else's: {root}")
    added = _tc("qdisc", "add", "dev", device, "root", "handle", "1:", "prio", "bands", "4",
                check=False)
    if added.returncode != 0:
        raise Unavailable(f"cannot add a prio qdisc on {device}: {added.stderr.strip()}")
    try:
        netem = _tc("qdisc", "add", "dev", device, "parent", "1:4", "handle", "40:", "netem",
                    "delay", f"{delay_ms}ms", check=False)
        if netem.returncode != 0:
            raise Unavailable(f"sch_netem is not available: {netem.stderr.strip()}")
        for match in ("dport", "sport"):
            _tc("filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio",
                "1", "u32", "match", "ip", match, str(port), "0xffff", "flowid", "1:4")
        yield
    finally:
        _tc("qdisc", "del", "dev", device, "root", "handle", "1:", check=False)


@contextlib.contextmanager
def writer(directory: Path, file_mib: int = 128) -> Iterator[None]:
    """A process writing file_mib files into directory, fsync'ed, one after another."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = _start([sys.executable, "-m", "tests.e2e.injection", "write", str(directory),
                   str(file_mib)])
    try:
        deadline = time.monotonic() + 20
        while not any(directory.iterdir()):  # writing
            if proc.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"the writer did not start writing into {directory}")
            time.sleep(0.05)
        yield
    finally:
        _end(proc)
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def cpu_hogs(count: int = 2) -> Iterator[None]:
    """count processes spinning on the CPU."""
    hogs = [_start([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            _end(hog)


def _write_forever(directory: Path, file_mib: int) -> None:
    chunk = os.urandom(4 << 20)
    n = 0
    while True:  # one file rewritten: the volume holds file_mib of it at most
        path = directory / "stream.bin"
        with open(path, "wb") as out:
            for _ in range(max(1, file_mib // 4)):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        n += 1


def main() -> None:
    if sys.argv[1] == "write":
        _write_forever(Path(sys.argv[2]), int(sys.argv[3]))


if __name__ == "__main__":
    main()
