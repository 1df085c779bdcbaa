"""Which node directories a cache's local disk may use: only under the prefixes the kvtier
admin allows (Helm value localDisk.allowedHostPaths, the operator's env
KVTIER_ALLOWED_HOST_PATHS). A hostPath volume lets a pod write the node's filesystem, so
whoever may create a TieredPrefixCache must not choose any directory; the admin does.

Refused at the earliest point that knows the allowed list: the validating webhook and
`kvtier render --allow-host-path`; a cache that got in before the list changed injects
no pod and says why (the plan's refusal)."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier_operator.api import rules
from kvtier_operator.api.v1alpha1 import TieredPrefixCacheSpec


def parse_allowed(text: str | None) -> tuple[str, ...]:
    """KVTIER_ALLOWED_HOST_PATHS: comma-separated absolute directories; ValueError naming
    one that is not (the operator refuses to start rather than guess)."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if item:
            try:
                rules.HOST_PATH.check(item)
            except ValueError as err:
                raise ValueError(f"KVTIER_ALLOWED_HOST_PATHS (Helm value "
                                 f"localDisk.allowedHostPaths): {err}") from None
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
    if any(under(path, prefix) for prefix in allowed):
        return None
    shown = ", ".join(allowed) if allowed else "none"
    return (f"spec.localDisk.volume.hostPath.path {path} is not under a directory the "
            f"kvtier admin allows for local disks (Helm value localDisk.allowedHostPaths: "
            f"{shown}); use volume ephemeral or emptyDir, or ask the admin to allow it")
