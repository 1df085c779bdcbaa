"""A tiny real filesystem for ENOSPC and watermark tests, where mounting is permitted."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "64m", inodes: int | None = None) -> Iterator[Path]:
    """Mount a tmpfs of `size` at path (skips the test where that is not permitted)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def ext4(path: Path, size_mib: int = 64, inodes: int | None = None) -> Iterator[Path]:
    """Mount a fresh ext4 image of size_mib at path (loop device; no reserved blocks), so
    statvfs counts what a disk counts: file blocks and directory blocks. Skips the test
    where that is not permitted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop ext4 needs root")
    path.mkdir(parents=True, exist_ok=True)
    image = path.parent / f"{path.name}.ext4"
    subprocess.run(["truncate", "-s", f"{size_mib}M", str(image)], check=True)
    count = ["-N", str(inodes)] if inodes else []
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", *count, str(image)],
                          capture_output=True, text=True, check=False)
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop", str(image), str(path)], capture_output=True, text=True,
        check=False).returncode == 0
    if not mounted:
        image.unlink(missing_ok=True)
        pytest.skip(f"cannot make or loop-mount an ext4 image here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
        image.unlink(missing_ok=True)
