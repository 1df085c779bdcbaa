"""How full the volume is: statvfs bytes and inodes, or bytes against a fixed budget."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from kvtier_evictor.report import Usage

UsageSource = Callable[[], Usage]


def statvfs_usage(root: str) -> Usage:
    st = os.statvfs(root)
    # As df computes it: blocks reserved for root count neither as used nor as available.
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    capacity = used + st.f_bavail * st.f_frsize
    inodes_used = st.f_files - st.f_ffree
    return Usage(used_bytes=used, capacity_bytes=capacity,
                 used_inodes=max(inodes_used, 0), capacity_inodes=st.f_files)


def over(usage: Usage, bytes_pct: float, inode_pct: float) -> bool:
    return usage.percent > bytes_pct or (usage.capacity_inodes > 0
                                         and usage.inode_percent > inode_pct)


def _below(capacity: int, pct: float) -> int:
    """The largest amount strictly below pct of capacity."""
    return max(math.ceil(capacity * pct / 100) - 1, 0)


def to_free(usage: Usage, low_pct: float, inode_low_pct: float) -> tuple[int, int]:
    """(bytes, inodes) to delete to get strictly below both low watermarks."""
    want_bytes = usage.used_bytes - _below(usage.capacity_bytes, low_pct)
    want_inodes = 0
    if usage.capacity_inodes > 0:
        want_inodes = usage.used_inodes - _below(usage.capacity_inodes, inode_low_pct)
    return max(want_bytes, 0), max(want_inodes, 0)
