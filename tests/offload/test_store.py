"""The block store: format, layout, isolation, atomicity, bad files, errors, overload."""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import statistics
import struct
import threading
import time

import numpy as np
import pytest

from kvtier_evictor.layouts import KVTIER, Kind
from kvtier_offload import batchio
from kvtier_offload.fileformat import (
    HEADER_SIZE,
    MAGIC,
    BadBlock,
    decode_header,
    encode_header,
)
from kvtier_offload.fileio import advance
from kvtier_offload.iopool import IOPool
from kvtier_offload.layout import Layout, fingerprint
from kvtier_offload.metrics import observe_all
from kvtier_offload.store import BlockStore, StoreConfig, probe_o_direct
from tests.offload.conftest import FP, keys, rows, run_load, run_store

SIZE = 64 * 1024


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_round_trip_and_file_format(make_store, tmp_path, batch_io):
    store = make_store(batch_io=batch_io)
    ks, src = keys(4), rows(4, SIZE, seed=1)
    assert run_store(store, 1, list(zip(ks, src))).success
    path = store.layout.path(ks[0])
    h = ks[0].hex()
    assert path == str(tmp_path / "kvtier" / "v1" / FP / h[:2] / h[2:4] / f"{h}.kvb")
    raw = open(path, "rb").read()
    assert raw[:4] == MAGIC
    assert len(raw) == HEADER_SIZE + SIZE
    assert raw[HEADER_SIZE:] == bytes(src[0])
    dest = rows(4, SIZE, seed=2)
    outcome = run_load(store, 2, list(zip(ks, dest)))
    assert outcome.success and outcome.nbytes == 4 * SIZE
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]


def test_files_are_what_the_evictor_expects(make_store, tmp_path):
    store = make_store()
    ks = keys(3)
    run_store(store, 1, list(zip(ks, rows(3, SIZE))))
    for k in ks:
        rel = os.path.relpath(store.layout.path(k), tmp_path).split(os.sep)
        assert all(p.match(d) for p, d in zip(KVTIER.dir_levels, rel[:-1], strict=True))
        assert KVTIER.classify(rel[-1]) is Kind.BLOCK
    assert KVTIER.classify(os.path.basename(store.layout.temp_path(ks[0]))) is Kind.TEMP
    assert KVTIER.classify(os.path.basename(store.layout.temp_path(ks[0], "0f" * 8))) is (
        Kind.TEMP)
    assert (tmp_path / "kvtier" / "v1" / FP / "config.json").exists() is False  # adapter writes it
    layout = Layout(str(tmp_path), FP)
    layout.write_config({"model": "m"})
    assert KVTIER.classify("config.json") is None


def test_directories_are_group_writable(make_store, tmp_path):
    old = os.umask(0o022)
    try:
        store = make_store()
        k = keys(1)
        run_store(store, 1, list(zip(k, rows(1, SIZE))))
    finally:
        os.umask(old)
    leaf = os.path.dirname(store.layout.path(k[0]))
    assert os.stat(leaf).st_mode & 0o2070 == 0o2070  # setgid + group rwx


def test_ensure_dir_makes_parents_and_takes_an_existing_directory(tmp_path, monkeypatch):
    layout = Layout(str(tmp_path), FP)
    deep = str(tmp_path / "a" / "b" / "c")
    old = os.umask(0o022)
    try:
        layout.ensure_dir(deep)
        layout.ensure_dir(deep)  # there already: fine
    finally:
        os.umask(old)
    assert all(os.stat(tmp_path / p).st_mode & 0o2070 == 0o2070 for p in ("a", "a/b", "a/b/c"))

    def refused(path, mode=0o777):
        raise PermissionError(errno.EACCES, "read-only here", path)

    monkeypatch.setattr(os, "mkdir", refused)
    layout.ensure_dir(deep)  # some mounts say EACCES/EROFS for a directory that exists
    with pytest.raises(PermissionError):
        layout.ensure_dir(str(tmp_path / "new"))


def test_fingerprint_isolates_configurations(make_store, tmp_path):
    a = make_store(fingerprint=fingerprint({"model": "a", "dtype": "bfloat16"}))
    b = make_store(fingerprint=fingerprint({"model": "a", "dtype": "float16"}))
    assert a.layout.fingerprint != b.layout.fingerprint
    ks = keys(2)
    run_store(a, 1, list(zip(ks, rows(2, SIZE))))
    assert b.lookup_now(ks) == [False, False]
    # a file copied under another fingerprint is refused as foreign, never served
    target = b.layout.path(ks[0])
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.link(a.layout.path(ks[0]), target)
    outcome = run_load(b, 2, [(ks[0], rows(1, SIZE)[0])])
    assert not outcome.success
    assert not os.path.exists(target) and os.path.exists(a.layout.path(ks[0]))


def test_same_fingerprint_shares_across_stores(make_store, tmp_path):
    a, b = make_store(), make_store()
    ks, src = keys(3), rows(3, SIZE, seed=5)
    run_store(a, 1, list(zip(ks, src)))
    dest = rows(3, SIZE, seed=6)
    assert run_load(b, 1, list(zip(ks, dest))).success
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]


