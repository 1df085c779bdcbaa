"""kvtier as vLLM's own OffloadingSpec (vLLM 0.32 and 0.33 API): GPU (or CPU) KV blocks <-> files.

For deployments without a CPU tier. The manager runs in the scheduler and answers
lookups from the shared volume; the worker runs beside the model and copies KV pages
to and from files through staging buffers. Loaded by vLLM from kv-transfer-config with
kvtier's connector (kvtier_offload/vllm_connector.py), which can report a failed load:

    {"kv_connector": "KvtierOffloadingConnector",
     "kv_connector_module_path": "kvtier_offload.vllm_connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier_offload.vllm_spec", "root_dir": "/mnt/files-storage"}}

Failures cost a recompute, never an engine stop nor unverified bytes:
- a store that fails, or finds no staging, is reported done but never becomes visible
  (lookups stat the volume and the manager never assumes a store landed), so it is
  simply a miss later;
- a load whose blocks cannot all be verified (corrupt, short, missing, unreadable)
  copies only the verified ones, is reported by get_finished() with success=False, and
  take_load_errors() names the GPU block ids it did not fill; kvtier's connector hands
  them to vLLM, which recomputes them (vLLM's stock OffloadingConnector asserts success).
  The bad file is removed by the store.
Every tensor/pipeline-parallel rank writes its own files (the fingerprint names the
rank); a lookup is a hit only where every rank's file is there, and refreshes them all
so the evictor's LRU keeps every rank's copy of what was just promised. Where vLLM marks
the layout replicated (pure-MLA, TP only: every rank's bytes are the same), rank 0
alone stores (vLLM submits stores to rank 0 only and acknowledges for the others),
every rank loads rank 0's files, and a lookup asks that one copy.

KV events (`"enable_kv_events": true` and vLLM's --kv-events-config): the manager
announces a stored block once every rank's file is there, and an announced block whose
file it finds gone (after a failed load, or at a lookup) as removed; vLLM publishes them
as BlockStored / BlockRemoved, medium STORAGE (tier_events.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)

from kvtier_offload.cudart_copy import runtime_batch_copy
from kvtier_offload.fileformat import VERSION as FILE_FORMAT
from kvtier_offload.gpu_staging import Run, StagingArena, widest_views
from kvtier_offload.layout import fingerprint, vllm_fields
from kvtier_offload.page_copy import (
    BatchCopy,
    PageAddresses,
    memmove_batch_copy,
    vllm_batch_copy,
)
from kvtier_offload.recompute_bound import (
    PrefillRate,
    Rate,
    RequestWaits,
    load_estimate,
    recorded_end,
)
from kvtier_offload.store import BlockStore, StoreConfig
from kvtier_offload.tier_events import TierEvents

log = logging.getLogger("kvtier_offload")


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The files of a transfer: one per offload key (sent scheduler -> worker); each file
    holds one chunk of vLLM's blocks_per_chunk GPU blocks."""

    def __init__(self, keys: Iterable[OffloadKey]) -> None:
        self.keys = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.keys)} keys)"


def replicated(config: Any) -> bool:
    """Whether every rank's KV bytes are the same (vLLM's replicated_layout: pure MLA
    with tensor parallelism only), so one copy, rank 0's, serves every rank. Not with
    vLLM's canonical layout, where vLLM has every rank write."""
    return bool(getattr(config, "replicated_layout", False)) and not bool(
        getattr(config, "canonical_layout", False))


def rank_fingerprint(config: Any, rank: int) -> dict[str, Any]:
    """What makes the files of one worker rank incompatible: the shared fields, the
    worker's page size and the rank (each rank writes its own pages). Computable for every
    rank from any rank's config, the scheduler's included (where the rank is 0): with
    tensor parallelism every rank holds the same layers at the same page size; with
    pipeline parallelism each stage holds other layers, which the scheduler does not
    know, so there the rank (with tp, pp and the model) names the stage, and each block
    file's header still checks the payload length. With a replicated layout every rank
    names rank 0's files."""
    fields = {**vllm_fields(config), "mode": "worker",
              "page_bytes": config.worker_kv_bytes_per_block,
              "rank": 0 if replicated(config) else rank}
    if config.parallel.pp_size > 1:
        fields["groups"] = [{"tokens_per_block": g["tokens_per_block"]}
                            for g in fields["groups"]]
        fields["page_bytes"] = None
    return fields


def spec_fingerprint(spec: OffloadingSpec) -> dict[str, Any]:
    """The fingerprint fields of this process's own files."""
    return rank_fingerprint(spec.config, spec.config.parallel.rank)


def _store(spec: KvtierOffloadingSpec, fields: dict[str, Any],
           lookups_only: bool = False) -> BlockStore:
    extra = spec.extra_config
    return BlockStore(StoreConfig(
        root=str(extra["root_dir"]), fingerprint=fingerprint(fields),
        # the manager only looks files up: one idle I/O thread per rank's store
        read_threads=1 if lookups_only else int(extra.get("n_read_threads", 8)),
        write_threads=0 if lookups_only else int(extra.get("n_write_threads", 8)),
        o_direct=str(extra.get("o_direct", "auto")),
        write_queue_seconds=float(extra.get("write_queue_seconds", 10.0)),
        store_nice=extra.get("store_nice", StoreConfig.store_nice),  # checked there
        # the manager must stat the volume, never trust what it was told
        lookup_hit_ttl=float(extra.get("lookup_hit_ttl", 2.0)),
        # a key the volume has not answered within this is a miss (never a request
        # held back for good) until the manager has measured the engine's prefill rate;
        # from then on its recompute bound decides (recompute_bound.py)
        lookup_pending_seconds=float(extra.get("lookup_pending_seconds", 1.0)),
        lookup_threads=int(extra.get("n_lookup_threads", 4)) if lookups_only else 1,
    ))


