"""Remove the CPU-tier regions a killed vLLM left in /dev/shm, before the next start.

vLLM's CPU tier backs its region with files in /dev/shm: `vllm_offload_<engine>.mmap`
(0.32), split since 0.33 into up to 32 segments of at least 1 GiB each (`.mmap`,
`.mmap.1`, ...). It unlinks them once every worker has mapped them; an engine killed
before that (OOM, SIGKILL during start) leaves them behind. In a pod, /dev/shm is a
memory-backed emptyDir that outlives a container restart: the leftovers count against
the pod's memory and fill /dev/shm, and the restarted engine fails its free-space check
or is OOM-killed again (vllm #51317). The usual hand fix, `rm /dev/shm/vllm_offload_*.mmap`,
misses 0.33's segments and would remove a region a live engine still uses.

`sweep` removes only files whose names are vLLM's region pattern, that are regular files
directly in the directory (no symlinks followed), and that no process this one can see
has mapped or open (matched by device and inode through /proc/<pid>/maps and
/proc/<pid>/fd). A process whose maps it may not read (not dumpable, another user without
CAP_SYS_PTRACE: never a vLLM worker of the container's own user) is skipped and counted
in the summary. The work is bounded: at most MAX_PROCESSES processes, MAX_MAPS_BYTES of
each maps file and MAX_CANDIDATES names are read; past a bound it removes nothing.

Removing a name never takes memory from a process that maps it (the mapping lives until
unmapped; vLLM unlinks its own names once all workers have mapped them). The one thing a
wrong removal could break is a worker that has not yet opened its engine's region while
another creates it, which is why regions in use are found and kept.

Run before the engine starts, in its container (`python -m kvtier_offload sweep-shm --
CMD...` sweeps, then execs CMD): it sees the processes of that container, which are the
only ones that map the engine's /dev/shm.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger("kvtier_offload")

SHM_DIR = "/dev/shm"
# vLLM's region: vllm_offload_<engine id>.mmap, and 0.33's segments .mmap.<n>
REGION_NAME = re.compile(r"vllm_offload_[^/\x00]{1,200}\.mmap(?:\.[0-9]{1,3})?")
MAX_PROCESSES = 65_536
MAX_MAPS_BYTES = 64 << 20
MAX_CANDIDATES = 4096
MAX_FDS = 1 << 20


@dataclass
class SweepReport:
    removed: list[str] = field(default_factory=list)
    removed_bytes: int = 0
    in_use: list[str] = field(default_factory=list)  # mapped or open by a live process
    uninspected: list[str] = field(default_factory=list)  # pids whose maps it may not read
    kept_reason: str = ""  # set where nothing was removed on purpose
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.kept_reason:
            return f"kept every region file: {self.kept_reason}"
        parts = [f"removed {len(self.removed)} stale region file(s), "
                 f"{self.removed_bytes / 2**30:.2f} GiB"]
        if self.in_use:
            parts.append(f"kept {len(self.in_use)} in use")
        if self.uninspected:
            parts.append(f"{len(self.uninspected)} process(es) not inspectable (pid "
                         f"{', '.join(self.uninspected[:5])})")
        if self.errors:
            parts.append(f"{len(self.errors)} error(s): {'; '.join(self.errors[:3])}")
        return ", ".join(parts)


class Uninspectable(RuntimeError):
    """Past a bound: more processes, descriptors or maps lines than the sweep reads."""


def candidates(directory: str) -> dict[tuple[int, int], tuple[str, int]]:
    """(st_dev, st_ino) -> (name, size) of the regular files in directory named like a
    vLLM region (never following a symlink); at most MAX_CANDIDATES."""
    found: dict[tuple[int, int], tuple[str, int]] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if not REGION_NAME.fullmatch(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[(st.st_dev, st.st_ino)] = (entry.name, st.st_blocks * 512)
            if len(found) >= MAX_CANDIDATES:
                break
    return found


def _pids(proc: str) -> Iterator[str]:
    count = 0
    with os.scandir(proc) as entries:
        for entry in entries:
            if entry.name.isdigit():
                count += 1
                if count > MAX_PROCESSES:
                    raise Uninspectable(f"more than {MAX_PROCESSES} processes")
                yield entry.name


def _mapped(maps_path: str) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of the files a process maps, from its maps file."""
    files: set[tuple[int, int]] = set()
    read = 0
    with open(maps_path, "rb") as maps:
        for line in maps:
            read += len(line)
            if read > MAX_MAPS_BYTES:
                raise Uninspectable(f"{maps_path} is larger than {MAX_MAPS_BYTES} bytes")
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) < 5 or fields[4] == b"0":
                continue
            major, _, minor = fields[3].partition(b":")
            files.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    return files


def _open_files(fd_dir: str) -> set[tuple[int, int]]:
    held: set[tuple[int, int]] = set()
    for count, name in enumerate(os.listdir(fd_dir)):
        if count > MAX_FDS:
            raise Uninspectable(f"{fd_dir} holds more than {MAX_FDS} descriptors")
        try:
            st = os.stat(os.path.join(fd_dir, name))
        except OSError:
            continue  # closed meanwhile, or a socket/pipe/anon inode without a path
        held.add((st.st_dev, st.st_ino))
    return held


def in_use(wanted: set[tuple[int, int]], proc: str = "/proc",
           uninspected: list[str] | None = None) -> set[tuple[int, int]]:
    """Which of the files (st_dev, st_ino) a live process maps or holds open; the pids
    it may not read go to uninspected. Raises Uninspectable past a bound."""
    busy: set[tuple[int, int]] = set()
    for pid in _pids(proc):
        base = os.path.join(proc, pid)
        try:
            mapped = _mapped(os.path.join(base, "maps"))
            held = _open_files(os.path.join(base, "fd"))
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        except PermissionError:
            if uninspected is not None:
                uninspected.append(pid)
            continue
        busy |= wanted & (mapped | held)
    return busy


def sweep(directory: str = SHM_DIR, proc: str = "/proc") -> SweepReport:
    """Remove the stale vLLM region files in directory (see the module's doc)."""
    report = SweepReport()
    try:
        found = candidates(directory)
    except FileNotFoundError:
        report.kept_reason = f"{directory} does not exist"
        return report
    if not found:
        return report
    try:
        busy = in_use(set(found), proc, report.uninspected)
    except Uninspectable as err:
        report.kept_reason = f"cannot tell which regions are in use ({err})"
        return report
    for key, (name, size) in sorted(found.items(), key=lambda kv: kv[1][0]):
        path = os.path.join(directory, name)
        if key in busy:
            report.in_use.append(name)
            continue
        try:
            st = os.stat(path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != key:
                continue  # replaced since the scan: not the file judged stale
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as err:
            report.errors.append(f"{name}: {err.strerror}")
            continue
        report.removed.append(name)
        report.removed_bytes += size
    return report