def _writer(root: str, seed: int, n: int, barrier) -> int:
    store = BlockStore(StoreConfig(root=root, fingerprint=FP, read_threads=1, write_threads=4))
    ks = [bytes([i]) * 36 for i in range(n)]
    data = rows(n, SIZE, seed=42)  # every process writes the same bytes for a key
    barrier.wait()
    store.store(1, list(zip(ks, data)))
    store.drain()
    (outcome,) = store.finished()
    store.close()
    return sum(outcome.ok)


@pytest.mark.slow
def test_many_processes_writing_the_same_keys(tmp_path):
    n, procs = 40, 4
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Manager().Barrier(procs)
    with ctx.Pool(procs) as pool:
        counts = pool.starmap(_writer, [(str(tmp_path), s, n, barrier) for s in range(procs)])
    assert counts == [n] * procs  # every writer reports success: the block is stored
    store = BlockStore(StoreConfig(root=str(tmp_path), fingerprint=FP))
    try:
        ks = [bytes([i]) * 36 for i in range(n)]
        dest = rows(n, SIZE, seed=7)
        assert run_load(store, 9, list(zip(ks, dest))).success
        assert [bytes(d) for d in dest] == [bytes(r) for r in rows(n, SIZE, seed=42)]
    finally:
        store.close()
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    assert leftovers == []


