"""Deleting below the volume root through opened directories, never through paths.

A path names a file only while no directory on it is replaced. Between the scan and the
unlink, a writer on the volume could swap a fan-out directory for a symlink, and an
unlink by path would then delete the same-named file wherever the symlink points. Here
every directory below the root is opened with O_NOFOLLOW, one level at a time, relative
to the one above it, and the caller re-checks and unlinks the file relative to the last
one: whatever is swapped meanwhile, only a name inside the real directory tree under the
root can be removed. The root itself is opened as given (a root that is a symlink is the
administrator's choice, and is followed).

Directories below the root are opened with O_PATH where the platform has it: a name
lookup only, no open of the directory itself (on a FUSE or network filesystem an
OPENDIR/RELEASEDIR round trip pair saved per directory). Such an fd serves as dir_fd for
fstatat, unlinkat and rmdir, which is all it is used for; O_DIRECTORY with O_NOFOLLOW
still refuses a symlink in the directory's place (ENOTDIR).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Below the root: a handle for *at() calls, not for reading (see the module docstring).
_BELOW_FLAGS = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC \
    | os.O_NOFOLLOW
# errnos of opening a directory with O_NOFOLLOW when something else stands there now
REPLACED = frozenset({errno.ELOOP, errno.ENOTDIR})


class Root:
    """The volume root, opened once; paths the scan found under it, split into the names
    below it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, _DIR_FLAGS)

    def names(self, path: str) -> list[str]:
        """The names below the root along a path the scan built from it (os.path.join
        of the root and names: it starts with the root, as given)."""
        rest = path[len(self.path):]
        if not path.startswith(self.path) or not (self.path.endswith("/")
                                                  or rest.startswith("/")):
            raise ValueError(f"{path} is not below {self.path}")
        names = [name for name in rest.split("/") if name]
        if not names or any(name in (".", "..") for name in names):
            raise ValueError(f"{path} does not name an entry below {self.path}")
        return names

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirChain:
    """The open directories along one path below the root, kept while the next path
    shares them: visit directories in sorted order and each is opened once (the caller
    groups its work by directory). One thread's; close() when done.

    open() raises OSError: FileNotFoundError where a directory is gone, an errno in
    REPLACED where a symlink or a file stands in its place now."""

    def __init__(self, root: Root) -> None:
        self._root = root
        self._names: list[str] = []
        self._fds: list[int] = []

    def open(self, names: Sequence[str]) -> int:
        """An fd of the directory root/names[0]/names[1]/..., each opened below the one
        above it without following a symlink."""
        shared = 0
        while (shared < len(self._names) and shared < len(names)
               and self._names[shared] == names[shared]):
            shared += 1
        self._close_from(shared)
        parent = self._fds[-1] if self._fds else self._root.fd
        for name in names[shared:]:
            parent = os.open(name, _BELOW_FLAGS, dir_fd=parent)
            self._names.append(name)
            self._fds.append(parent)
        return parent

    def _close_from(self, level: int) -> None:
        while len(self._fds) > level:
            os.close(self._fds.pop())
            self._names.pop()

    def close(self) -> None:
        self._close_from(0)

    def __enter__(self) -> DirChain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
