"""Helpers shared by the benchmarks."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def scratch_dir(size: str, prefix: str, inodes: str | None = None) -> Iterator[tuple[str, str]]:
    """A tmpfs of `size` where mounting is permitted, else a temp dir on disk;
    yields (path, description)."""
    path = tempfile.mkdtemp(prefix=prefix)
    mounted = False
    if os.geteuid() == 0:
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                                 capture_output=True, check=False).returncode == 0
    try:
        yield path, ("tmpfs" if mounted else "disk (temp dir)")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", path], check=False)
        shutil.rmtree(path, ignore_errors=True)