# The recompute bound's answers (recompute_bound.RequestWaits) and vLLM's.
_PRESENT: dict[LookupResult, bool | None] = {
    LookupResult.HIT: True, LookupResult.MISS: False, LookupResult.RETRY: None}
_ANSWER: dict[bool | None, LookupResult] = {
    True: LookupResult.HIT, False: LookupResult.MISS, None: LookupResult.RETRY}
LOADED_REQUESTS = 4096  # requests whose loaded keys (and lookup waits) the manager remembers
# KV events (enable_kv_events): keys announced stored and not since removed, and keys
# whose files are to be looked at before an announcement; past these the oldest go (a
# block not announced, or a stale router entry: never a wrong byte).
ANNOUNCED_KEYS = 1 << 20
CHECKED_KEYS = 1 << 16
# How long after its store completes a block's file is still looked for (the job is
# acknowledged at its device copy, the write may still be queued): past this, a file not
# there is a write that was dropped, and nothing is announced.
LANDING_SECONDS = 60.0


def _flag(value: object) -> bool:
    """A boolean from kv_connector_extra_config (JSON true/false, or a string)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off", "")
    return bool(value)

# kvtier's labels on vLLM 0.33's vllm:kv_offload_config_info (one series, fixed for the
# process): where the files are, which fingerprint directory (rank 0's, in GPU-direct mode)
# and the block file format. The same names in both modes; never vLLM's reserved "tier".
CONFIG_INFO_KEYS = ("kvtier_root", "kvtier_fingerprint", "kvtier_file_format")


def config_info(store: BlockStore) -> dict[str, str | int]:
    """kvtier's facts for vllm:kv_offload_config_info (see CONFIG_INFO_KEYS)."""
    return {"kvtier_root": store.layout.root, "kvtier_fingerprint": store.layout.fingerprint,
            "kvtier_file_format": FILE_FORMAT}


def sync_load_budget(extra_config: Any) -> int:
    """kv_connector_extra_config.sync_load_budget_bytes (vLLM 0.33+; 0: no sync loads)."""
    return int(extra_config.get("sync_load_budget_bytes", 0) or 0)