def _corrupt(path: str, how: str) -> None:
    raw = bytearray(open(path, "rb").read())
    if how == "truncated":
        raw = raw[: HEADER_SIZE + 100]
    elif how == "zero-filled":
        raw = bytearray(len(raw))
    elif how == "payload-flip":
        raw[HEADER_SIZE + 7] ^= 0xFF
    elif how == "header-flip":
        raw[20] ^= 0x01
    elif how == "empty":
        raw = bytearray()
    elif how == "foreign-key":
        raw[: HEADER_SIZE] = encode_header(FP, b"\x99" * 36, len(raw) - HEADER_SIZE,
                                            struct.unpack_from("<Q", raw, 24)[0])
    elif how == "pages-swapped":  # a torn or misdirected write: same bytes, wrong order
        a, b = HEADER_SIZE, HEADER_SIZE + 4096
        raw[a:b], raw[b:b + 4096] = raw[b:b + 4096], raw[a:b]
    elif how == "version-2":  # written by an older kvtier with another payload digest
        struct.pack_into("<H", raw, 4, 2)
    with open(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("how", ["truncated", "zero-filled", "payload-flip", "header-flip",
                                 "empty", "foreign-key", "pages-swapped", "version-2"])
@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_bad_files_are_refused_removed_and_counted(make_store, how, batch_io):
    store = make_store(batch_io=batch_io)
    ks, src = keys(3), rows(3, SIZE, seed=3)
    run_store(store, 1, list(zip(ks, src)))
    _corrupt(store.layout.path(ks[1]), how)
    dest = rows(3, SIZE, seed=4)
    outcome = run_load(store, 2, list(zip(ks, dest)))
    assert not outcome.success
    assert outcome.ok == [True, False, True]
    assert outcome.ok_prefix == [ks[0]]
    assert not os.path.exists(store.layout.path(ks[1]))
    assert store.lookup_now([ks[1]]) == [False]


def test_bad_file_metric_counts(make_store):
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value("kvtier_offload_corrupt_files_total",
                                         {"tier": "storage", "reason": "bad-checksum"}) or 0.0

    store = make_store()
    ks = keys(1)
    run_store(store, 1, list(zip(ks, rows(1, SIZE))))
    _corrupt(store.layout.path(ks[0]), "payload-flip")
    before = count()
    run_load(store, 2, [(ks[0], rows(1, SIZE)[0])])
    assert count() == before + 1


def test_decode_header_rejects_each_field():
    good = encode_header(FP, b"k" * 36, 100, 5)
    assert decode_header(good, FP, b"k" * 36, 100) == 5
    with pytest.raises(BadBlock, match="foreign"):
        decode_header(good, "ffffffffffffffff", b"k" * 36, 100)
    with pytest.raises(BadBlock, match="foreign"):
        decode_header(good, FP, b"j" * 36, 100)
    with pytest.raises(BadBlock, match="bad-length"):
        decode_header(good, FP, b"k" * 36, 101)
    with pytest.raises(BadBlock, match="bad-magic"):
        decode_header(b"XXXX" + good[4:], FP, b"k" * 36, 100)


def test_missing_file_is_a_failed_key_not_an_error(make_store):
    store = make_store()
    ks = keys(2)
    run_store(store, 1, [(ks[0], rows(1, SIZE)[0])])
    outcome = run_load(store, 2, list(zip(ks, rows(2, SIZE))))
    assert outcome.ok == [True, False]


def test_store_of_existing_key_is_skipped(make_store):
    store = make_store()
    ks = keys(1)
    run_store(store, 1, [(ks[0], rows(1, SIZE, seed=1)[0])])
    mtime = os.stat(store.layout.path(ks[0])).st_mtime_ns
    assert run_store(store, 2, [(ks[0], rows(1, SIZE, seed=2)[0])]).success
    assert os.stat(store.layout.path(ks[0])).st_mtime_ns == mtime


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_key_another_store_wrote_first_is_kept_and_counted(make_store, batch_io):
    from prometheus_client import REGISTRY

    def exists() -> float:
        return REGISTRY.get_sample_value("kvtier_offload_operations_total",
                                         {"tier": "storage", "direction": "store",
                                          "outcome": "exists"}) or 0.0

    first, second = make_store(), make_store(batch_io=batch_io)  # caches of their own
    ks = keys(2)
    run_store(first, 1, [(ks[0], rows(1, SIZE, seed=1)[0])])
    mtime = os.stat(first.layout.path(ks[0])).st_mtime_ns
    before = exists()
    outcome = run_store(second, 2, list(zip(ks, rows(2, SIZE, seed=2))))
    assert outcome.ok == [True, True] and outcome.nbytes == 2 * SIZE
    assert os.stat(first.layout.path(ks[0])).st_mtime_ns == mtime
    assert exists() == before + 1
    assert second.lookup_now(ks) == [True, True]


def idle(store, seconds: float = 10.0) -> None:
    """Wait until no I/O thread runs a task: a load's atime refresh comes after its job
    is reported done (the request does not wait for it)."""
    deadline = time.monotonic() + seconds
    while store.pool.busy() != (0, 0):
        assert time.monotonic() < deadline, "the I/O threads never went idle"
        time.sleep(0.005)


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_load_refreshes_atime_at_most_once_per_interval(make_store, tmp_path, batch_io):
    patient = make_store(batch_io=batch_io, touch_interval=3600.0)
    ks = keys(1)
    path = patient.layout.path(ks[0])
    run_store(patient, 1, list(zip(ks, rows(1, SIZE))))
    time.sleep(0.02)  # past the clock tick of the write (file times are coarse)
    assert run_load(patient, 2, list(zip(ks, rows(1, SIZE)))).success
    idle(patient)
    # atime is now past mtime and ctime: relatime leaves it alone, only kvtier moves it
    atime = os.stat(path).st_atime_ns
    time.sleep(0.02)
    assert run_load(patient, 3, list(zip(ks, rows(1, SIZE)))).success
    idle(patient)
    assert os.stat(path).st_atime_ns == atime  # used within the hour: not touched
    eager = make_store(batch_io=batch_io, touch_interval=0.0)
    assert run_load(eager, 4, list(zip(ks, rows(1, SIZE)))).success
    idle(eager)
    assert os.stat(path).st_atime_ns > atime


def test_injected_write_errors_fail_the_job_and_back_off(make_store, monkeypatch):
    store = make_store(batch_io=False)  # injects into the Python path
    real = os.writev

    def failing(fd, bufs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "writev", failing)
    ks = keys(2)
    outcome = run_store(store, 1, list(zip(ks, rows(2, SIZE))))
    assert not outcome.success
    monkeypatch.setattr(os, "writev", real)
    # backing off: fails fast without touching the volume
    assert not run_store(store, 2, list(zip(keys(1), rows(1, SIZE)))).success
    store.admission.blocked_until = 0.0  # the backoff is over
    assert run_store(store, 3, list(zip(keys(1), rows(1, SIZE)))).success
    tmps = [f for _, _, files in os.walk(store.layout.base) for f in files if f.endswith(".tmp")]
    assert tmps == []


def test_close_errors_are_seen(make_store, monkeypatch):
    store = make_store(batch_io=False)  # injects into the Python path
    real_close = os.close
    failed = []

    def close(fd):
        real_close(fd)
        if not failed and os.path.exists(store.layout.base):
            failed.append(fd)
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    k = keys(1)
    monkeypatch.setattr(os, "close", close)
    assert not run_store(store, 1, [(k[0], rows(1, SIZE)[0])]).success
    monkeypatch.setattr(os, "close", real_close)
    assert not os.path.exists(store.layout.path(k[0]))


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
@pytest.mark.parametrize("why", ["backoff", "stale"])
def test_stores_backing_off_or_too_long_queued_are_dropped_on_either_path(make_store, batch_io,
                                                                          why):
    import threading

    from prometheus_client import REGISTRY

    def dropped() -> float:
        return REGISTRY.get_sample_value("kvtier_offload_dropped_writes_total",
                                         {"tier": "storage", "reason": why}) or 0.0

    pool = IOPool(1, 0)  # one thread, held below while the job waits
    store = make_store(batch_io=batch_io, pool=pool,
                       write_queue_seconds=30.0 if why == "backoff" else 0.2)
    before = dropped()
    ks, src = keys(3), region(3, seed=77)
    gate = threading.Event()
    pool.submit_write(lambda: gate.wait(5))
    if why == "backoff":
        store.admission.blocked_until = time.monotonic() + 60.0
        store.store_rows(1, ks, src, range(3))
    else:
        store.store_rows(1, ks, src, range(3))
        time.sleep(0.3)  # queued longer than its budget
    gate.set()
    assert store.drain(30)
    (outcome,) = store.finished()
    assert outcome.ok == [False] * 3 and outcome.nbytes == 0
    assert dropped() == before + 3
    assert not any(os.path.exists(store.layout.path(k)) for k in ks)


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_a_store_the_lookup_cache_knows_is_not_written_again(make_store, batch_io):
    store = make_store(batch_io=batch_io)
    ks, src = keys(3), region(3, seed=78)
    assert run_rows(store, "store", 1, ks, src, range(3)).success
    os.unlink(store.layout.path(ks[1]))  # gone from the volume, still known as stored
    outcome = run_rows(store, "store", 2, ks, src, range(3))
    assert outcome.ok == [True] * 3 and outcome.nbytes == 3 * SIZE
    assert not os.path.exists(store.layout.path(ks[1]))  # not rewritten
    store.forget(ks[1])
    assert run_rows(store, "store", 3, ks[1:2], src, [1]).success
    assert os.path.exists(store.layout.path(ks[1]))
    # every reservation against the queue and the free-space floor was given back
    assert store.admission.unwritten_bytes == 0 and store.admission.queued_bytes == 0


def test_free_space_floor_stops_writes(make_store):
    store = make_store(free_space_floor_percent=100.0)
    ks = keys(2)
    outcome = run_store(store, 1, list(zip(ks, rows(2, SIZE))))
    assert outcome.ok == [False, False]
    assert not any(os.path.exists(store.layout.path(k)) for k in ks)


def test_overload_drops_stores_and_never_reports_them(make_store, monkeypatch):
    store = make_store(write_threads=1, read_threads=1, write_queue_seconds=0.2,
                       batch_io=False)
    real = store.files.write

    def slow(*args):
        time.sleep(0.1)
        return real(*args)

    monkeypatch.setattr(store.files, "write", slow)
    ks = keys(20)
    outcome = run_store(store, 1, list(zip(ks, rows(20, SIZE))))
    stored = [k for k, ok in zip(ks, outcome.ok) if ok]
    dropped = [k for k, ok in zip(ks, outcome.ok) if not ok]
    assert stored and dropped
    assert all(os.path.exists(store.layout.path(k)) for k in stored)
    assert not any(os.path.exists(store.layout.path(k)) for k in dropped)
    # with a throughput estimate in hand, an oversized job is dropped at submit
    outcome = run_store(store, 2, list(zip(keys(50), rows(50, SIZE))))
    assert outcome.ok == [False] * 50


def test_lookup_is_async_cached_and_refreshes_atime(make_store):
    store = make_store(touch_interval=0.0)
    ks = keys(2)
    run_store(store, 1, [(ks[0], rows(1, SIZE)[0])])
    store.forget(ks[0])
    path = store.layout.path(ks[0])
    os.utime(path, (1000.0, os.stat(path).st_mtime))
    answers = [store.lookup(ks[0])]
    deadline = time.time() + 5
    while answers[-1] is None and time.time() < deadline:
        time.sleep(0.01)
        answers.append(store.lookup(ks[0]))
    assert answers[0] is None and answers[-1] is True
    # the hit refreshes it, just after answering
    while os.stat(path).st_atime <= 1000.0 and time.time() < deadline:
        time.sleep(0.01)
    assert os.stat(path).st_atime > 1000.0
    assert store.lookup_now([ks[1]]) == [False]


def test_o_direct_probe_and_forced_buffered(make_store, tmp_path):
    buffered = make_store(o_direct="off")
    assert buffered.o_direct is False
    ks, src = keys(2), rows(2, SIZE, seed=9)
    run_store(buffered, 1, list(zip(ks, src)))
    direct = make_store(o_direct="auto")
    dest = [memoryview(bytearray(SIZE)) for _ in ks]  # unaligned: the bounce path
    assert run_load(direct, 1, list(zip(ks, dest))).success
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]
    assert isinstance(probe_o_direct(str(tmp_path)), bool)


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_unaligned_rows_round_trip(make_store, batch_io):
    store = make_store(batch_io=batch_io)
    src = [memoryview(bytearray(os.urandom(SIZE + 100)))[3:3 + SIZE + 17] for _ in range(3)]
    ks = keys(3)
    assert run_store(store, 1, list(zip(ks, src))).success
    dest = [memoryview(bytearray(SIZE + 17)) for _ in range(3)]
    assert run_load(store, 2, list(zip(ks, dest))).success
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]


