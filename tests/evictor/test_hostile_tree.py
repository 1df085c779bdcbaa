"""The evictor against a hostile writer on the volume: names that only look like the
layout (a trailing newline), and directories or files swapped between scan and unlink.

The swaps happen deterministically at the seam between scan and deletion: a Run whose
_reap_temps (the first deletion step, after the scan) swaps first.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvtier_evictor.evict import Config, Run
from kvtier_evictor.layouts import KVTIER, LMCACHE, VLLM_FS, Kind
from tests.evictor.test_evictor import NOW, U, lru_tree, make_run
from tests.evictor.tree import FP, FilesUsage, key, kvtier_path, vllm_fs_path, write

ANCIENT = NOW - 10**6


@pytest.mark.parametrize("name", [f"{key(1)}.kvb", f".{key(1)}.kvb.deadbeef.tmp", "kvtier",
                                  "v1", FP, "ab"])
def test_layout_patterns_match_whole_names_only(name):
    level = {"kvtier": 0, "v1": 1, FP: 2, "ab": 3}.get(name)
    if level is None:
        assert KVTIER.classify(name) in (Kind.BLOCK, Kind.TEMP)
        assert KVTIER.classify(name + "\n") is None
        assert KVTIER.classify(name + "\nx") is None
    else:
        assert KVTIER.dir_matches(level, name)
        assert not KVTIER.dir_matches(level, name + "\n")
        assert not KVTIER.dir_levels[level].match(name + "\n")  # even through re.match
    assert VLLM_FS.classify(f"{key(1)}.bin\n") is None
    assert LMCACHE.classify("model@1@0@abc@bfloat16.pt\n") is None
    assert not VLLM_FS.dir_matches(0, "m_0123456789ab_r\u0661")  # a non-ASCII digit


def test_names_ending_in_a_newline_are_never_deleted(tmp_path):
    lru_tree(tmp_path)
    block = kvtier_path(tmp_path, 20)
    hostile = [
        write(block.with_name(block.name + "\n"), U, ANCIENT),
        write(block.parent / f".{key(20)}.kvb.deadbeef.tmp\n", U, ANCIENT),
        write(tmp_path / "kvtier\n" / "v1" / FP / "ab" / "cd" / f"{key(21)}.kvb", U, ANCIENT),
        write(tmp_path / "kvtier" / "v1" / FP / "ab\n" / "cd" / f"{key(22)}.kvb", U, ANCIENT),
        write(tmp_path / "kvtier" / "v1" / f"{FP}\n" / "ab" / "cd" / f"{key(23)}.kvb", U,
              ANCIENT),
    ]
    empty = tmp_path / "kvtier" / "v1" / FP / "ab" / "ee\n"
    empty.mkdir(parents=True)
    os.utime(empty, (ANCIENT, ANCIENT))
    # The hostile names are the oldest: a run that took them for blocks would pick them
    # first. 15 files in 8 units of capacity: to get below 70%, all 10 blocks must go.
    dirs_before = {p for p in tmp_path.rglob("*") if p.is_dir()}
    report = make_run(tmp_path, capacity=8 * U).execute()
    assert report.files_deleted == 10
    assert all(p.exists() for p in hostile), "a name outside the layout was deleted"
    assert empty.is_dir()
    assert report.temp_files_reaped == 0
    removed = dirs_before - {p for p in tmp_path.rglob("*") if p.is_dir()}
    assert all("\n" not in str(p) for p in removed)  # only the layout's, emptied by the run
    assert report.dirs_removed == len(removed)


def test_vllm_fs_and_lmcache_names_ending_in_a_newline_are_kept(tmp_path):
    files = [write(vllm_fs_path(tmp_path, i), U, ANCIENT) for i in range(4)]
    hostile = write(files[0].with_name(files[0].name + "\n"), U, ANCIENT)
    report = make_run(tmp_path, capacity=2 * U, layout=VLLM_FS).execute()
    assert report.files_deleted == 4 and hostile.exists()
    lm = [write(tmp_path / "lm" / "lmcache" / f"f{i}.pt", U, ANCIENT) for i in range(4)]
    hostile = write(tmp_path / "lm" / "lmcache" / "f9.pt\n", U, ANCIENT)
    report = make_run(tmp_path / "lm", capacity=2 * U, layout=LMCACHE).execute()
    assert report.files_deleted == 4 and hostile.exists() and not any(f.exists() for f in lm)


class SwappingRun(Run):
    """A Run that lets a writer change the tree after the scan, before any deletion."""

    def __init__(self, *args, swap, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.swap = swap

    def _reap_temps(self, temps):  # the first deletion step, after the scan
        self.swap()
        super()._reap_temps(temps)


def swapping_run(root: Path, capacity: int, swap) -> Run:
    config = Config(root=str(root), layout=KVTIER, min_idle_seconds=600,
                    temp_guard_seconds=3600, dir_guard_seconds=600, threads=2)
    return SwappingRun(config, clock=lambda: NOW, usage_source=FilesUsage(root, capacity),
                       swap=swap)


def files_under(directory: Path) -> set[Path]:
    return {p for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("level", range(5), ids=["kvtier", "v1", "fingerprint", "fan-out-1",
                                                 "fan-out-2"])
def test_a_directory_swapped_for_a_symlink_after_the_scan_deletes_nothing_there(tmp_path,
                                                                                  level):
    root = tmp_path / "vol"
    files = lru_tree(root)
    oldest = files[-1]  # certainly a candidate: the run must free 3 files
    leaf = oldest.parent
    write(leaf / f".{key(99)}.kvb.deadbeef.tmp", U // 4, ANCIENT)  # a stale temp beside it
    if level <= 3:  # an old empty fan-out directory inside the swapped one
        empty = leaf.parent / "ee"
        empty.mkdir()
        os.utime(empty, (ANCIENT, ANCIENT))
    names = oldest.relative_to(root).parts
    swapped = root.joinpath(*names[:level + 1])
    # The victim: a tree outside the layout with the same names below the swapped level.
    outside = tmp_path / "outside" / names[level]
    shutil.copytree(swapped, outside)
    for path in [outside, *outside.rglob("*")]:
        os.utime(path, (ANCIENT, ANCIENT), follow_symlinks=False)
    victims = files_under(outside)
    victim_dirs = {p for p in outside.rglob("*") if p.is_dir()}
    moved = tmp_path / "moved"

    def swap() -> None:
        os.rename(swapped, moved)
        os.symlink(outside, swapped)

    originals = {moved / p.relative_to(swapped) for p in files_under(swapped)}
    report = swapping_run(root, capacity=11 * U, swap=swap).execute()
    assert files_under(outside) == victims, "a file outside the layout was deleted"
    assert {p for p in outside.rglob("*") if p.is_dir()} == victim_dirs
    assert files_under(moved) == originals  # moved out of the layout: not reachable either
    assert report.skipped_changed >= 1 and report.temp_files_reaped == 0
    if level >= 3:  # files outside the swapped directory still go
        assert report.files_deleted >= 1


def test_a_file_replaced_after_the_scan_is_kept_even_with_old_times(tmp_path):
    files = lru_tree(tmp_path)
    oldest = files[-1]
    times = (oldest.stat().st_atime, oldest.stat().st_mtime)

    def swap() -> None:  # a writer renames a new file over it, then restores old times
        tmp = oldest.with_name(f".{oldest.stem}.kvb.0f0f.tmp")
        tmp.write_bytes(b"\x02" * U)
        os.replace(tmp, oldest)
        os.utime(oldest, times)

    report = swapping_run(tmp_path, capacity=11 * U, swap=swap).execute()
    assert oldest.exists() and oldest.read_bytes()[:1] == b"\x02"
    assert report.skipped_changed == 1 and report.files_deleted == 2  # the other two candidates


def test_a_root_that_is_a_symlink_is_followed(tmp_path):
    real = tmp_path / "real"
    files = lru_tree(real)
    (tmp_path / "link").symlink_to(real)
    report = make_run(tmp_path / "link", capacity=11 * U).execute()
    assert report.files_deleted == 3 and sum(not f.exists() for f in files) == 3