class KvtierOffloadingManager(OffloadingManager):
    """Answers for every worker rank at once: one BlockStore per rank's files (rank 0
    first). A key is stored only where every rank's file is there: a rank's store may be
    dropped (write queue full, backoff, free-space floor) or its file evicted alone.

    Never slower than recompute (recompute_bound.py): once kvtier's connector has fed it
    the engine's prefill rate (`prefill`), a request waits on lookups only while the hit
    they may find is worth the wait, and loads only where loading beats recomputing (load
    jobs timed from prepare_load to complete_load, `load_rate`); otherwise it loads the
    prefix already confirmed and recomputes the rest, counted in
    kvtier_offload_tier_skipped{reason}. Before the first measured prefill, lookups keep
    the store's fixed lookup_pending_seconds. recompute_bound=False: that fixed deadline
    only (tests of the load path on a tiny model, where recompute is nearly free)."""

    def __init__(self, stores: BlockStore | Sequence[BlockStore], tokens_per_key: int = 1,
                 recompute_bound: bool = True, read_threads: int = 8,
                 clock: Callable[[], float] = time.monotonic,
                 events: TierEvents | None = None) -> None:
        self.stores = [stores] if isinstance(stores, BlockStore) else list(stores)
        self.tokens_per_key = max(1, tokens_per_key)
        self.recompute_bound = recompute_bound
        self.read_threads = max(1, read_threads)  # each worker's, for load estimates
        self._clock = clock
        self.prefill = PrefillRate(clock)
        self.load_rate = Rate()
        self.waits = RequestWaits(self.prefill, self.tokens_per_key, self._skipped, clock,
                                  LOADED_REQUESTS)
        self._loading: dict[str, tuple[float, int]] = {}  # req id -> (began, tokens)
        # KV events (tier_events): the manager never sees the worker's files land or go,
        # so it looks. A key whose store completed, or whose load failed, is looked up
        # again on the lookup threads; once every rank's file is there it is announced
        # stored, and an announced key found missing (removed as corrupt by the worker,
        # or evicted) is announced removed.
        self.events = events
        self._announced: OrderedDict[bytes, None] = OrderedDict()
        # key -> until when (monotonic) a missing file may still be a write in flight
        self._to_check: OrderedDict[bytes, float] = OrderedDict()
        # Keys each request has loaded, while its load may have failed. vLLM's
        # complete_load() does not say whether it succeeded: a request that looks up a
        # key it loaded is taken to be back from a failed load (to recompute), and gets a
        # miss, or it would load the same unreadable file again and again. kvtier's
        # connector clears a request's entry once its loads are known good
        # (loads_succeeded), and every entry goes when its request finishes.
        self._loaded: OrderedDict[str, set[bytes]] = OrderedDict()

    @property
    def store(self) -> BlockStore:
        """Rank 0's files."""
        return self.stores[0]

    def _known_on_every_rank(self, key: bytes) -> bool:
        """Whether the lookup cache says key's file is there for every rank (no stat)."""
        return all(store.cached(key) for store in self.stores)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        raw = bytes(key)
        if raw in self._loaded.get(req_context.req_id, ()):
            return LookupResult.MISS
        if not self.recompute_bound:
            return self._ask_stores(raw, patient=False)
        position = getattr(req_context, "get_offload_key_position", None)
        end = self.waits.end_token(req_context.req_id,
                                   position(key) if position is not None else None)
        present = self.waits.answer(
            req_context.req_id, end, lambda patient: _PRESENT[self._ask_stores(raw, patient)],
            self._load_seconds, self._expected_lookup_wait,
            lambda: recorded_end(req_context))
        return _ANSWER[present]

    def _ask_stores(self, key: bytes, patient: bool) -> LookupResult:
        # Ask every rank's store (a hit refreshes that file's atime), so no rank's copy of
        # a promised block looks idle to the evictor; a load that still misses on a rank
        # (evicted meanwhile) becomes a recompute, not an error.
        answers = [store.lookup(key, patient) for store in self.stores]
        if False in answers:
            if self.events is not None and bytes(key) in self._announced:
                del self._announced[bytes(key)]
                self.events.removed([bytes(key)])
            return LookupResult.MISS
        if None in answers:
            return LookupResult.RETRY
        return LookupResult.HIT

    def _skipped(self, reason: str) -> None:
        self.store.metrics.tier_skipped.labels(reason).inc()

    def _load_seconds(self, tokens: int) -> float | None:
        """The expected time to load tokens: at the measured load rate; before any load,
        recompute_bound.LOAD_TRIPS round trips of the volume per file on each of the workers'
        read threads."""
        trips = [t for t in (s.stat_seconds() for s in self.stores) if t is not None]
        return load_estimate(tokens, self.load_rate, max(trips, default=None),
                             self.tokens_per_key, self.read_threads)

    def _expected_lookup_wait(self) -> float | None:
        """The longest expected wait for the lookups queued on any rank's files."""
        waits = [w for w in (s.expected_lookup_wait() for s in self.stores) if w is not None]
        return max(waits, default=None)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        self._loading[req_context.req_id] = (self._clock(), len(keys) * self.tokens_per_key)
        return KvtierLoadStoreSpec(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        began = self._loading.pop(req_context.req_id, None)
        if began is not None:  # what a hit costs the request: submitted to done, queues in
            self.load_rate.add(self._clock() - began[0], began[1])
        loaded = self._loaded.setdefault(req_context.req_id, set())
        loaded.update(bytes(k) for k in keys)
        self._loaded.move_to_end(req_context.req_id)
        while len(self._loaded) > LOADED_REQUESTS:
            self._loaded.popitem(last=False)

    def loads_succeeded(self, req_ids: Iterable[str]) -> None:
        """These requests' loads so far all succeeded (a preempted one may hit them)."""
        for req_id in req_ids:
            self._loaded.pop(req_id, None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.waits.preempted(getattr(context, "preempted_req_ids", None) or ())

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._loaded.pop(req_context.req_id, None)
        self.waits.finished(req_context.req_id)
        self._loading.pop(req_context.req_id, None)

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        # From the lookup cache only: the scheduler's thread never stats the volume (a
        # hung mount would stop the engine). A key not known to be there on every rank
        # is stored; a rank whose file is there already keeps it (its rename refuses
        # to replace it where the filesystem can: store "exists"; elsewhere the same bytes
        # replace it).
        new = [k for k in keys if not self._known_on_every_rank(bytes(k))]
        return PrepareStoreOutput(keys_to_store=new, store_spec=KvtierLoadStoreSpec(new),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        # Whatever the workers said (a dropped store is reported done too), the next
        # lookup looks again, on the lookup threads; so does take_events for KV events.
        self._look_again(keys)

    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """These requests' loads may have failed (kvtier's connector): the worker removed
        what it refused, so their keys are looked at again (KV events: removed)."""
        if self.events is None:
            return
        for req_id in req_ids:
            self._look_again(self._loaded.get(req_id, ()))

    def _look_again(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            key = bytes(key)
            for store in self.stores:
                store.forget(key)
            if self.events is not None:
                self._to_check[key] = self._clock() + LANDING_SECONDS
                self._to_check.move_to_end(key)
        while len(self._to_check) > CHECKED_KEYS:
            self._to_check.popitem(last=False)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """vLLM's scheduler, every step: the keys looked at since, announced as vLLM's
        events (BlockStored once every rank's file is there, BlockRemoved for an
        announced one that is gone). Never waits: an answer still resolving is taken
        next step."""
        if self.events is None:
            return ()
        stored, removed = [], []
        now = self._clock()
        for key, until in list(self._to_check.items()):
            answers = [store.lookup(key) for store in self.stores]
            if False not in answers and None in answers:
                continue
            if False in answers:
                if key in self._announced:
                    del self._announced[key]
                    removed.append(key)
                elif now < until:
                    # A store is acknowledged at its device fence, before its file is
                    # written: not there yet is not "never", until LANDING_SECONDS.
                    continue
                del self._to_check[key]
                continue
            del self._to_check[key]
            if key not in self._announced:
                self._announced[key] = None
                stored.append(key)
        while len(self._announced) > ANNOUNCED_KEYS:
            self._announced.popitem(last=False)
        self.events.removed(removed)
        self.events.stored(stored)
        return self.events.take()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def config_info(self) -> list[dict[str, str | int]]:
        """vLLM 0.33+ (read once by the scheduler; 0.32 never asks): the labels
        KvtierOffloadingSpec.config_info_keys() declares, rank 0's files."""
        return [config_info(self.store)]

    def shutdown(self) -> None:
        for store in self.stores:
            store.close()


@dataclass
class _Job:
    """One vLLM transfer job: its pieces in flight, what it lost, when it is done."""

    job_id: int
    kind: str  # "store" or "load"
    blocks: int
    started: float = field(default_factory=time.monotonic)
    # pieces under way: a store's until its device copy has fired (its file write may
    # still hold staging: stores are acknowledged at the fence); a load's until its
    # copy to the GPU has fired or it was given up
    in_flight: int = 0
    queued: int = 0  # pieces waiting for staging
    moved: int = 0  # blocks copied (a store: to staging; a load: to the GPU)
    failed: list[int] = field(default_factory=list)  # load: GPU block ids not loaded
    expired: bool = False  # load: past load_timeout or flushed, its unread blocks given up
    expedited: bool = False  # load: vLLM waits for it within the engine step


def block_slots(files: int, group_sizes: Sequence[int], block_indices: Sequence[int],
                per_file: int, blocks: int) -> np.ndarray:
    """Where each GPU block of a transfer sits in its files, as vLLM's own CPU worker
    places them (kv_offload/cpu/gpu_worker.py): slot f * per_file + j is position j of
    the transfer's file f. The blocks come group by group (group_sizes of them), each
    group's in token order from its block_indices[g]-th block of the request: its first
    file may be entered mid-way (a load that starts inside a file, a store whose first
    chunk's blocks have left the sliding window), and its last may end early."""
    if sum(group_sizes) != blocks:
        raise ValueError(f"kvtier got {blocks} GPU block ids for group sizes "
                         f"{list(group_sizes)}")
    parts, file = [], 0
    for size, first in zip(group_sizes, block_indices, strict=True):
        if size <= 0:
            continue
        skip = int(first) % per_file
        parts.append(file * per_file + skip + np.arange(size, dtype=np.int64))
        file += -(-(skip + size) // per_file)
    if file != files:
        raise ValueError(
            f"kvtier got {blocks} GPU block ids for {files} files of {per_file} GPU "
            f"block(s) each (they fill {file}): is block_size in kv_connector_extra_config "
            "the same for the scheduler and the workers?")
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class _Piece:
    """Up to one staging run of a job: `keys[i]` is file i, in row `run.start + i` of the
    staging region; GPU block `block_ids[b]` is its slot `slots[b]` (file
    slots[b] // blocks_per_file of the piece). `fence` is the CUDA event of its device
    copy (None: already done, as on CPU)."""

    job: _Job
    keys: list[bytes]
    block_ids: np.ndarray
    slots: np.ndarray
    run: Run | None = None
    fence: Any = None
    abandoned: bool = False  # load: its job gave up on it; the read may still return
    expedited: bool = False  # load: vLLM waits for it within the engine step


class KvtierOffloadingWorker(OffloadingWorker):
    """Copies whole KV pages (every canonical tensor's page of a block) to files of
    blocks_per_chunk GPU blocks each (vLLM's chunk: block_size tokens), in token order.

    Nothing on vLLM's thread waits for the GPU or the volume: submit_*, get_finished and
    wait() on a store only queue work and look at CUDA events (wait() blocks on a store's
    device copy, which is its contract). All host memory is one staging region of at
    most max_staging_bytes, allocated here; transfers borrow runs of it piece by piece.

    - Store: each piece's pages are gathered on the store stream (after the compute
      stream's work) into staging; once its event fires its files are written, then the
      run is returned. Pieces that find no staging wait for a later poll; wait() drops
      those (vLLM reuses the blocks next), as does a submit that finds the queue full:
      a dropped store is reported done and simply never becomes visible.
    - Load: each piece's files are read and verified into staging on the I/O threads,
      then copied to the GPU on the load stream, which has priority over stores. A job
      is reported when every piece's copy has fired; blocks that could not be verified
      are not copied, the job is reported failed and take_load_errors() names them.
    On CPU tensors the copies are synchronous and the same paths run without events."""

    def __init__(self, store: BlockStore, kv_caches: CanonicalKVCaches,
                 blocks_per_chunk: int, max_staging_bytes: int = 1 << 30,
                 max_device_temp_bytes: int = 64 << 20,
                 shutdown_timeout: float = 10.0, load_timeout: float = 30.0,
                 store_device_bytes: int = 128 << 20, page_copy: str = "auto") -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be at least 1, not {blocks_per_chunk}")
        self.store = store
        self.blocks_per_file = blocks_per_chunk
        tensors = [t.tensor for t in kv_caches.tensors]
        self.pages = [t.page_size_bytes for t in kv_caches.tensors]
        self.page_total = sum(self.pages)  # one GPU block, every tensor's page
        self.file_bytes = self.page_total * blocks_per_chunk  # one file's payload
        self.device = tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.shutdown_timeout = shutdown_timeout
        self.load_timeout = load_timeout
        # A row is a file; the device copies see it as blocks_per_chunk slots.
        self.arena = StagingArena(self.file_bytes, self.cuda, max_staging_bytes,
                                  slots_per_row=blocks_per_chunk)
        wide, self._views = widest_views(tensors, self.pages, self.page_total)
        self._staging = self.arena.slots.view(wide)
        self._widths = [v.shape[1] for v in self._views]
        # page_copy: "auto" copies pages by address where the cache is on a GPU (one call
        # per piece, copy engines only): with vLLM's swap_blocks_batch where vLLM has it,
        # else with the CUDA runtime's cudaMemcpyBatchAsync (cudart_copy: torch alone,
        # CUDA 12.8+); else with gather/scatter kernels ("kernels"). "addresses" insists
        # on copying by address (by memmove on CPU).
        self._batch_copy: BatchCopy | None = None
        self.copier = "kernels"  # which copies pages: kernels, vllm, cuda-runtime, memmove
        if page_copy not in ("auto", "kernels", "addresses"):
            raise ValueError(f"page_copy is auto, kernels or addresses, not {page_copy!r}")
        if page_copy != "kernels":
            if self.cuda:
                self._batch_copy = vllm_batch_copy()
                self.copier = "vllm"
                if self._batch_copy is None:
                    self._batch_copy = runtime_batch_copy(self.device, self.arena.buffer)
                    self.copier = "cuda-runtime"
            elif page_copy == "addresses":
                self._batch_copy, self.copier = memmove_batch_copy, "memmove"
            if page_copy == "addresses" and self._batch_copy is None:
                raise ValueError("page_copy=addresses needs vLLM's swap_blocks_batch (a "
                                 "CUDA build of vLLM) or the CUDA runtime's "
                                 "cudaMemcpyBatchAsync (CUDA 12.8+) for a KV cache on a GPU")
            if self._batch_copy is None:
                self.copier = "kernels"
        self._addresses = (PageAddresses(self._views, self.arena.slots)
                           if self._batch_copy is not None else None)
        self.page_copy = "addresses" if self._batch_copy is not None else "kernels"
        # Rows per piece: bounds the device scratch of one copy (a gather holds its
        # index_select parts and their concatenation at once: twice the piece), and
        # leaves room for a job's next piece to be copied while this one is written or
        # read.
        rows = self.arena.num_rows
        self.piece_rows = max(1, min(max_device_temp_bytes // (2 * self.file_bytes),
                                     rows // 4))
        # Stores may hold all but one piece's worth: a load always finds room soon.
        self.store_rows_cap = max(1, rows - self.piece_rows)
        # Store pieces waiting for staging hold no memory, only the GPU blocks vLLM keeps
        # for them until it calls wait(), which drops them; past this many rows a store
        # is dropped at once (the volume is not keeping up).
        self.store_queue_cap = 16 * rows
        # Store copies queued on the device at once: a load's copy never queues behind
        # more than this much of a store's (G7); the rest waits on the host, where a
        # load overtakes it. At least one piece.
        self.store_device_rows = max(self.piece_rows, store_device_bytes // self.file_bytes)
        self._store_rows_held = 0  # staging rows stores hold (device copy or file write)
        self._store_rows_on_device = 0  # of those, rows whose device copy has not fired
        self._store_rows_queued = 0
        self.writes_in_flight = 0  # store pieces acknowledged, their file writes not back
        self._store_stream: torch.cuda.Stream | None
        self._load_stream: torch.cuda.Stream | None
        if self.cuda:
            self._store_stream = torch.cuda.Stream(self.device)
            self._load_stream = torch.cuda.Stream(self.device, priority=-1)  # higher
        else:
            self._store_stream = self._load_stream = None
        self._io_ids = itertools.count()
        self._store_waiting: deque[_Piece] = deque()  # no staging yet
        # Both in the order their copies were queued on their one stream, so the first
        # fence that has not fired ends each scan.
        self._copying_out: deque[_Piece] = deque()  # store: device -> staging
        self._io: dict[int, _Piece] = {}  # BlockStore job id -> piece
        self._load_waiting: deque[_Piece] = deque()  # no staging yet
        self._copying_in: deque[_Piece] = deque()  # load: staging -> device
        self._loads: dict[int, _Job] = {}  # unfinished load jobs
        self._done: list[TransferResult] = []
        self._load_errors: dict[int, list[int]] = {}
        self.stores_dropped = 0  # blocks
        self._dropped = store.metrics.dropped.labels("staging-full")
        # a store's chunk whose GPU blocks are not all there (left a sliding window):
        # never written, since a file holds whole chunks
        self._partial = store.metrics.dropped.labels("partial-file")

    # ------------------------------------------------------------ device copies

    def _on(self, stream: Any) -> Any:
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def _fence(self, stream: Any) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _index(self, first: int, count: int) -> torch.Tensor:
        """The GPU block ids of slots [first, first + count) on the device: an
        asynchronous copy from their pinned index slots, which stay borrowed until the
        run's fence has fired."""
        return self.arena.index[first:first + count].to(self.device, non_blocking=True)

    def _gather(self, piece: _Piece) -> Any:
        """Queue the copy of the piece's pages into its staging run (whole files: its
        blocks fill the run's slots in order); returns the fence."""
        run = piece.run
        assert run is not None
        first, count = run.start * self.blocks_per_file, len(piece.block_ids)
        self.arena.index_array[first:first + count] = piece.block_ids
        if self._batch_copy is not None and self._addresses is not None:
            cache, staging, sizes = self._addresses.of(piece.block_ids, first)
            with self._on(self._store_stream):
                # stream order: the source is what the compute stream wrote before
                self._batch_copy(cache, staging, sizes, False)
                return self._fence(self._store_stream)
        with self._on(self._store_stream):
            index = self._index(first, count)
            parts = [view.index_select(0, index) for view in self._views]
            packed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            self._staging[first:first + count].copy_(packed, non_blocking=True)
            return self._fence(self._store_stream)

    def _scatter(self, piece: _Piece, block_ids: np.ndarray, slots: np.ndarray) -> Any:
        """Queue the copy of the staged blocks block_ids, in the run's slots `slots`
        (ascending, relative to the run's first slot), into the KV cache; returns the
        fence. Blocks left out (a file not verified, the part of a file before a load's
        first block) are never copied."""
        run = piece.run
        assert run is not None
        first, count = run.start * self.blocks_per_file, len(block_ids)
        if self._batch_copy is not None and self._addresses is not None:
            # by address: the descriptors point at the slots where they are
            cache, staging, sizes = self._addresses.of(block_ids, first + slots)
            with self._on(self._load_stream):
                # the staging rows were filled by the I/O threads before: any order
                self._batch_copy(staging, cache, sizes, True)
                return self._fence(self._load_stream)
        if count and slots[-1] != count - 1:  # not the first `count` slots: move them there
            self.arena.slot_array[first:first + count] = self.arena.slot_array[first + slots]
        self.arena.index_array[first:first + count] = block_ids
        with self._on(self._load_stream):
            index = self._index(first, count)
            packed = self._staging[first:first + count].to(self.device, non_blocking=True)
            offset = 0
            for view, width in zip(self._views, self._widths, strict=True):
                view.index_copy_(0, index, packed[:, offset:offset + width])
                offset += width
            return self._fence(self._load_stream)

    @staticmethod
    def _fired(piece: _Piece, block: bool) -> bool:
        if piece.fence is None:
            return True
        if block:
            piece.fence.synchronize()
            return True
        return bool(piece.fence.query())

    # ------------------------------------------------------------------ jobs

    def _pairs(self, files: LoadStoreSpec,
               blocks: GPULoadStoreSpec) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """The files, their GPU blocks and each block's slot in them (block_slots)."""
        if not isinstance(files, KvtierLoadStoreSpec):
            raise TypeError(f"kvtier's worker was given {type(files).__name__}, not "
                            "KvtierLoadStoreSpec")
        block_ids = np.asarray(blocks.block_ids, dtype=np.int64)
        sizes = getattr(blocks, "group_sizes", None) or [len(block_ids)]
        firsts = getattr(blocks, "block_indices", None) or [0] * len(sizes)
        slots = block_slots(len(files.keys), sizes, firsts, self.blocks_per_file,
                            len(block_ids))
        return files.keys, block_ids, slots

    def _whole_files(self, keys: list[bytes], block_ids: np.ndarray,
                     slots: np.ndarray) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """A store's files whose every GPU block is there; the others are dropped
        (counted: partial-file) and never become visible, so a later lookup misses."""
        per_file = self.blocks_per_file
        if per_file == 1:
            return keys, block_ids, slots
        whole = np.bincount(slots // per_file, minlength=len(keys)) == per_file
        if whole.all():
            return keys, block_ids, slots
        self._partial.inc(int(len(keys) - whole.sum()))
        kept = whole[slots // per_file]
        keys = [key for key, ok in zip(keys, whole.tolist(), strict=True) if ok]
        return keys, block_ids[kept], np.arange(int(kept.sum()), dtype=np.int64)

    def _split(self, piece: _Piece, files: int) -> tuple[_Piece, _Piece]:
        """The piece's first `files` files, and the rest."""
        cut = int(np.searchsorted(piece.slots, files * self.blocks_per_file))
        head = _Piece(piece.job, piece.keys[:files], piece.block_ids[:cut],
                      piece.slots[:cut], expedited=piece.expedited)
        rest = _Piece(piece.job, piece.keys[files:], piece.block_ids[cut:],
                      piece.slots[cut:] - files * self.blocks_per_file,
                      expedited=piece.expedited)
        return head, rest

    def _pieces(self, job: _Job, keys: list[bytes], block_ids: np.ndarray,
                slots: np.ndarray, expedited: bool = False) -> list[_Piece]:
        whole = _Piece(job, keys, block_ids, slots, expedited=expedited)
        pieces = []
        while len(whole.keys) > self.piece_rows:
            piece, whole = self._split(whole, self.piece_rows)
            pieces.append(piece)
        if whole.keys:
            pieces.append(whole)
        return pieces

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        keys, block_ids, slots = self._whole_files(*self._pairs(dst_spec, src_spec))
        job = _Job(job_id, "store", len(block_ids))
        # No poll here: get_finished() moves the pipeline once per engine step.
        for piece in self._pieces(job, keys, block_ids, slots):
            if self._store_rows_queued + len(piece.keys) > self.store_queue_cap:
                self._drop(piece)
            else:
                job.queued += 1
                self._store_rows_queued += len(piece.keys)
                self._store_waiting.append(piece)
        self._start_stores()
        self._maybe_finish(job)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """expedited (vLLM 0.33+, kv_connector_extra_config.sync_load_budget_bytes): a
        "sync" load of a request that runs in this very step, which vLLM waits for
        (wait()) before the forward pass. Its pieces go ahead of every queued load that is
        not expedited, and its reads ahead of the volume's queued reads; it fails like any
        load (its unverified blocks are reported by take_load_errors()), and, like any,
        it is given up after load_timeout."""
        keys, block_ids, slots = self._pairs(src_spec, dst_spec)
        job = _Job(job_id, "load", len(block_ids), expedited=expedited)
        self._loads[job_id] = job
        pieces = self._pieces(job, keys, block_ids, slots, expedited)
        job.queued += len(pieces)
        if expedited:
            # Expedited pieces are always the head of the queue (a split piece's rest
            # goes back to the head): these go after them, in order.
            at = 0
            while at < len(self._load_waiting) and self._load_waiting[at].expedited:
                at += 1
            for n, piece in enumerate(pieces):
                self._load_waiting.insert(at + n, piece)
        else:
            self._load_waiting.extend(pieces)
        self._start_loads()
        self._maybe_finish(job)
        return True

    def _drop(self, piece: _Piece) -> None:
        """A store piece that found no staging: it will simply never be visible."""
        self.stores_dropped += len(piece.keys)
        self._dropped.inc(len(piece.keys))

    def _start_stores(self, device_bound: bool = True) -> None:
        """Start queued store pieces while staging (and, with device_bound, the device
        queue's bound) has room."""
        while self._store_waiting:
            piece = self._store_waiting[0]
            device_room = (self.store_device_rows - self._store_rows_on_device
                           if device_bound else len(piece.keys))
            room = min(len(piece.keys), self.store_rows_cap - self._store_rows_held,
                       device_room)
            run = self.arena.take(room)
            if run is None:
                return
            self._store_waiting.popleft()
            self._store_rows_queued -= len(piece.keys)
            if run.rows < len(piece.keys):  # the rest waits at the head of the queue
                piece, rest = self._split(piece, run.rows)
                piece.job.queued += 1
                self._store_rows_queued += len(rest.keys)
                self._store_waiting.appendleft(rest)
            piece.job.queued -= 1
            piece.job.in_flight += 1
            piece.run = run
            self._store_rows_held += run.rows
            self._store_rows_on_device += run.rows
            piece.fence = self._gather(piece)
            self._copying_out.append(piece)

    def _start_loads(self) -> None:
        while self._load_waiting:
            piece = self._load_waiting[0]
            run = self.arena.take(len(piece.keys))
            if run is None:
                return
            self._load_waiting.popleft()
            if run.rows < len(piece.keys):
                piece, rest = self._split(piece, run.rows)
                piece.job.queued += 1
                self._load_waiting.appendleft(rest)
            piece.job.queued -= 1
            piece.job.in_flight += 1
            piece.run = run
            io_id = next(self._io_ids)
            self._io[io_id] = piece
            self.store.load_rows(io_id, piece.keys, self.arena.row_array,
                                 self.arena.row_ids(run), urgent=piece.expedited)

    def _staged(self, piece: _Piece, ok: list[bool]) -> None:
        """A load piece's files are read: copy the blocks of the verified files to the
        GPU; a file that failed costs exactly its blocks (vLLM recomputes them)."""
        run = piece.run
        assert run is not None
        good = np.asarray(ok, dtype=bool)[piece.slots // self.blocks_per_file]
        if not good.all():
            piece.job.failed.extend(int(b) for b in piece.block_ids[~good])
        piece.job.moved += int(good.sum())
        if good.any():
            piece.fence = self._scatter(piece, piece.block_ids[good], piece.slots[good])
            self._copying_in.append(piece)
        else:
            self._release(piece)

    def _release(self, piece: _Piece) -> None:
        """A load piece's copy to the GPU has read its staging: the piece is done."""
        assert piece.run is not None
        self.arena.give(piece.run)
        piece.run = None
        piece.job.in_flight -= 1
        self._maybe_finish(piece.job)

    def _copied_out(self, piece: _Piece) -> None:
        """A store piece's device copy has fired: its pages are in staging, so vLLM may
        reuse its GPU blocks, and the job may be acknowledged now (B1: a slow or hung
        volume never holds a store job, nor the request it belongs to, in vLLM's
        scheduler). Its staging stays borrowed until the file write returns."""
        assert piece.run is not None
        self._store_rows_on_device -= piece.run.rows
        io_id = next(self._io_ids)
        self._io[io_id] = piece
        self.store.store_rows(io_id, piece.keys, self.arena.row_array,
                              self.arena.row_ids(piece.run))
        self.writes_in_flight += 1
        piece.job.moved += len(piece.block_ids)
        piece.job.in_flight -= 1
        self._maybe_finish(piece.job)

    def _written(self, piece: _Piece) -> None:
        """A store piece's file write returned (written, refused or failed): its staging
        is free again. Its job was acknowledged at the device fence."""
        assert piece.run is not None
        self.arena.give(piece.run)
        self._store_rows_held -= piece.run.rows
        self.writes_in_flight -= 1
        piece.run = None

    def _maybe_finish(self, job: _Job) -> None:
        if job.in_flight or job.queued:
            return
        size = job.moved * self.page_total
        if job.kind == "store":  # always a success: a store that fails is never visible
            self._report(job.job_id, True, size, job.started)
            return
        if self._loads.pop(job.job_id, None) is None:
            return  # reported already
        if job.failed:
            self._load_errors[job.job_id] = job.failed
            log.warning("kvtier could not verify %d of %d block(s) of load job %d; vLLM "
                        "recomputes them", len(job.failed), job.blocks, job.job_id)
        self._report(job.job_id, not job.failed, size, job.started)

    @classmethod
    def _fired_prefix(cls, copying: deque[_Piece], block_on: Collection[int]) -> list[_Piece]:
        """Take the pieces at the head of one stream's queue whose copies have fired.
        The stream runs them in order, so the scan stops at the first fence that has not
        fired; with block_on, the last piece of those jobs is waited for first (which
        fires every fence before it)."""
        if block_on:
            last = next((p for p in reversed(copying) if p.job.job_id in block_on), None)
            if last is not None:
                cls._fired(last, True)
        done = []
        while copying and cls._fired(copying[0], False):
            done.append(copying.popleft())
        return done

    def _progress(self, block_on: Collection[int] = ()) -> None:
        """Move every piece as far as it can go without waiting, except the device
        copies of jobs in block_on, which are waited for. Called once per engine step
        (get_finished) and from wait(), never from submit_*: its cost is one fence query
        per stream plus one per copy that finished."""
        for piece in self._fired_prefix(self._copying_out, block_on):
            self._copied_out(piece)
        self._expire_loads()
        for outcome in self.store.finished():
            piece = self._io.pop(outcome.job_id)
            if piece.abandoned:  # late: its job was reported failed; the read is over,
                assert piece.run is not None  # so its staging rows are free again
                self.arena.give(piece.run)
                piece.run = None
                continue
            if outcome.kind == "store":
                self._written(piece)
            else:
                self._staged(piece, outcome.ok)
        for piece in self._fired_prefix(self._copying_in, block_on):
            self._release(piece)  # the device copy has read the run
        self._start_loads()  # loads first: a cache hit must not wait behind stores
        self._start_stores()

    def _expire_loads(self) -> None:
        """Fail the load jobs older than load_timeout (a read that never returns, a hung
        volume): their pieces still waiting for staging or for the volume are given up,
        their blocks reported unloaded (vLLM recomputes them). A piece given up while
        its read is in flight keeps its staging rows until the read returns (the I/O
        thread may still write them); its result is then ignored. Pieces already
        copying to the GPU finish as usual."""
        if not self._loads:
            return
        now = time.monotonic()
        late = {job.job_id for job in self._loads.values()
                if not job.expired and now - job.started > self.load_timeout}
        if late:
            self._give_up(late, f"not done after {self.load_timeout:.1f}s (a slow or hung "
                                "volume?)")

    def _give_up(self, late: set[int], why: str) -> None:
        """Fail these load jobs' pieces still waiting for staging or for the volume (see
        _expire_loads); pieces already copying to the GPU finish as usual."""
        kept: deque[_Piece] = deque()
        for piece in self._load_waiting:
            if piece.job.job_id in late:
                piece.job.failed.extend(int(b) for b in piece.block_ids)
                piece.job.queued -= 1
            else:
                kept.append(piece)
        self._load_waiting = kept
        for piece in self._io.values():
            if piece.job.kind == "load" and piece.job.job_id in late and not piece.abandoned:
                piece.abandoned = True
                piece.job.failed.extend(int(b) for b in piece.block_ids)
                piece.job.in_flight -= 1
        for job_id in late:
            job = self._loads[job_id]
            job.expired = True
            log.warning("kvtier: load job %d %s; reporting its unread blocks failed, vLLM "
                        "recomputes them", job_id, why)
            self._maybe_finish(job)

    def _report(self, job_id: int, success: bool, size: int, started: float) -> None:
        self._done.append(TransferResult(job_id=job_id, success=success, transfer_size=size,
                                         transfer_time=time.monotonic() - started))

    def get_finished(self) -> list[TransferResult]:
        self._progress()
        out, self._done = self._done, []
        return out

    def take_load_errors(self) -> dict[int, list[int]]:
        """GPU block ids that were not loaded, by load job id, since the last call: only
        jobs reported failed by get_finished() appear (vLLM recomputes those blocks)."""
        out, self._load_errors = self._load_errors, {}
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Stores: until their GPU source pages are copied (vLLM reuses the blocks next);
        their pieces still waiting for staging are dropped, and the jobs are reported by
        the next get_finished(). Loads: vLLM flushes them at reset_prefix_cache() and
        when it preempts their request, and reuses their blocks next: the pieces already
        copying to the GPU are waited for, the rest (waiting for staging or for the
        volume) are given up at once and reported failed, so a hung volume never stalls
        the engine here. Expedited (sync) loads, which the step needs, are waited for
        until their pages are in the KV cache or reported failed (at most
        load_timeout)."""
        if any(piece.job.job_id in job_ids for piece in self._store_waiting):
            # wait() blocks on these copies anyway: the device bound (there for loads
            # queued behind) must not make vLLM's flush drop stores staging can hold
            self._start_stores(device_bound=False)
        kept: deque[_Piece] = deque()
        for piece in self._store_waiting:
            if piece.job.job_id in job_ids:
                self._drop(piece)
                self._store_rows_queued -= len(piece.keys)
                piece.job.queued -= 1
                self._maybe_finish(piece.job)
            else:
                kept.append(piece)
        self._store_waiting = kept
        self._progress(block_on=job_ids)
        flushed = {job_id for job_id in job_ids & self._loads.keys()
                   if not self._loads[job_id].expedited}
        if flushed:
            self._give_up(flushed, "was flushed by vLLM (reset_prefix_cache or a "
                                   "preemption) before its reads returned")
            self._progress(block_on=job_ids)  # the copies to the GPU already queued
        while job_ids & self._loads.keys():
            # reads in flight of expedited (sync) loads, which this very step needs
            time.sleep(0.001)
            self._progress(block_on=job_ids)

    def shutdown(self) -> None:
        """Let the device copies in flight finish, then close the block store, waiting
        at most shutdown_timeout for its I/O threads."""
        for stream in (self._store_stream, self._load_stream):
            if stream is not None:
                stream.synchronize()

        # The store's jobs hold the staging arrays they read into or write from, so a
        # thread left behind on a hung volume never touches freed memory.
        if not self.store.close(timeout=self.shutdown_timeout):
            log.warning("kvtier: the block store did not close within %.1fs (a hung "
                        "volume?); leaving its threads behind", self.shutdown_timeout)


class KvtierOffloadingSpec(OffloadingSpec):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if "root_dir" not in self.extra_config:
            raise ValueError("KvtierOffloadingSpec needs root_dir in kv_connector_extra_config")
        if sync_load_budget(self.extra_config) > 0 and len(config.groups) != 1:
            # A failed sync load can only be handed back to vLLM as GPU block ids, and
            # with several KV cache groups vLLM cannot map block ids to requests: the
            # request would run on the blocks that were not loaded (wrong tokens).
            raise ValueError(
                "kvtier: sync_load_budget_bytes > 0 (vLLM's in-step \"sync\" loads) needs "
                f"a model with one KV cache group; this one has {len(config.groups)} "
                "(a hybrid model: vLLM cannot recompute a failed sync load by block id "
                "there). Remove sync_load_budget_bytes from kv_connector_extra_config.")
        self._manager: KvtierOffloadingManager | None = None
        # vLLM's connector then submits stores on rank 0 only (the others acknowledge)
        self.replicated_layout = replicated(config)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33+: the labels the manager's config_info() fills."""
        return CONFIG_INFO_KEYS

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            stores = []
            copies = 1 if self.replicated_layout else max(1, self.config.parallel.world_size)
            for rank in range(copies):
                fields = rank_fingerprint(self.config, rank)
                store = _store(self, fields, lookups_only=True)
                store.layout.write_config(fields)
                stores.append(store)
            # Storage events with enable_kv_events (and vLLM's KV events on): the evictor
            # announces the files it deletes (kvtier_evictor.events), the manager those
            # it finds gone.
            locality = self.extra_config.get("locality")
            events = TierEvents.configured(
                self, "KvtierOffloadingSpec", bool(self.extra_config.get("enable_kv_events")),
                Medium.STORAGE, Locality(locality) if locality is not None else None)
            self._manager = KvtierOffloadingManager(
                stores, tokens_per_key=self.config.groups[0].tokens_per_block
                * self.blocks_per_chunk,
                recompute_bound=_flag(self.extra_config.get("recompute_bound", True)),
                read_threads=int(self.extra_config.get("n_read_threads", 8)), events=events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return KvtierOffloadingWorker(
            _store(self, spec_fingerprint(self)), kv_caches, self.blocks_per_chunk,
            max_staging_bytes=int(self.extra_config.get("max_staging_bytes", 1 << 30)),
            shutdown_timeout=float(self.extra_config.get("shutdown_timeout", 10.0)),
            page_copy=str(self.extra_config.get("page_copy", "auto")),
            store_device_bytes=int(self.extra_config.get("store_device_bytes", 128 << 20)),
            load_timeout=float(self.extra_config.get("load_timeout_seconds", 30.0)))