def test_drain_and_close_finish_queued_work(make_store):
    store = make_store(write_threads=1)
    ks = keys(30)
    store.store(1, list(zip(ks, rows(30, SIZE))))
    store.close()
    assert all(os.path.exists(store.layout.path(k)) for k in ks)


def test_o_direct_refused_falls_back_to_buffered(make_store, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    store = make_store(o_direct="auto")
    assert store.o_direct is False
    ks, src = keys(2), rows(2, SIZE, seed=11)
    assert run_store(store, 1, list(zip(ks, src))).success
    dest = rows(2, SIZE, seed=12)
    assert run_load(store, 2, list(zip(ks, dest))).success
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]


@pytest.mark.skipif(not batchio.AVAILABLE, reason=batchio.UNAVAILABLE_REASON or "-")
def test_aligned_blocks_take_the_batch_path_first_writes_included(make_store, monkeypatch):
    store = make_store()

    def python_path(*args):
        raise AssertionError("the Python path ran")

    monkeypatch.setattr(store.files, "write", python_path)
    monkeypatch.setattr(store.files, "read", python_path)
    ks, src = keys(6), rows(6, SIZE, seed=31)  # random keys: every block in a new directory
    assert run_store(store, 1, list(zip(ks, src))).success
    dest = rows(6, SIZE, seed=32)
    assert run_load(store, 2, list(zip(ks, dest))).success
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]
    off = make_store(batch_io=False)
    monkeypatch.setattr(off.files, "write", python_path)
    assert not run_store(off, 3, list(zip(keys(1), rows(1, SIZE)))).success


