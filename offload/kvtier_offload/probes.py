"""What a volume supports, found out once by trying: O_DIRECT, and how fast whole
block files are created, written, read and removed there."""

from __future__ import annotations

import mmap
import os
import time

ALIGN = 4096
PROBE_FILE_BYTES = 256 << 10


def probe_o_direct(directory: str) -> bool:
    """Whether files in directory accept O_DIRECT I/O (tmpfs, overlayfs and some NFS
    mounts refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".o_direct_probe.{os.getpid()}.tmp")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            return os.write(fd, buf) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def file_seconds(directory: str, o_direct: bool, files: int = 4) -> float | None:
    """Mean seconds to create and write, or to read, one 256 KiB file in directory (a few
    files, each written then read, removed afterwards); None where it cannot tell
    (read-only, full, missing)."""
    buf = mmap.mmap(-1, PROBE_FILE_BYTES)
    flag = os.O_DIRECT if o_direct else 0
    paths = [os.path.join(directory, f".speed_probe.{os.getpid()}.{i}.tmp")
             for i in range(files)]
    try:
        start = time.perf_counter()
        for path in paths:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | flag, 0o600)
            try:
                os.write(fd, buf)
            finally:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY | flag)
            try:
                os.readv(fd, [buf])
            finally:
                os.close(fd)
        return (time.perf_counter() - start) / (2 * len(paths))
    except OSError:
        return None
    finally:
        buf.close()
        for path in paths:  # the probe's files go whether it finished or not
            try:
                os.unlink(path)
            except OSError:
                pass
