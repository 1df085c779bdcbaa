"""Free space in the fewest files: on a real disk filesystem (loop ext4) a tree of small
files, where a file's directory takes as many blocks as the file, is driven from above
the high to below the low watermark deleting no more files than needed."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from kvtier_evictor.evict import Config, Run
from kvtier_evictor.layouts import KVTIER
from tests.evictor.tree import kvtier_path
from tests.mounts import ext4

pytestmark = pytest.mark.privileged
BLOCK = 4096


def used_percent(root: Path) -> float:
    st = os.statvfs(root)
    used = st.f_blocks - st.f_bfree
    return 100 * used / (used + st.f_bavail)


def fewest_needed(files: list[Path], blocks: dict[Path, int], need: int) -> int:
    """The fewest of `files` (oldest first) whose blocks and those of the directories
    they leave empty (leaf and the one above; all older than the guard) reach `need`;
    blocks: the bytes each file and directory took before the run."""
    left: dict[Path, int] = {}
    for f in files:
        left[f.parent] = left.get(f.parent, 0) + 1
    for d in list(left):
        left[d.parent] = left.get(d.parent, 0) + 1
    freed = 0
    for n, f in enumerate(files, 1):
        freed += blocks[f]
        d = f.parent
        while d in left:
            left[d] -= 1
            if left[d]:
                break
            freed += blocks[d]
            d = d.parent
        if freed >= need:
            return n
    raise AssertionError("the tree cannot reach the target")


@pytest.mark.slow
def test_deletes_no_more_files_than_needed_on_a_tree_of_small_files(tmp_path):
    with ext4(tmp_path / "vol", size_mib=64, inodes=32768) as vol:
        now = time.time()
        files: list[Path] = []  # oldest first
        while used_percent(vol) < 88:
            for _ in range(100):
                path = kvtier_path(vol, len(files))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"\x01" * BLOCK)
                files.append(path)
        for i, path in enumerate(files):
            used = now - 10**6 + 60 * i
            os.utime(path, (used, used))
        dirs = {p for f in files for p in (f.parent, f.parent.parent)}
        for d in dirs:
            os.utime(d, (now - 7200, now - 7200))  # before the run: older than the guard
        blocks = {p: os.stat(p).st_blocks * 512 for p in (*files, *dirs)}
        leaves = len({f.parent for f in files})
        assert leaves > len(files) * 0.8  # most files have a directory of their own

        config = Config(root=str(vol), layout=KVTIER, high_watermark=85, low_watermark=70)
        report = Run(config).execute()

        before = report.usage_before
        assert before.percent > 85
        need = before.used_bytes - (math.ceil(before.capacity_bytes * 70 / 100) - 1)
        fewest = fewest_needed(files, blocks, need)
        assert used_percent(vol) < 70 and report.outcome == "freed", report
        gone = [not f.exists() for f in files]
        assert gone == sorted(gone, reverse=True), "not the least recently used files"
        assert report.files_deleted <= fewest * 1.01, (
            f"{report.files_deleted} files deleted where {fewest} reach the target")
        assert report.files_deleted >= fewest * 0.99
        assert abs(report.files_minimum - fewest) <= fewest * 0.01
        assert report.dirs_removed >= report.files_deleted * 0.8
        assert report.dir_bytes_freed == sum(blocks[d] for d in dirs if not d.exists())