@pytest.mark.skipif(not batchio.AVAILABLE, reason=batchio.UNAVAILABLE_REASON or "-")
def test_a_block_the_batch_cannot_finish_goes_the_python_way(make_store):
    store = make_store()
    ks, src = keys(3), rows(3, SIZE, seed=41)
    run_store(store, 1, list(zip(ks, src)))
    # directories the evictor reaped after this process made them (it removes the
    # fan-out directories a deletion leaves empty, both levels)
    victim = store.layout.path(ks[1])
    os.unlink(victim)
    os.rmdir(os.path.dirname(victim))
    if not os.listdir(os.path.dirname(os.path.dirname(victim))):
        os.rmdir(os.path.dirname(os.path.dirname(victim)))
    store.forget(ks[1])
    assert run_store(store, 2, [(ks[1], src[1])]).success
    assert os.path.exists(victim)
    # a file that vanished between lookup and load: a missing key, not an error
    os.unlink(store.layout.path(ks[2]))
    outcome = run_load(store, 3, list(zip(ks, rows(3, SIZE))))
    assert outcome.ok == [True, True, False]


@pytest.mark.skipif(not batchio.AVAILABLE, reason=batchio.UNAVAILABLE_REASON or "-")
def test_blocks_in_pieces_round_trip_and_damage_is_refused(make_store):
    store = make_store()
    store.files.piece = 8192  # what a memory-speed volume gets (512 KiB), at test size
    ks, src = keys(3), rows(3, SIZE, seed=81)
    assert run_store(store, 1, list(zip(ks, src))).success
    plain = make_store(batch_io=False)  # the Python path reads what pieces wrote
    dest = rows(3, SIZE, seed=82)
    assert run_load(plain, 2, list(zip(ks, dest))).success
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]
    _corrupt(store.layout.path(ks[2]), "payload-flip")
    dest = rows(3, SIZE, seed=83)
    assert run_load(store, 3, list(zip(ks, dest))).ok == [True, True, False]
    assert [bytes(d) for d in dest[:2]] == [bytes(s) for s in src[:2]]


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_an_unexpected_error_fails_the_block_and_never_hangs_the_job(make_store, monkeypatch,
                                                                     batch_io):
    store = make_store(batch_io=batch_io)
    ks, src = keys(3), rows(3, SIZE, seed=51)
    assert run_store(store, 1, list(zip(ks, src))).success

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(store.files, "read", broken)
    monkeypatch.setattr(batchio, "read_blocks", broken)
    outcome = run_load(store, 2, list(zip(ks, rows(3, SIZE))))  # drain() would time out
    assert outcome.ok == [False, False, False]
    monkeypatch.setattr(store.files, "write", broken)
    monkeypatch.setattr(batchio, "write_blocks", broken)
    assert run_store(store, 3, list(zip(keys(2), rows(2, SIZE)))).ok == [False, False]


def test_a_read_only_destination_is_never_written(make_store):
    store = make_store()
    ks, src = keys(1), rows(1, SIZE, seed=61)
    run_store(store, 1, list(zip(ks, src)))
    backing = mmap.mmap(-1, SIZE)  # page-aligned: the batch path would take it
    frozen = memoryview(backing).toreadonly()
    assert not run_load(store, 2, [(ks[0], frozen)]).success
    assert bytes(frozen) == bytes(SIZE)


def region(n: int, row: int = SIZE, seed: int | None = None) -> np.ndarray:
    """n rows of one page-aligned 2-D uint8 array, as vLLM's CPU tier holds them."""
    rows2d = np.frombuffer(mmap.mmap(-1, n * row), np.uint8).reshape(n, row)
    if seed is not None:
        rows2d[:] = np.random.default_rng(seed).integers(0, 256, rows2d.shape, np.uint8)
    return rows2d


