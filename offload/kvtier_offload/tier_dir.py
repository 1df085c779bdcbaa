"""Prepare the tier's own directory on a fresh shared volume for model servers that do not
run as root (`python -m kvtier_offload prepare-dir`, the opt-in init container
spec.storage.permissions.prepareDirectory renders).

A new volume's root usually belongs to root with mode 755, and where the CSI driver does
not apply the pod's fsGroup (docs/operations.md) nobody else may write it. This creates
the one directory the tier writes in (the mount itself, or one name below it), gives it
to the model servers' group and makes it group-writable with setgid (2775), so what the
engine creates inside inherits that group. Nothing inside is touched (no recursive chmod
of a volume that may hold terabytes of other pods' files), and no symlink is followed: a
name on the way that is a symlink fails the run (someone who can write the volume could
otherwise point it elsewhere and have root change that place).
"""

from __future__ import annotations

import errno
import os
import stat

TIER_DIR_MODE = 0o2775  # rwxrwsr-x: the group writes; new entries inherit the group
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PrepareError(Exception):
    """What could not be done, and what to do instead (said to the user)."""


def _names(relative: str) -> list[str]:
    names = [n for n in relative.split("/") if n]
    if any(n in (".", "..") for n in names) or relative.startswith("/"):
        raise PrepareError(f"--dir {relative[:80]!r} must be a relative path below the mount "
                           "without '.' or '..'")
    return names


def prepare(mount: str, relative: str, gid: int) -> str:
    """Create `<mount>/<relative>` ('' is the mount itself) one level at a time without
    following symlinks, then give the last directory to `gid` (its owner unchanged) with
    mode 2775. Returns the path; raises PrepareError saying why not."""
    if not 0 <= gid <= 2**31 - 1:
        raise PrepareError(f"--group {gid} is not a group id")
    names = _names(relative)
    try:
        fd = os.open(mount, _DIR_FLAGS)  # the mount as given: the administrator's choice
    except OSError as err:
        raise PrepareError(f"cannot open the volume at {mount}: {err.strerror}") from None
    path = mount.rstrip("/") or "/"
    try:
        for name in names:
            path = f"{path.rstrip('/')}/{name}"
            try:
                os.mkdir(name, TIER_DIR_MODE, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as err:
                what = ("is a symlink or not a directory"
                        if err.errno in (errno.ELOOP, errno.ENOTDIR) else err.strerror)
                raise PrepareError(f"{path} {what}: kvtier will not prepare it; remove it "
                                   "or let the tier write elsewhere") from None
            os.close(fd)
            fd = child
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise PrepareError(f"{path} is not a directory")
        try:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, TIER_DIR_MODE)
        except PermissionError as err:
            raise PrepareError(
                f"cannot give {path} to group {gid}: {err.strerror}. The volume refuses "
                "root's changes (NFS root squash, an EFS access point): let the storage "
                "map the writers instead (docs/operations.md) and turn prepareDirectory "
                "off") from None
    finally:
        os.close(fd)
    return path
