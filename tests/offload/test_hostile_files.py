"""The block store against what a hostile or broken writer on the shared volume can leave
at a block's path (a FIFO, socket, device, symlink or directory), against keys the
layout cannot file, and against an I/O thread that never comes back.

Every wait here is bounded, so a regression fails instead of hanging the suite: a FIFO
that blocked a reader is released (opened for writing) before the store is closed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from kvtier_evictor.layouts import KVTIER, Kind
from kvtier_evictor.scan import LruSelection, ScanRules, scan
from kvtier_offload.fileformat import HEADER_SIZE
from kvtier_offload.iopool import IOPool
from kvtier_offload.layout import MAX_KEY_BYTES, MIN_KEY_BYTES
from kvtier_offload.store import WAIT_SECONDS, BlockStore
from tests.offload.conftest import keys, rows, run_load, run_store

SIZE = 64 * 1024
BOUND = 10.0  # seconds a load of a refused file may take at most (it takes milliseconds)


def not_a_file_count() -> float:
    return REGISTRY.get_sample_value("kvtier_offload_corrupt_files_total",
                                     {"tier": "storage", "reason": "not-a-file"}) or 0.0


def release_fifo(path: str) -> None:
    """Let a reader stuck in open() of the FIFO at path go (the old code's hang)."""
    with contextlib.suppress(OSError):
        if stat.S_ISFIFO(os.stat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: no reader


def plant(kind: str, path: str, outside: Path, monkeypatch) -> str:
    """Replace the block file at path with `kind`; returns what must survive outside."""
    good = outside / "copy.kvb"
    os.replace(path, good)  # a valid copy of this very block, outside the layout
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        monkeypatch.chdir(os.path.dirname(path))  # a socket path must be short
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(os.path.basename(path))
        sock.close()
    elif kind == "symlink-to-fifo":
        os.mkfifo(outside / "fifo")
        os.symlink(outside / "fifo", path)
    elif kind == "symlink-to-copy":
        os.symlink(good, path)
    elif kind == "char-device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD")
    elif kind == "empty-dir":
        os.mkdir(path)
    return str(good)


@pytest.mark.parametrize("kind", ["fifo", "socket", "symlink-to-fifo", "symlink-to-copy",
                                  "char-device", "empty-dir"])
@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_special_file_at_a_cached_hit_is_a_quick_counted_miss_and_removed(
        make_store, tmp_path, monkeypatch, kind, batch_io):
    store = make_store(root=tmp_path / "vol", batch_io=batch_io)
    outside = tmp_path / "outside"
    outside.mkdir()
    ks, src = keys(2), rows(2, SIZE, seed=1)
    assert run_store(store, 1, list(zip(ks, src))).success
    assert store.lookup_now(ks) == [True, True]  # cached: the load will not look first
    path = store.layout.path(ks[0])
    copy = plant(kind, path, outside, monkeypatch)
    before = not_a_file_count()
    dest = rows(2, SIZE, seed=2)
    try:
        store.load(2, list(zip(ks, dest)))
        started = time.monotonic()
        assert store.drain(BOUND), f"a load of a {kind} did not finish in {BOUND}s"
        assert time.monotonic() - started < BOUND
    finally:
        release_fifo(path)
        release_fifo(str(outside / "fifo"))
    (outcome,) = [o for o in store.finished() if o.job_id == 2]
    assert outcome.ok == [False, True]
    assert bytes(dest[1]) == bytes(src[1])
    assert not_a_file_count() == before + 1  # refused by its type, before any read
    assert not os.path.lexists(path), f"the {kind} was left at the block path"
    assert os.path.exists(copy)  # a symlink's target is never touched
    store.forget(ks[0])
    assert store.lookup_now([ks[0]]) == [False]
    assert run_store(store, 3, [(ks[0], src[0])]).success  # and the key can be stored again
    assert run_load(store, 4, [(ks[0], dest[0])]).success and bytes(dest[0]) == bytes(src[0])


def big_directory(path: str) -> None:
    """A directory whose st_size reaches a block header's size, on any filesystem (ext4
    starts at 4096; tmpfs grows by 20 bytes per entry)."""
    os.mkdir(path)
    for i in range(5000):
        Path(path, f"entry-{i:04d}-" + "x" * 40).touch()  # one at least: not removable
        if os.stat(path).st_size >= HEADER_SIZE:
            return
    pytest.skip("this filesystem never reports a directory size of 4096 bytes")


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_directory_at_a_block_path_is_never_a_hit(make_store, tmp_path, batch_io):
    store = make_store(batch_io=batch_io, lookup_hit_ttl=0, lookup_miss_ttl=0)
    ks, src = keys(1), rows(1, SIZE, seed=3)
    assert run_store(store, 1, list(zip(ks, src))).success
    path = store.layout.path(ks[0])
    os.unlink(path)
    big_directory(path)
    assert store.lookup_now(ks) == [False]  # the lookup itself
    outcome = run_load(store, 2, [(ks[0], rows(1, SIZE)[0])])  # a load promised earlier
    assert outcome.ok == [False]
    assert os.path.isdir(path)  # not empty: it stays...
    assert store.lookup_now(ks) == [False]  # ...and is still a miss
    assert not run_store(store, 3, list(zip(ks, src))).success  # never "already stored"


@pytest.mark.parametrize("key", [b"", b"\xab", b"\xab\xcd\xef", "a str", None],
                         ids=["empty", "1 byte", "3 bytes", "str", "None"])
@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_keys_the_layout_cannot_file_are_refused_cleanly(make_store, tmp_path, key, batch_io):
    store = make_store(batch_io=batch_io)
    good, data = keys(1)[0], rows(2, SIZE, seed=4)
    outcome = run_store(store, 1, [(key, data[0]), (good, data[1])])
    assert outcome.ok == [False, True]
    assert store.lookup_now([key, good]) == [False, True]
    assert store.lookup(key) is False
    store.forget(key)
    outcome = run_load(store, 2, [(key, rows(1, SIZE)[0]), (good, rows(1, SIZE)[0])])
    assert outcome.ok == [False, True]
    blocks = [name for _, _, names in os.walk(store.layout.base) for name in names]
    assert blocks == [os.path.basename(store.layout.path(good))]  # nothing else written


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_every_block_the_store_writes_is_one_the_evictor_can_evict(make_store, tmp_path,
                                                                     batch_io):
    """The store's layout and the evictor's agree: key lengths 0..40 and the longest."""
    root = tmp_path / "vol"
    store = make_store(root=root, batch_io=batch_io)
    lengths = [*range(41), MAX_KEY_BYTES]
    ks = [bytes([n % 251 + 1]) * n for n in lengths]
    outcome = run_store(store, 1, list(zip(ks, rows(len(ks), SIZE, seed=5))))
    assert outcome.ok == [MIN_KEY_BYTES <= n for n in lengths]
    on_disk = {os.path.join(d, name) for d, _, names in os.walk(root) for name in names}
    rules = ScanRules(now=time.time() + 10**6, min_idle_seconds=0, temp_guard_seconds=0,
                      dir_guard_seconds=0)
    selection = LruSelection(bytes_needed=10**12, files_needed=10**6)
    totals = scan(str(root), KVTIER, rules, selection, threads=1)
    assert not totals.errors and not totals.stale_temps
    assert {c.path for c in selection.oldest_first()} == on_disk
    assert totals.files == len(on_disk) == sum(outcome.ok)
    assert all(KVTIER.classify(os.path.basename(p)) is Kind.BLOCK for p in on_disk)


def test_drain_and_close_give_up_on_a_stuck_io_thread(make_store, monkeypatch, caplog):
    store = make_store(batch_io=False)
    stuck = threading.Event()
    release = threading.Event()

    def hang(dest, path):  # a read that never returns (a hung network mount)
        stuck.set()
        release.wait(60)
        raise FileNotFoundError(path)

    monkeypatch.setattr(store.files, "read", hang)
    results: list[object] = []
    try:
        store.load(1, [(keys(1)[0], rows(1, SIZE)[0])])
        assert stuck.wait(BOUND)
        started = time.monotonic()
        assert store.drain(0.3) is False
        assert 0.25 < time.monotonic() - started < BOUND
        assert caplog.text.count("still unfinished") == 1
        assert store.drain(0) is False  # a poll: not logged again within the minute
        assert caplog.text.count("still unfinished") == 1
        closer = threading.Thread(target=lambda: results.append(store.close(timeout=0.5)))
        closer.start()
        closer.join(BOUND)
        assert not closer.is_alive(), "close() waited for the stuck thread"
        assert results == [False]
        assert store.close() is True  # a second close returns at once
    finally:
        release.set()
    for method in (BlockStore.drain, BlockStore.close):  # bounded by default too
        default = inspect.signature(method).parameters["timeout"].default
        assert default == WAIT_SECONDS and math.isfinite(default)


def test_a_pool_closed_past_its_timeout_drops_what_has_not_started():
    pool = IOPool(read_threads=1, write_threads=0)
    release = threading.Event()
    ran: list[int] = []
    pool.submit_read(lambda: release.wait(60))
    pool.submit_read(lambda: ran.append(1))
    try:
        started = time.monotonic()
        assert pool.close(timeout=0.2) is False
        assert time.monotonic() - started < BOUND
    finally:
        release.set()
    time.sleep(0.2)
    assert ran == []  # queued behind the stuck task: dropped, never run


# A writer on the volume swaps a directory on a block's path for a symlink to a place
# outside the volume (#35 N4): the fingerprint directory, or a fan-out level. No store
# writes there, no load reads from there, no lookup counts what is there as a hit.
LEVELS = {"fingerprint": 0, "fan-out 1": 1, "fan-out 2": 2}


def _swap_for_symlink(store, key: bytes, level: int, outside: Path) -> Path:
    """Move the directory `level` levels above key's fan-out leaf (0: the fingerprint
    directory) outside the volume and leave a symlink to it in its place."""
    leaf = Path(store.layout.path(key)).parent
    directory = [leaf.parent.parent, leaf.parent, leaf][level]
    moved = outside / f"moved-{level}"
    os.replace(directory, moved)
    os.symlink(moved, directory)
    return moved


@pytest.mark.parametrize("level", LEVELS.values(), ids=LEVELS.keys())
@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_symlinked_directory_never_leads_a_store_outside_the_volume(
        make_store, tmp_path, level, batch_io):
    store = make_store(root=tmp_path / "vol", batch_io=batch_io)
    outside = tmp_path / "outside"
    outside.mkdir()
    first, second = keys(2, salt=b"n4")
    second = first[:2] + second[2:]  # the same fan-out directories as first
    data = rows(2, SIZE, seed=3)
    assert run_store(store, 1, [(first, data[0])]).success
    moved = _swap_for_symlink(store, first, level, outside)
    before = sorted(p.name for p in moved.rglob("*"))
    outcome = run_store(store, 2, [(second, data[1])])
    assert not outcome.success
    assert sorted(p.name for p in moved.rglob("*")) == before  # nothing written there


@pytest.mark.parametrize("level", LEVELS.values(), ids=LEVELS.keys())
@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_symlinked_directory_never_serves_a_block_from_outside_the_volume(
        make_store, tmp_path, level, batch_io):
    writer = make_store(root=tmp_path / "vol", batch_io=batch_io)
    (key,) = keys(1, salt=b"n4-load")
    (data,) = rows(1, SIZE, seed=4)
    assert run_store(writer, 1, [(key, data)]).success
    outside = tmp_path / "outside"
    outside.mkdir()
    _swap_for_symlink(writer, key, level, outside)  # the valid block now lies outside
    reader = make_store(root=tmp_path / "vol", batch_io=batch_io)  # no cached hits
    assert reader.lookup_now([key]) == [False]
    dest = rows(1, SIZE, seed=5)[0]
    assert not run_load(reader, 2, [(key, dest)]).success
    assert bytes(dest) != bytes(data)
    assert (outside / f"moved-{level}").exists()  # and nothing outside was removed


def test_without_openat2_each_level_is_still_opened_without_following(tmp_path,
                                                                       monkeypatch):
    # The Python walk (kernels before 5.6, or no extension) refuses the same symlinks.
    from kvtier_offload import beneath

    monkeypatch.setattr(beneath.native, "module", None)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.close(beneath.open_beneath(root, "real/f", os.O_RDONLY))
        for rel in ("link/f", "../" + tmp_path.name + "/real/f", "real/../real/f"):
            with pytest.raises(OSError):
                beneath.open_beneath(root, rel, os.O_RDONLY)
    finally:
        os.close(root)
