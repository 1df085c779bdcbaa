"""Which node directories a cache's local disk may use: exactly one of the directories the
kvtier admin allows (Helm value localDisk.allowedHostPaths, the operator's env
KVTIER_ALLOWED_HOST_PATHS). A hostPath volume lets a pod write the node's filesystem, so
whoever may create a TieredPrefixCache must not choose any directory; the admin does.

Exactly, not "under": each cache mounts `<allowed>/<namespace>/<name>`, which its model
server can write. Were a path below an allowed directory accepted, one cache could name
a directory inside another's (its own pods may plant a symlink there, which the kubelet
follows to the node's root), or another namespace's (`<allowed>/<victim namespace>` as
the path, its own name as the victim's). With the path one of the allowed directories,
which never nest, every cache's directory is `<allowed>/<its namespace>/<its name>`:
one per cache in the cluster, and no pod can write above its own.

Refused at the earliest point that knows the allowed list: the validating webhook and
`kvtier render --allow-host-path`; a cache that got in before the list changed injects
no pod and says why (the plan's refusal)."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier_operator.api import rules
from kvtier_operator.api.v1alpha1 import TieredPrefixCacheSpec


def parse_allowed(text: str | None) -> tuple[str, ...]:
    """KVTIER_ALLOWED_HOST_PATHS: comma-separated absolute directories, none inside another;
    ValueError naming one that is not (the operator refuses to start rather than guess)."""
    out: list[str] = []
    for item in (text or "").split(","):
        item = item.strip()
        if item:
            try:
                rules.HOST_PATH.check(item)
            except ValueError as err:
                raise ValueError(f"KVTIER_ALLOWED_HOST_PATHS (Helm value "
                                 f"localDisk.allowedHostPaths): {err}") from None
            nested = [other for other in out if under(item, other) or under(other, item)]
            if nested:
                raise ValueError(f"KVTIER_ALLOWED_HOST_PATHS (Helm value localDisk."
                                 f"allowedHostPaths): {item} and {nested[0]} nest; list "
                                 "directories none of which is inside another (a cache's "
                                 "directory under one could be another's path)")
            out.append(item)
    return tuple(out)


def under(path: str, prefix: str) -> bool:
    """Whether path is prefix or inside it, by whole segments (/mnt/nvme2 is not under
    /mnt/nvme)."""
    return path == prefix or path.startswith(prefix + "/")


def host_path_refusal(spec: TieredPrefixCacheSpec, allowed: Iterable[str]) -> str | None:
    disk = spec.local_disk
    if disk is None or disk.volume.host_path is None:
        return None
    path = disk.volume.host_path.path
    allowed = tuple(allowed)
    if path in allowed:
        return None
    shown = ", ".join(allowed) if allowed else "none"
    return (f"spec.localDisk.volume.hostPath.path {path} is not one of the directories the "
            f"kvtier admin allows for local disks (Helm value localDisk.allowedHostPaths: "
            f"{shown}; a cache gets <path>/<namespace>/<name> below it, so name the allowed "
            "directory itself); use volume ephemeral or emptyDir, or ask the admin to "
            "allow it")