def run_rows(store: BlockStore, kind: str, job_id: int, ks, rows2d, ids) -> object:
    (store.store_rows if kind == "store" else store.load_rows)(job_id, ks, rows2d, ids)
    assert store.drain(30)
    (outcome,) = [o for o in store.finished() if o.job_id == job_id]
    return outcome


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_rows_by_index_store_and_load_what_buffers_do(make_store, tmp_path, batch_io):
    store = make_store(batch_io=batch_io)
    ks, src = keys(6), region(8, seed=71)
    ids = [5, 0, 7, 2, 2, 3]  # any order, a row twice
    assert run_rows(store, "store", 1, ks, src, ids).ok == [True] * 6
    # The files are the ones store() writes: a buffer load reads them back.
    dests = rows(6, SIZE)
    assert run_load(store, 2, list(zip(ks, dests))).ok == [True] * 6
    assert [bytes(d) for d in dests] == [src[i].tobytes() for i in ids]
    # And rows load what buffers stored.
    more, more_src = keys(3, b"more"), rows(3, SIZE, seed=72)
    assert run_store(store, 3, list(zip(more, more_src))).success
    dest = region(4)
    outcome = run_rows(store, "load", 4, [ks[1], more[2], keys(1, b"missing")[0], more[0]],
                       dest, [3, 0, 1, 2])
    assert outcome.ok == [True, True, False, True]
    assert dest[3].tobytes() == src[0].tobytes()
    assert dest[0].tobytes() == bytes(more_src[2]) and dest[2].tobytes() == bytes(more_src[0])
    assert dest[1].tobytes() == bytes(SIZE)  # the miss wrote nothing


def test_rows_the_batch_path_cannot_take_go_the_python_way(make_store, monkeypatch):
    store = make_store()
    if not store.batch_io:
        pytest.skip("the batch path is off here")
    store.o_direct = False  # buffered: only the 8-byte-word rule keeps these rows out
    odd = SIZE + 4  # not whole 8-byte words: the machine code takes no such row
    ks, src = keys(2), region(2, odd, seed=73)
    called = []
    for name in ("write", "read"):  # one block on the Python path
        real = getattr(store.files, name)
        monkeypatch.setattr(store.files, name,
                            lambda *a, real=real, name=name: called.append(name) or real(*a))
    assert run_rows(store, "store", 1, ks, src, [0, 1]).success
    dest = region(2, odd)
    assert run_rows(store, "load", 2, ks, dest, [1, 0]).success
    assert dest[1].tobytes() == src[0].tobytes() and dest[0].tobytes() == src[1].tobytes()
    assert sorted(called) == ["read"] * 2 + ["write"] * 2


def test_rows_read_only_are_never_loaded_into(make_store):
    store = make_store()
    ks, src = keys(1), region(1, seed=74)
    assert run_rows(store, "store", 1, ks, src, [0]).success
    frozen = region(1)
    frozen.flags.writeable = False
    assert not run_rows(store, "load", 2, ks, frozen, [0]).success
    assert frozen.tobytes() == bytes(SIZE)


def test_rows_a_damaged_file_is_refused(make_store):
    store = make_store()
    ks, src = keys(2), region(2, seed=75)
    assert run_rows(store, "store", 1, ks, src, [0, 1]).success
    path = store.layout.path(ks[1])
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        f.write(b"\xff")
    dest = region(2)
    assert run_rows(store, "load", 2, ks, dest, [0, 1]).ok == [True, False]
    assert not os.path.exists(path)


@pytest.mark.skipif(not batchio.AVAILABLE, reason=batchio.UNAVAILABLE_REASON or "-")
@pytest.mark.parametrize("bad", [0, 2, 4], ids=["first", "middle", "last"])
@pytest.mark.parametrize("how", ["rows", "buffers"])
def test_one_bad_block_inside_a_batch_fails_alone(make_store, bad, how):
    store = make_store(read_threads=1, write_threads=0)  # one thread: the job is one batch
    ks, src = keys(5), region(5, seed=76)
    assert run_rows(store, "store", 1, ks, src, range(5)).success
    os.unlink(store.layout.path(ks[bad]))
    store.forget(ks[bad])
    dest = region(5)
    if how == "rows":
        outcome = run_rows(store, "load", 2, ks, dest, range(5))
    else:
        outcome = run_load(store, 2, [(k, memoryview(row)) for k, row in zip(ks, dest)])
    assert outcome.ok == [n != bad for n in range(5)]
    assert outcome.nbytes == 4 * SIZE
    for n in range(5):
        assert dest[n].tobytes() == (bytes(SIZE) if n == bad else src[n].tobytes())
    assert [store.lookup(k) for k in ks] == [n != bad for n in range(5)]  # remembered


def test_rows_bad_arguments_are_refused_before_any_work(make_store):
    store = make_store()
    with pytest.raises(ValueError, match="2-D uint8"):
        store.load_rows(1, keys(1), np.zeros(SIZE, np.uint8), [0])
    with pytest.raises(IndexError, match="row ids"):
        store.store_rows(2, keys(1), region(2), [2])
    with pytest.raises(IndexError, match="row ids"):
        store.load_rows(3, keys(2), region(2), [1, -1])
    assert store.pending_jobs() == 0


