"""Build cache trees of real files in the layouts the evictor knows."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvtier_evictor.lock import LOCK_NAME
from kvtier_evictor.report import Usage

FP = "0123456789abcdef"


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def kvtier_path(root: Path, i: int, fp: str = FP) -> Path:
    k = key(i)
    return root / "kvtier" / "v1" / fp / k[:2] / k[2:4] / f"{k}.kvb"


def vllm_fs_path(root: Path, i: int) -> Path:
    k = key(i)
    return root / "Qwen_Qwen3-0.6B_0123456789ab_r0" / k[:3] / f"{k[3:5]}_g0" / f"{k}.bin"


def sglang_path(root: Path, i: int, suffix: str = "_Qwen-Qwen3-0.6B_0_1") -> Path:
    """An SGLang HiCache file page: <sha256 hex><suffix>.bin, flat under sglang/."""
    return root / "sglang" / f"{key(i)}{suffix}.bin"


def write(path: Path, size: int, used_at: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x01" * size)
    os.utime(path, (used_at, used_at))
    return path


class FilesUsage:
    """Usage = allocated bytes (as statvfs counts them) of the files under root, against a fixed capacity: lets a
    test drive the watermarks exactly while the evictor deletes real files."""

    def __init__(self, root: Path, capacity: int, inodes: int = 10**6) -> None:
        self.root, self.capacity, self.inodes = root, capacity, inodes

    def __call__(self) -> Usage:
        total, count = 0, 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if name == LOCK_NAME:
                    continue  # the evictor's own lock: a few bytes, transient
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
                except FileNotFoundError:
                    continue  # renamed or deleted by a concurrent writer meanwhile
                count += 1
        return Usage(used_bytes=total, capacity_bytes=self.capacity,
                     used_inodes=count, capacity_inodes=self.inodes)
