"""The block store on a real network filesystem (GlusterFS, two FUSE client mounts = two
nodes with their own client caches): what one node writes the other reads byte for byte,
a reader never meets a half-written block, writers of the same key on both nodes do not
mix, the evictor deleting beside two readers costs misses only, and a full volume fails
stores cleanly while loads go on."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
from prometheus_client import REGISTRY

from kvtier_offload.store import BlockStore, StoreConfig
from tests.offload.conftest import FP, run_load, run_store

pytestmark = [pytest.mark.glusterfs, pytest.mark.timeout(300)]
KIB = 1024


def block(key: bytes, size: int) -> memoryview:
    """The one right content of key: page-aligned, derived from the key."""
    import mmap
    buf = mmap.mmap(-1, size)
    seed = hashlib.sha256(key).digest()
    buf[:] = (seed * (size // len(seed) + 1))[:size]
    return memoryview(buf)


def key(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"{salt}{i}".encode()).digest() + b"\0\0\0\0"


def empty(size: int) -> memoryview:
    import mmap
    return memoryview(mmap.mmap(-1, size))


def corrupt_count() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "kvtier_offload_corrupt_files"
               for s in m.samples if s.name.endswith("_total"))


def temps(root) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


@pytest.fixture
def stores(nodes):
    made: list[BlockStore] = []

    def make(root, **kw) -> BlockStore:
        kw.setdefault("read_threads", 4)
        kw.setdefault("write_threads", 4)
        kw.setdefault("lookup_miss_ttl", 0.0)
        store = BlockStore(StoreConfig(root=str(root), fingerprint=FP, **kw))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_blocks_written_on_node_a_are_read_on_node_b(nodes, stores, batch_io):
    a, b = nodes
    sa, sb = stores(a, batch_io=batch_io), stores(b, batch_io=batch_io)
    ks = [key(i, "ab") for i in range(16)]
    src = [block(k, 256 * KIB) for k in ks]
    assert run_store(sa, 1, list(zip(ks, src))).success
    assert sb.lookup_now(ks) == [True] * 16
    dest = [empty(256 * KIB) for _ in ks]
    assert run_load(sb, 2, list(zip(ks, dest))).success
    assert [bytes(d) for d in dest] == [bytes(s) for s in src]


def test_a_reader_on_node_b_never_meets_a_partial_block(nodes, stores):
    """Node A publishes 2 MiB blocks while node B loads them as fast as it can: each load
    is a miss or the right bytes, and B never refuses a file (a partial block would be
    refused as truncated/bad and counted)."""
    a, b = nodes
    size, n = 2 << 20, 48
    ks = [key(i, "partial") for i in range(n)]
    sa, sb = stores(a, batch_io=False), stores(b)
    before = corrupt_count()
    done = threading.Event()
    seen = {"hits": 0, "misses": 0, "wrong": 0, "rounds": 0}

    def reader() -> None:
        dest = [empty(size) for _ in range(4)]
        while not done.is_set() or seen["rounds"] < 2:
            for start in range(0, n, 4):
                batch = ks[start:start + 4]
                sb.load(1000 + seen["rounds"] * n + start, list(zip(batch, dest)))
                assert sb.drain(60)
                (out,) = sb.finished()
                for k, ok, d in zip(batch, out.ok, dest, strict=False):
                    if ok:
                        seen["hits"] += 1
                        seen["wrong"] += bytes(d) != bytes(block(k, size))
                    else:
                        seen["misses"] += 1
            seen["rounds"] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for start in range(0, n, 2):
            batch = ks[start:start + 2]
            assert run_store(sa, start + 1, [(k, block(k, size)) for k in batch]).success
    finally:
        done.set()
        thread.join(120)
    assert seen["wrong"] == 0
    assert corrupt_count() == before, "node B refused a block file: it met a partial one"
    assert seen["hits"] > 0 and seen["misses"] > 0, seen  # the race really happened
    dest = [empty(size) for _ in ks]
    assert run_load(sb, 99, list(zip(ks, dest))).success  # nothing was lost on the way


def test_writers_of_the_same_key_on_both_nodes_do_not_mix(nodes, stores):
    a, b = nodes
    size = 1 << 20
    sa, sb = stores(a, batch_io=True), stores(b, batch_io=False)
    before = corrupt_count()
    for rnd in range(3):
        ks = [key(i, f"same{rnd}") for i in range(24)]
        items = [(k, block(k, size)) for k in ks]
        for s, job in ((sa, 1), (sb, 2)):
            s.store(rnd * 10 + job, items)
        assert sa.drain(60) and sb.drain(60)
        outs = sa.finished() + sb.finished()
        # each key stored by at least one node (the other may find it already there)
        assert all(any(o.ok[i] for o in outs) for i in range(len(ks))), outs
        for s, job in ((sa, 3), (sb, 4)):
            dest = [empty(size) for _ in ks]
            out = run_load(s, rnd * 10 + job, list(zip(ks, dest)))
            assert all(bytes(d) == bytes(v) for d, (_, v), ok
                       in zip(dest, items, out.ok, strict=True) if ok)
            # A node whose cached inode the other's rename replaced may get ESTALE until
            # its FUSE entry cache times out (1 s; the Python path still misses, see below); asked
            # again after that, every block is there, intact.
            again = [i for i, ok in enumerate(out.ok) if not ok]
            time.sleep(1.5 if again else 0)
            dest = [empty(size) for _ in again]
            assert run_load(s, rnd * 10 + job + 5,
                            [(ks[i], d) for i, d in zip(again, dest, strict=True)]).success
            assert all(bytes(d) == bytes(items[i][1]) for i, d in zip(again, dest,
                                                                     strict=True))
    assert corrupt_count() == before
    assert temps(a) == []


@pytest.mark.parametrize("batch_io", [
    True,
    False,
], ids=["batch", "python"])
def test_a_block_replaced_by_the_other_node_is_still_a_hit(nodes, stores, batch_io):
    """Node A's cached name points at the file node B replaced (GlusterFS: for its 1 s
    entry timeout): the open succeeds, its first fstat or read fails with ESTALE. The
    load stats the name (the kernel then looks it up afresh) and tries once more."""
    a, b = nodes
    size = 256 * KIB
    sa, sb = stores(a, batch_io=batch_io), stores(b, batch_io=batch_io)
    ks = [key(i, f"estale{batch_io}") for i in range(16)]
    items = [(k, block(k, size)) for k in ks]
    assert run_store(sa, 1, items).success
    dest = [empty(size) for _ in ks]
    assert run_load(sa, 2, list(zip(ks, dest))).success  # node A caches the inodes
    for k in ks:  # node B replaces each file (the same bytes, a new inode)
        sb.forget(k)
        os.unlink(sb.layout.path(k))
    assert run_store(sb, 3, items).success
    dest = [empty(size) for _ in ks]
    assert run_load(sa, 4, list(zip(ks, dest))).success
    assert all(bytes(d) == bytes(v) for d, (_, v) in zip(dest, items, strict=True))


def test_the_evictor_on_a_third_node_costs_readers_misses_only(gluster, nodes, stores,
                                                             tmp_path):
    from kvtier_evictor import cli

    a, b = nodes
    size, n = 256 * KIB, 120
    ks = [key(i, "evict") for i in range(n)]
    sa, sb = stores(a), stores(b)
    assert run_store(sa, 1, [(k, block(k, size)) for k in ks]).success
    old = time.time() - 7200
    for root, _, files in os.walk(a):
        for f in files:
            os.utime(os.path.join(root, f), (old, old))
    before = corrupt_count()
    stop = threading.Event()
    tally = {"hits": 0, "misses": 0, "wrong": 0}

    def reader(store: BlockStore, base: int) -> None:
        dest = [empty(size) for _ in range(8)]
        job = base
        while not stop.is_set():
            for start in range(0, n, 8):
                batch = ks[start:start + 8]
                job += 1
                store.load(job, list(zip(batch, dest)))
                assert store.drain(60)
                (out,) = store.finished()
                for k, ok, d in zip(batch, out.ok, dest, strict=False):
                    if ok:
                        tally["hits"] += 1
                        tally["wrong"] += bytes(d) != bytes(block(k, size))
                    else:
                        tally["misses"] += 1

    readers = [threading.Thread(target=reader, args=(s, base))
               for s, base in ((sa, 10_000), (sb, 20_000))]
    for t in readers:
        t.start()
    try:
        with gluster.mount(tmp_path / "nodec") as c:
            used = n * size  # budget mode: the cache's own bytes against a capacity
            log = tmp_path / "termination-log"
            code = cli.main(["--root", str(c / a.name), "--capacity-bytes",
                             str(int(used / 0.95)), "--min-idle-seconds", "0",
                             "--dir-guard-seconds", "0", "--termination-log", str(log)])
    finally:
        stop.set()
        for t in readers:
            t.join(120)
    assert code == 3, log.read_text()
    assert tally["wrong"] == 0 and tally["hits"] > 0, tally
    assert corrupt_count() == before
    time.sleep(1.5)  # node B's FUSE entry cache (1 s) learns of the deletions
    left = [k for k in ks if os.path.exists(sb.layout.path(k))]
    assert 0 < len(left) < n  # some deleted, some kept
    dest = [empty(size) for _ in left]
    assert run_load(sb, 99, list(zip(left, dest))).success


def test_a_full_volume_fails_stores_cleanly_and_loads_go_on(nodes, stores):
    a, b = nodes
    size = 1 << 20
    sa, sb = stores(a, free_space_floor_percent=0.0), stores(b, free_space_floor_percent=0.0)
    kept = [key(i, "full-kept") for i in range(4)]
    assert run_store(sa, 1, [(k, block(k, size)) for k in kept]).success
    filler = a / "filler"
    chunk = os.urandom(4 << 20)
    try:
        with open(filler, "wb") as f:
            while True:
                st = os.statvfs(a)
                if st.f_bavail * st.f_frsize < 10 << 20:
                    break
                f.write(chunk)
        ks = [key(i, "full") for i in range(16)]
        out = run_store(sb, 2, [(k, block(k, size)) for k in ks])
        assert out.ok.count(False) > 0  # the volume filled up part way
        assert temps(a) == []
        dest = [empty(size) for _ in kept]
        assert run_load(sb, 3, list(zip(kept, dest))).success
        assert [bytes(d) for d in dest] == [bytes(block(k, size)) for k in kept]
    finally:
        filler.unlink(missing_ok=True)