def test_observe_all_counts_like_observe_one_by_one():
    from prometheus_client import CollectorRegistry, Histogram

    from kvtier_offload.metrics import LATENCY_BUCKETS

    def samples(record) -> dict[tuple[str, str], float]:
        registry = CollectorRegistry()
        histogram = Histogram("h", "h", ("d",), buckets=LATENCY_BUCKETS, registry=registry)
        record(histogram.labels("load"))
        return {(s.name, s.labels.get("le", "")): s.value for metric in registry.collect()
                for s in metric.samples if not s.name.endswith("_created")}

    # on a bound, between bounds, below the first, above the last, repeated, empty
    batches = [[0.0005, 0.0003, 0.0007, 0.0005], [0.01, 0.009, 3.0, 99.0, 99.0], [],
               [0.0001] * 31]

    def one_by_one(child) -> None:
        for batch in batches:
            for value in batch:
                child.observe(value)

    def all_at_once(child) -> None:
        for batch in batches:
            observe_all(child, np.array(batch))

    got, want = samples(all_at_once), samples(one_by_one)
    assert got.keys() == want.keys() and len(got) == len(LATENCY_BUCKETS) + 3  # +Inf
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name

    class Plain:  # no prometheus-client internals: observe() one by one
        seen: list[float] = []

        def observe(self, value: float) -> None:
            self.seen.append(value)

    plain = Plain()
    observe_all(plain, [0.5, 0.25])
    assert plain.seen == [0.5, 0.25]


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
@pytest.mark.slow
def test_the_latency_histogram_gets_each_blocks_own_time(tmp_path, batch_io):
    from kvtier_offload.metrics import Metrics, Recorder

    recorder = Recorder()  # the raw observations, not buckets
    store = BlockStore(StoreConfig(root=str(tmp_path), fingerprint=FP, read_threads=1,
                                   write_threads=0, batch_io=batch_io), Metrics(recorder))
    # One large block after small ones, in one job (one batch, sized by the first
    # block): its time must not be spread over the others, as an average share would.
    big, small = 64 << 20, 4096
    ks = keys(6)
    sizes = [small] * 5 + [big]
    src = [rows(1, n, seed=80 + i)[0] for i, n in enumerate(sizes)]
    try:
        for direction, run, items in (
                ("store", run_store, list(zip(ks, src, strict=True))),
                ("load", run_load, list(zip(ks, [rows(1, n)[0] for n in sizes],
                                            strict=True)))):
            began = time.monotonic()
            assert run(store, 1 if direction == "store" else 2, items).success
            wall = time.monotonic() - began
            _, _, observed = recorder.take()
            times = sorted(observed[("kvtier_offload_latency_seconds", ("storage", direction))])
            assert len(times) == 6  # one observation per block, none per batch
            # The large one's own time (an average share would make all six equal),
            # against the median of the rest: a small block's time can take a scheduling
            # delay of tens of ms on a busy machine (seen with the suite on 2 workers).
            assert times[-1] > 2 * statistics.median(times[:-1]), (direction, times)
            assert 0 < sum(times) <= wall  # one thread: real times, within the job's
    finally:
        store.close()


def test_a_recorder_hands_over_increases_once_and_gauges_always():
    from kvtier_offload.metrics import Metrics, Recorder

    recorder = Recorder()
    metrics = Metrics(recorder)
    metrics.load_bytes.inc(100)
    metrics.load_bytes.inc(28)
    metrics.dropped.labels("queue-full").inc(3)
    metrics.in_queue["store"].inc(5)
    metrics.in_queue["store"].dec(2)
    metrics.load_latency.observe(0.25)
    observe_all(metrics.load_latency, np.array([0.5, 0.75]))
    counts, gauges, observed = recorder.take()
    assert counts == {("kvtier_offload_bytes", ("storage", "load")): 128,
                      ("kvtier_offload_dropped_writes", ("storage", "queue-full")): 3}
    assert gauges == {("kvtier_offload_queue_depth", ("storage", "store")): 3}
    assert observed == {("kvtier_offload_latency_seconds", ("storage", "load")):
                        [0.25, 0.5, 0.75]}
    metrics.in_queue["store"].dec(3)
    assert recorder.take() == ({}, {("kvtier_offload_queue_depth", ("storage", "store")): 0}, {})


def test_tiers_of_one_process_count_apart():
    """A local, a shared and an object tier under one vLLM report through one stats
    channel: each series carries its tier, so the operator never adds them up."""
    from kvtier_offload.metrics import Metrics, Recorder

    recorder = Recorder()
    for tier, amount in (("localDisk", 4), ("storage", 2), ("objectStore", 1)):
        Metrics(recorder, tier).load_bytes.inc(amount)
        Metrics(recorder, tier).operations.labels("load", "corrupt").inc(amount)
    counts, _, _ = recorder.take()
    assert counts[("kvtier_offload_bytes", ("localDisk", "load"))] == 4
    assert counts[("kvtier_offload_bytes", ("storage", "load"))] == 2
    assert counts[("kvtier_offload_bytes", ("objectStore", "load"))] == 1
    assert counts[("kvtier_offload_operations", ("objectStore", "load", "corrupt"))] == 1


def test_queue_depth_counts_blocks_until_they_finish(make_store, monkeypatch):
    import threading

    from prometheus_client import REGISTRY

    def depth(direction: str) -> float:
        return REGISTRY.get_sample_value("kvtier_offload_queue_depth",
                                         {"tier": "storage", "direction": direction}) or 0.0

    pool = IOPool(1, 0)
    store = make_store(pool=pool)
    before = depth("store"), depth("load")
    gate = threading.Event()
    pool.submit_write(lambda: gate.wait(10))  # the job's tasks wait behind this one
    ks, src = keys(5), rows(5, SIZE, seed=71)
    store.store(1, list(zip(ks, src)))
    assert depth("store") == before[0] + 5  # queued or in flight, counted in blocks
    gate.set()
    assert store.drain(30)
    assert depth("store") == before[0]
    run_load(store, 2, list(zip(ks, rows(5, SIZE))))
    assert (depth("store"), depth("load")) == before


