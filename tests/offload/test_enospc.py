"""ENOSPC on a real tiny filesystem: stores fail and back off, loads keep working,
nothing crashes and no temp file is left behind."""

from __future__ import annotations

import os

import pytest

from kvtier_offload.store import BlockStore, StoreConfig
from tests.mounts import tmpfs
from tests.offload.conftest import FP, keys, rows, run_load, run_store

pytestmark = pytest.mark.privileged
BLOCK = 1 << 20


@pytest.mark.parametrize("batch_io", [True, False], ids=["batch", "python"])
def test_full_volume(tmp_path, batch_io):
    with tmpfs(tmp_path / "vol", "8m") as vol:
        store = BlockStore(StoreConfig(root=str(vol), fingerprint=FP, read_threads=2,
                                       write_threads=2, free_space_floor_percent=0.0,
                                       batch_io=batch_io))
        try:
            ks, src = keys(12), rows(12, BLOCK, seed=1)
            first = run_store(store, 1, list(zip(ks, src)))
            stored = [k for k, ok in zip(ks, first.ok) if ok]
            assert 0 < len(stored) < 12  # the 8 MiB volume filled up part way
            assert store.admission.blocked_until > 0  # ENOSPC backs the writers off
            dest = rows(len(stored), BLOCK, seed=2)
            assert run_load(store, 3, list(zip(stored, dest))).success
            want = [bytes(s) for k, s in zip(ks, src) if k in stored]
            assert [bytes(d) for d in dest] == want
            tmps = [f for _, _, fs in os.walk(vol) for f in fs if f.endswith(".tmp")]
            assert tmps == []
        finally:
            store.close()


def test_free_space_floor_on_a_real_volume(tmp_path):
    with tmpfs(tmp_path / "vol", "8m") as vol:
        store = BlockStore(StoreConfig(root=str(vol), fingerprint=FP, read_threads=1,
                                       write_threads=1, free_space_floor_percent=50.0))
        try:
            ks = keys(6)
            outcome = run_store(store, 1, list(zip(ks, rows(6, BLOCK))))
            st = os.statvfs(vol)
            assert st.f_bavail / st.f_blocks >= 0.40  # stopped near the floor, not at 0
            assert outcome.ok.count(False) >= 2
        finally:
            store.close()
