"""The local tier's byte bound (capacity.py): real block files on a real small
filesystem (a tmpfs), filled past the bound while another thread watches the
filesystem's own count of used bytes."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier_offload.capacity import BoundedFiles, block_file_bytes, parse_capacity
from kvtier_offload.layout import Layout
from tests.mounts import tmpfs
from tests.offload.conftest import FP, keys, rows, run_load, run_store

BLOCK = 64 << 10  # payload bytes per block
FILE = block_file_bytes(BLOCK)  # 68 KiB on disk


def bounded(store) -> BoundedFiles:
    files = store.files
    assert isinstance(files, BoundedFiles)
    assert files.ready.wait(10)
    return files


def statvfs_used(path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def disk_bytes(root) -> int:
    """What the files under root take on the filesystem (allocated blocks)."""
    total = 0
    for directory, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(directory, name))
            if name.endswith((".kvb", ".tmp")):
                total += st.st_blocks * 512
    return total


@pytest.fixture
def nvme(tmp_path):
    with tmpfs(tmp_path / "nvme", size="48m") as path:
        yield path


@pytest.mark.privileged
@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_filled_past_capacity_use_stays_under_the_bound_and_the_newest_survive(
        make_store, nvme, batch_io):
    limit = 20 * FILE + FILE // 2  # room for 20 blocks
    store = make_store(nvme, capacity_bytes=limit, batch_io=batch_io, read_threads=4,
                       write_threads=4, free_space_floor_percent=0)
    files = bounded(store)
    base = statvfs_used(nvme)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the filesystem's own count, while writes are in flight
        while not stop.is_set():
            peak[0] = max(peak[0], statvfs_used(nvme) - base)

    watcher = threading.Thread(target=watch)
    watcher.start()
    names = keys(100, salt=b"fill")
    data = rows(100, BLOCK, seed=3)
    try:
        for job in range(25):  # 100 blocks, five times the bound, 4 a job
            span = range(job * 4, job * 4 + 4)
            outcome = run_store(store, job, [(names[i], data[i]) for i in span])
            assert outcome.success
    finally:
        stop.set()
        watcher.join()
    used, claimed = files.usage()
    assert claimed == 0 and used <= limit
    assert 0 < peak[0] <= limit, f"{peak[0]} bytes used at the peak, bound {limit}"
    assert disk_bytes(nvme) <= limit
    assert files.evicted_blocks == 80
    # The newest 20 are all there and bit-identical; every older one is gone.
    for i, key in enumerate(names):
        dest = memoryview(bytearray(BLOCK))
        ok = run_load(store, 1000 + i, [(key, dest)]).success
        assert ok == (i >= 80), i
        if ok:
            assert dest == data[i]


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_block_loaded_lately_outlives_older_ones(make_store, tmp_path, batch_io):
    store = make_store(tmp_path, capacity_bytes=10 * FILE, batch_io=batch_io,
                       free_space_floor_percent=0)
    files = bounded(store)
    names, data = keys(16, salt=b"lru"), rows(16, BLOCK, seed=4)
    for i in range(10):
        assert run_store(store, i, [(names[i], data[i])]).success
    dest = memoryview(bytearray(BLOCK))
    assert run_load(store, 100, [(names[0], dest)]).success  # the oldest, used again
    for i in range(10, 13):
        assert run_store(store, i, [(names[i], data[i])]).success
    left = set(files.blocks())
    assert names[0] in left and not {names[1], names[2], names[3]} & left
    assert not os.path.exists(store.layout.path(names[1]))
    assert store.lookup_now([names[1]]) == [False]  # no cached hit for an evicted block


def test_a_restart_counts_what_it_finds_and_evicts_other_configurations_first(
        make_store, tmp_path):
    other = make_store(tmp_path, fingerprint="ffeeddccbbaa9988", free_space_floor_percent=0)
    old_names = keys(6, salt=b"old")
    assert run_store(other, 1, list(zip(old_names, rows(6, BLOCK, seed=5),
                                        strict=True))).success
    other.close()
    # A temp file a killed writer left, in this configuration's own directory.
    layout = Layout(str(tmp_path), FP)
    leftover = layout.temp_path(keys(1, salt=b"tmp")[0])
    os.makedirs(os.path.dirname(leftover), exist_ok=True)
    with open(leftover, "wb") as f:
        f.write(b"\0" * 10_000)

    first = make_store(tmp_path, capacity_bytes=10 * FILE, free_space_floor_percent=0)
    files = bounded(first)
    assert files.usage()[0] == 6 * FILE + block_file_bytes(10_000 - 4096)
    names, data = keys(6, salt=b"new"), rows(6, BLOCK, seed=6)
    for i in range(6):
        time.sleep(0.01)  # distinct timestamps: the order a restart finds them in
        assert run_store(first, i, [(names[i], data[i])]).success
    # Room was made from the stale files first: this configuration's blocks all stayed.
    assert set(files.blocks()) == set(names) and files.usage()[0] <= 10 * FILE
    assert not os.path.exists(leftover)
    gone = [k for k in old_names if not os.path.exists(other.layout.path(k))]
    assert len(gone) == 2  # the temp file, then as many stale blocks as room needed
    first.close()

    # Restarted with a smaller bound: counted from the files, the oldest evicted at once.
    again = make_store(tmp_path, capacity_bytes=4 * FILE, free_space_floor_percent=0)
    files = bounded(again)
    assert files.usage()[0] <= 4 * FILE
    assert files.blocks() == names[-4:]
    for i in (4, 5):  # found on disk, verified on load
        dest = memoryview(bytearray(BLOCK))
        assert run_load(again, 10 + i, [(names[i], dest)]).success and dest == data[i]


def test_stores_wait_for_the_count_at_start(make_store, tmp_path, monkeypatch):
    gate = threading.Event()
    found = BoundedFiles._found

    def slow(self):
        gate.wait(10)
        return found(self)

    monkeypatch.setattr(BoundedFiles, "_found", slow)
    store = make_store(tmp_path, capacity_bytes=10 * FILE, free_space_floor_percent=0)
    name, data = keys(1, salt=b"wait"), rows(1, BLOCK, seed=7)
    assert not run_store(store, 1, [(name[0], data[0])]).success  # not counted yet
    gate.set()
    bounded(store)
    assert run_store(store, 2, [(name[0], data[0])]).success


def test_capacity_setting_is_checked_with_a_clear_message():
    assert parse_capacity(10 * FILE, BLOCK) == 10 * FILE
    assert parse_capacity(str(10 * FILE), BLOCK) == 10 * FILE
    for bad in (True, 1.5, "10Gi", None, -1):
        with pytest.raises(ValueError, match=r"whole number of bytes|at least"):
            parse_capacity(bad, BLOCK)
    with pytest.raises(ValueError, match=f"{2 * FILE} bytes at least"):
        parse_capacity(FILE, BLOCK)
