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

import os
import stat

from kvtier_offload import native

AT_FDCWD = -100  # Linux: "the current directory", for the *at calls
DIR_FLAGS = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW \
    | os.O_CLOEXEC


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
            made = False
            try:
                os.mkdir(name, mode, dir_fd=at)
                made = True
            except FileExistsError:
                pass
            except OSError:
                # a read-only or foreign mount may say EROFS/EACCES for one that is there
                st = os.stat(name, dir_fd=at, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise
            child = os.open(name, DIR_FLAGS, dir_fd=at)
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