def test_partial_transfers_advance_the_buffer_list():
    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"hi")]
    advance(views, 5)
    assert [bytes(v) for v in views] == [b"fg", b"hi"]
    advance(views, 4)
    assert views == []


def test_short_writes_are_resumed(make_store, monkeypatch):
    store = make_store(o_direct="off", batch_io=False)
    real = os.writev

    def stingy(fd, bufs):  # the kernel may write less than asked; never more than 1000
        first = bytes(memoryview(bufs[0])[:1000])
        return real(fd, [first])

    monkeypatch.setattr(os, "writev", stingy)
    ks, src = keys(1), rows(1, SIZE, seed=21)
    assert run_store(store, 1, list(zip(ks, src))).success
    monkeypatch.setattr(os, "writev", real)
    dest = rows(1, SIZE, seed=22)
    assert run_load(store, 2, list(zip(ks, dest))).success
    assert bytes(dest[0]) == bytes(src[0])


def test_a_new_file_format_gets_its_own_directory(monkeypatch):
    from kvtier_offload import layout

    config = {"model": "m", "dtype": "bfloat16"}
    now = layout.fingerprint(config)
    monkeypatch.setattr(layout, "VERSION", layout.VERSION + 1)
    assert layout.fingerprint(config) != now


# ------------------------------------------------ lookups on a slow or hung volume


def _vllm_prefix_scan(store, ks, seconds=5.0):
    """What vLLM's scheduler does each step: ask every key (a miss ends the prefix),
    again while any answer is "ask again"; the hit prefix once none is. Fails if the
    answers never settle within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        answers = []
        for key in ks:
            answers.append(store.lookup(key))
            if answers[-1] is False:
                break
        if None not in answers:
            return answers.index(False) if False in answers else len(answers)
        time.sleep(0.001)
    raise AssertionError("lookups never settled: the request would never be scheduled")


def hung_stats(monkeypatch, store, paths: set[str], wait) -> None:
    """Every stat (lookup) of one of these block paths calls wait() first: a slow or hung
    volume."""
    real = store.files.lstat

    def lstat(path):
        if path in paths:
            wait()
        return real(path)

    monkeypatch.setattr(store.files, "lstat", lstat)


def test_a_lookup_the_volume_never_answers_becomes_a_miss(make_store, monkeypatch):
    import threading

    store = make_store(lookup_pending_seconds=0.05)
    key = keys(1)[0]
    run_store(store, 1, [(key, memoryview(bytearray(4096)))])
    store.forget(key)
    release = threading.Event()
    hung_stats(monkeypatch, store, {store.layout.path(key)}, release.wait)  # a hung mount
    try:
        assert store.lookup(key) is None  # asked: the lookup threads stat it
        assert _vllm_prefix_scan(store, [key]) == 0  # unanswered in time: a miss
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while store.lookup(key) is not True:  # answered at last: a hit again
        assert time.monotonic() < deadline


def test_a_long_scan_on_a_slow_volume_settles_with_the_hits_it_found(make_store, monkeypatch):
    """Stats slower than the hit TTL allows for a whole prefix: hits must not expire
    before the request can use them, and the keys not reached in time are a miss."""
    ttl = 0.2
    store = make_store(lookup_hit_ttl=ttl, lookup_threads=1)
    ks = keys(40)
    run_store(store, 1, [(k, memoryview(bytearray(4096))) for k in ks])
    for k in ks:
        store.forget(k)
    # 40 keys at 10 ms: twice the hit TTL for the whole scan
    hung_stats(monkeypatch, store, {store.layout.path(k) for k in ks}, lambda: time.sleep(0.01))
    hits = _vllm_prefix_scan(store, ks)
    assert 0 < hits < len(ks)


def test_a_hit_is_answered_and_loaded_before_its_atime_refresh(make_store, monkeypatch):
    """On a network filesystem the refresh is two more round trips per block (a SETATTR
    on a busy brick): the lookup's answer and the load's report come first."""
    store = make_store(touch_interval=0.0)
    ks = keys(2)
    assert run_store(store, 1, list(zip(ks, rows(2, SIZE)))).success
    store.forget(ks[0])
    release = threading.Event()
    touched: list[str] = []

    def slow_touch(path, st, interval) -> None:
        touched.append(path)
        release.wait(30)

    monkeypatch.setattr(store.files, "touch", slow_touch)
    try:
        deadline = time.monotonic() + 10
        while (answer := store.lookup(ks[0], patient=True)) is None:
            assert time.monotonic() < deadline, "the lookup waited for the atime refresh"
            time.sleep(0.005)
        assert answer is True
        dest = [memoryview(mmap.mmap(-1, SIZE)) for _ in ks]  # aligned: the batch path
        store.load(2, list(zip(ks, dest)))
        assert store.drain(10), "the load waited for the atime refresh"
        assert store.finished()[-1].success
        assert touched  # and the refresh did start
    finally:
        release.set()
