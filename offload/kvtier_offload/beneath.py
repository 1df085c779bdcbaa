"""Paths on the volume resolved beneath its root, never through a symlink at any level.

Anyone who can write the shared volume can replace a fan-out directory (`<fp>/ab`), or
the fingerprint directory, with a symlink to another place the pod can reach (its /tmp,
/dev/shm, another volume). A plain open of `<root>/.../ab/cd/<key>.kvb` follows it: the
pod would then write its blocks there, filling that place, and read from it. Here every
block path is relative to an fd of the volume root (opened as given: the mount is the
administrator's choice) and resolved beneath it with no symlink followed: openat2
(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) through the C extension, or one level at a time
with O_NOFOLLOW where it is not loaded. A symlink on the way fails the call (ELOOP,
ENOTDIR or EXDEV): the block is a miss or a failed store, vLLM recomputes.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from typing import TypeVar

from kvtier_offload import native

T = TypeVar("T")

AT_FDCWD = -100  # Linux: "the current directory", for the *at calls
DIR_FLAGS = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW \
    | os.O_CLOEXEC
# What a network filesystem may answer a create for a moment while another node makes or
# replaces the same names (GlusterFS: ENOENT for a directory the other node's mkdir is
# making, ESTALE for a name its cache still points at the old inode of).
RACING = (errno.ENOENT, errno.ESTALE)


# How often a racing mkdir or open is tried in all, and the pause before each retry
# (GlusterFS, while the other node looked the same names up: see _made_and_opened). At
# most about 0.1 s, on a store thread only.
RACE_PAUSES = (0.0, 0.005, 0.02, 0.08)


def again_while_racing(attempt: Callable[[], T], refresh: Callable[[], object]) -> T:
    """attempt(), and while it fails with ENOENT or ESTALE (RACING), refresh() (a stat by
    name: the kernel then looks the name up afresh; its own errors ignored) and attempt()
    again after a short pause, len(RACE_PAUSES) tries in all: the last answer stands."""
    for pause in RACE_PAUSES[:-1]:
        if pause:
            time.sleep(pause)
        try:
            return attempt()
        except OSError as err:
            if err.errno not in RACING:
                raise
        try:
            refresh()
        except OSError:
            pass
    time.sleep(RACE_PAUSES[-1])
    return attempt()


def _walk(dirfd: int, rel: str, flags: int, mode: int) -> int:
    names = rel.split("/")
    if not names[-1] or any(name in ("", ".", "..") for name in names[:-1]):
        raise OSError(18, f"not a path below the volume: {rel!r}")  # EXDEV
    at = dirfd
    try:
        for name in names[:-1]:
            child = os.open(name, DIR_FLAGS, dir_fd=at)
            if at != dirfd:
                os.close(at)
            at = child
        return os.open(names[-1], flags | os.O_NOFOLLOW, mode, dir_fd=at)
    finally:
        if at != dirfd:
            os.close(at)


def open_beneath(dirfd: int, rel: str, flags: int, mode: int = 0o664) -> int:
    """os.open of rel beneath dirfd with no symlink followed at any level; OSError."""
    if native.module is not None:
        return int(native.module.open_beneath(dirfd, os.fsencode(rel), flags, mode))
    return _walk(dirfd, rel, flags, mode)


def lstat_beneath(dirfd: int, rel: str) -> os.stat_result:
    """os.stat(rel, follow_symlinks=False), its directories resolved beneath dirfd with no
    symlink followed."""
    parent, _, name = rel.rpartition("/")
    if not parent:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    fd = open_beneath(dirfd, parent, DIR_FLAGS)
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def parent_beneath(dirfd: int, rel: str) -> tuple[int, str]:
    """(an O_PATH fd of rel's directory, rel's last name): the caller closes the fd."""
    parent, _, name = rel.rpartition("/")
    if not parent:
        return os.dup(dirfd), name
    return open_beneath(dirfd, parent, DIR_FLAGS), name


def makedirs_beneath(dirfd: int, rel: str, mode: int) -> None:
    """Every directory of rel beneath dirfd, made where missing with exactly mode
    (whatever the umask); a symlink or a file in a directory's place raises OSError."""
    at = dirfd
    try:
        for name in rel.split("/"):
            if name in ("", ".", ".."):
                raise OSError(18, f"not a path below the volume: {rel!r}")
            child, made = _made_and_opened(at, name, mode)
            if at != dirfd:
                os.close(at)
            at = child
            if made:
                try:
                    os.chmod(f"/proc/self/fd/{at}", mode)
                except OSError:
                    pass  # some filesystems ignore modes; nothing depends on it locally
    finally:
        if at != dirfd:
            os.close(at)


def _made_and_opened(dirfd: int, name: str, mode: int) -> tuple[int, bool]:
    """(an O_PATH fd of directory name in dirfd, whether it was made here): made where
    missing. The mkdir and the open are tried together again where either met ENOENT or
    ESTALE (another node making the same directory: again_while_racing): a fresh CI run's
    GlusterFS answered a fan-out directory's mkdir EEXIST while a reader on the other
    node looked the name up, then ENOENT to every open of it for 0.1 s; the next mkdir
    made it."""
    made = False

    def look() -> os.stat_result:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)

    def mkdir_and_open() -> int:
        nonlocal made
        made = _mkdir_at(dirfd, name, mode) or made
        return os.open(name, DIR_FLAGS, dir_fd=dirfd)

    return again_while_racing(mkdir_and_open, look), made


def _mkdir_at(dirfd: int, name: str, mode: int) -> bool:
    """mkdir name in dirfd: True where made, False where a directory is there already."""
    try:
        os.mkdir(name, mode, dir_fd=dirfd)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno in RACING:
            raise
        # a read-only or foreign mount may say EROFS/EACCES for one that is there
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise
        return False
