"""A passthrough FUSE filesystem that answers every request late: a slow volume made by
the kernel's own FUSE path (each getattr, lookup, open, read and write of the mount goes
to this process and waits DELAY_MS before it is done on SOURCE), not by a preloaded shim
inside the engine. Runs in the foreground, multithreaded (requests wait side by side, as
on a network volume); unmount with `fusermount -u MOUNTPOINT` or by ending the process.

    python -m tests.e2e.delayed_fuse SOURCE MOUNTPOINT DELAY_MS

fusepy (PyPI) over Debian's libfuse2; `mounted()` in tests/e2e/injection.py starts it.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Any

from fuse import FUSE, FuseOSError, Operations


class Delayed(Operations):
    """Every operation on SOURCE, each after `delay` seconds (directory listings and
    statfs too: a volume that is slow is slow for everything)."""

    def __init__(self, source: str, delay: float) -> None:
        self.source = os.path.realpath(source)
        self.delay = delay

    def _path(self, path: str) -> str:
        time.sleep(self.delay)
        return os.path.join(self.source, path.lstrip("/"))

    def __call__(self, op: str, *args: Any) -> Any:
        try:
            return super().__call__(op, *args)
        except OSError as err:
            raise FuseOSError(err.errno or errno.EIO) from err

    def access(self, path: str, amode: int) -> None:
        if not os.access(self._path(path), amode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._path(path))
        return {key: getattr(st, key) for key in (
            "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime",
            "st_ctime", "st_blocks", "st_blksize")}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._path(path))
        return {key: getattr(st, key) for key in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")}

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._path(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._path(path))

    def unlink(self, path: str) -> None:
        os.unlink(self._path(path))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._path(old), os.path.join(self.source, new.lstrip("/")))

    def link(self, target: str, source: str) -> None:
        os.link(os.path.join(self.source, source.lstrip("/")), self._path(target))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._path(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._path(path), uid, gid)

    def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
        os.utime(self._path(path), times)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        os.truncate(self._path(path), length)

    def open(self, path: str, flags: int) -> int:
        # O_DIRECT is the mount's business, not the backing file's
        return os.open(self._path(path), flags & ~getattr(os, "O_DIRECT", 0))

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        time.sleep(self.delay)
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        time.sleep(self.delay)
        return os.pwrite(fh, data, offset)

    def flush(self, path: str, fh: int) -> None:
        return None

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        time.sleep(self.delay)
        os.fsync(fh)

    def release(self, path: str, fh: int) -> None:
        os.close(fh)


def main() -> None:
    source, mountpoint, delay_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
    # big_writes: the kernel sends writes of up to 128 KiB, not 4 KiB pages (this process
    # is the test's, its work per request is not the slowness under test)
    FUSE(Delayed(source, delay_ms / 1000), mountpoint, foreground=True, nothreads=False,
         allow_other=False, default_permissions=False, big_writes=True,
         max_write=131072, max_read=131072)


if __name__ == "__main__":
    main()
