from __future__ import annotations

import mmap
import os

import pytest

from kvtier_offload.store import BlockStore, StoreConfig

FP = "00112233aabbccdd"


@pytest.fixture
def make_store(tmp_path):
    stores: list[BlockStore] = []

    def make(root=None, pool=None, **kw) -> BlockStore:
        kw.setdefault("read_threads", 2)
        kw.setdefault("write_threads", 2)
        kw.setdefault("fingerprint", FP)
        store = BlockStore(StoreConfig(root=str(root or tmp_path), **kw), pool=pool)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def rows(n: int, size: int, seed: int = 0) -> list[memoryview]:
    """n page-aligned rows of random bytes, as vLLM's CPU tier hands them over."""
    arena = mmap.mmap(-1, n * size)
    rng = __import__("random").Random(seed)
    arena[:] = rng.randbytes(n * size)
    return [memoryview(arena)[i * size:(i + 1) * size] for i in range(n)]


def keys(n: int, salt: bytes = b"") -> list[bytes]:
    return [os.urandom(32) + i.to_bytes(4, "big") if not salt else
            __import__("hashlib").sha256(salt + bytes([i])).digest() + b"\0\0\0\0"
            for i in range(n)]


def run_store(store: BlockStore, job_id: int, items) -> object:
    store.store(job_id, items)
    assert store.drain(30)
    (outcome,) = [o for o in store.finished() if o.job_id == job_id]
    return outcome


def run_load(store: BlockStore, job_id: int, items) -> object:
    store.load(job_id, items)
    assert store.drain(30)
    (outcome,) = [o for o in store.finished() if o.job_id == job_id]
    return outcome


def round_trip_source(root: str) -> str:
    """Python source that stores one block through a fresh BlockStore under root and
    loads it back (assert included), for tests that must run it in a process of their
    own (numba missing, refusing to compile...); `store` is left closed."""
    return f"""
from kvtier_offload.store import BlockStore, StoreConfig
store = BlockStore(StoreConfig(root={root!r}, fingerprint={FP!r}))
data = memoryview(bytearray(range(256)) * 1024)
store.store(1, [(b"k" * 36, data)])
store.drain()
dest = memoryview(bytearray(len(data)))
store.load(2, [(b"k" * 36, dest)])
store.drain()
assert [o.success for o in store.finished()] == [True, True] and dest == data
store.close()
"""
