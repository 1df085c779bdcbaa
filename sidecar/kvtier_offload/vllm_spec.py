"""kvtier as vLLM's own OffloadingSpec (vLLM 0.32 API): GPU (or CPU) KV blocks <-> files.

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
- a store that fails is reported done but never becomes visible (lookups stat the
  volume and the manager never assumes a store landed), so it is simply a miss later;
- a load that cannot be verified (corrupt, short, missing, unreadable) is reported
  failed, with the GPU blocks it did not fill (take_load_errors); kvtier's connector
  hands them to vLLM, which recomputes them. The bad file is removed by the store.
Every tensor/pipeline-parallel rank writes its own files (the fingerprint names the
rank); a lookup is a hit only where every rank's file is there, and refreshes them all
so the evictor's LRU keeps every rank's copy of what was just promised.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
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
    TransferResult,
)

from kvtier_offload.layout import fingerprint, vllm_fields
from kvtier_offload.store import BlockStore, StoreConfig

log = logging.getLogger("kvtier_offload")


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The files of a transfer: one per offload key (sent scheduler -> worker)."""

    def __init__(self, keys: Iterable[OffloadKey]) -> None:
        self.keys = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.keys)} keys)"


def rank_fingerprint(config: Any, rank: int) -> dict[str, Any]:
    """What makes the files of one worker rank incompatible: the shared fields, the
    worker's page size and the rank (each rank writes its own pages). Computable for every
    rank from any rank's config, the scheduler's included (where the rank is 0): with
    tensor parallelism every rank holds the same layers at the same page size; with
    pipeline parallelism each stage holds other layers, which the scheduler does not
    know, so there the rank (with tp, pp and the model) names the stage, and each block
    file's header still checks the payload length."""
    fields = {**vllm_fields(config), "mode": "worker",
              "page_bytes": config.worker_kv_bytes_per_block, "rank": rank}
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
        # the manager must stat the volume, never trust what it was told
        lookup_hit_ttl=float(extra.get("lookup_hit_ttl", 2.0)),
    ))


LOADED_REQUESTS = 4096  # requests whose loaded keys the manager remembers


class KvtierOffloadingManager(OffloadingManager):
    """Answers for every worker rank at once: one BlockStore per rank's files (rank 0
    first). A key is stored only where every rank's file is there: a rank's store may be
    dropped (write queue full, backoff, free-space floor) or its file evicted alone."""

    def __init__(self, stores: BlockStore | Sequence[BlockStore], events: bool = False) -> None:
        self.stores = [stores] if isinstance(stores, BlockStore) else list(stores)
        self._events: list[OffloadingEvent] | None = [] if events else None
        # Keys each recent request has loaded. vLLM does not tell the manager whether a
        # load succeeded; a request that looks up a key it has loaded is one whose load
        # failed (it is back to recompute), or one preempted since: a miss for it either
        # way, or it would load the same unreadable file again and again.
        self._loaded: OrderedDict[str, set[bytes]] = OrderedDict()

    @property
    def store(self) -> BlockStore:
        """Rank 0's files."""
        return self.stores[0]

    def _on_every_rank(self, keys: Collection[OffloadKey]) -> list[bool]:
        """Whether each key's file is there for every rank, now (stat where not cached)."""
        raw = [bytes(k) for k in keys]
        there = [True] * len(raw)
        for store in self.stores:
            there = [a and b for a, b in zip(there, store.lookup_now(raw), strict=True)]
        return there

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if bytes(key) in self._loaded.get(req_context.req_id, ()):
            return LookupResult.MISS
        # Ask every rank's store (a hit refreshes that file's atime), so no rank's copy of
        # a promised block looks idle to the evictor; a load that still misses on a rank
        # (evicted meanwhile) becomes a recompute, not an error.
        answers = [store.lookup(bytes(key)) for store in self.stores]
        if False in answers:
            return LookupResult.MISS
        if None in answers:
            return LookupResult.RETRY
        return LookupResult.HIT

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return KvtierLoadStoreSpec(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loaded = self._loaded.setdefault(req_context.req_id, set())
        loaded.update(bytes(k) for k in keys)
        self._loaded.move_to_end(req_context.req_id)
        while len(self._loaded) > LOADED_REQUESTS:
            self._loaded.popitem(last=False)

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        # A key missing on any rank is stored again: ranks that have it skip the write.
        new = [k for k, there in zip(keys, self._on_every_rank(keys), strict=True)
               if not there]
        return PrepareStoreOutput(keys_to_store=new, store_spec=KvtierLoadStoreSpec(new),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        for store in self.stores:  # whatever the workers said, let the next lookup look
            for key in keys:
                store.forget(bytes(key))
        if self._events is not None and keys:
            # Announce only what really landed: a dropped store was reported "done" too.
            landed = [k for k, there in zip(keys, self._on_every_rank(keys), strict=True)
                      if there]
            if landed:
                self._events.append(OffloadingEvent(keys=list(landed), medium=Medium.STORAGE,
                                                    removed=False))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        out, self._events = self._events, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        for store in self.stores:
            store.close()


class StagingPool:
    """Reusable staging buffers (pinned when the KV lives on a GPU), bounded in bytes:
    buffers are kept per row count and reused; above the bound, acquire() waits for
    stores in flight to finish with theirs."""

    def __init__(self, row_bytes: int, pinned: bool, max_bytes: int) -> None:
        self.row_bytes, self.pinned, self.max_bytes = row_bytes, pinned, max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._held = 0  # bytes of every buffer allocated (free or in use)

    def acquire(self, rows: int, make_room: Any) -> torch.Tensor:
        free = self._free.get(rows)
        if free:
            return free.pop()
        need = rows * self.row_bytes
        while self._held + need > self.max_bytes and self._held > 0:
            if not self._drop_one_free():
                make_room()  # collects finished stores, which release their buffers
                time.sleep(0.001)
        self._held += need
        return torch.empty((rows, self.row_bytes), dtype=torch.int8, pin_memory=self.pinned)

    def _drop_one_free(self) -> bool:
        for rows, buffers in self._free.items():
            if buffers:
                buffers.pop()
                self._held -= rows * self.row_bytes
                return True
        return False

    def release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault(buffer.shape[0], []).append(buffer)


@dataclass
class _Transfer:
    """One worker job on its way: store = device copy -> file writes; load = file reads
    -> device copy. `fence` is the CUDA event of the device copy (None: already done)."""

    job_id: int
    keys: list[bytes]
    block_ids: np.ndarray
    staging: torch.Tensor
    started: float = field(default_factory=time.monotonic)
    fence: Any = None

    def items(self) -> list[tuple[bytes, memoryview]]:
        """(key, staging row) pairs for the block store."""
        arr = self.staging.numpy().view(np.uint8)
        return [(k, memoryview(arr[i])) for i, k in enumerate(self.keys)]


class KvtierOffloadingWorker(OffloadingWorker):
    """Copies whole KV pages (every canonical tensor's page of a block) to one file.

    Everything is asynchronous: submit_* return at once. A store's pages are gathered on
    a side stream (after the compute stream's work) into a pinned staging buffer, and
    its files are written once that copy's event has fired; wait() blocks on the event,
    so vLLM may reuse the GPU blocks when it returns. A load reads and verifies its files
    into staging on the I/O threads, then copies to the GPU on a side stream; it is
    reported finished only when that copy's event has fired. On CPU tensors the copies
    are synchronous and the same paths run without events."""

    def __init__(self, store: BlockStore, kv_caches: CanonicalKVCaches,
                 blocks_per_chunk: int, max_staging_bytes: int = 1 << 30,
                 max_device_temp_bytes: int = 64 << 20) -> None:
        if blocks_per_chunk != 1:
            raise ValueError("KvtierOffloadingSpec stores one GPU block per file: leave "
                             "block_size unset in kv_connector_extra_config")
        self.store = store
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.pages = [t.page_size_bytes for t in kv_caches.tensors]
        self.page_total = sum(self.pages)
        self.device = self.tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.staging = StagingPool(self.page_total, self.cuda, max_staging_bytes)
        # Rows gathered on the device per copy: bounds the device scratch memory.
        self.chunk_rows = max(1, max_device_temp_bytes // self.page_total)
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._done: list[TransferResult] = []
        self._copying_out: dict[int, _Transfer] = {}  # store: device -> staging
        self._io: dict[int, _Transfer] = {}  # BlockStore job id -> transfer
        self._copying_in: dict[int, _Transfer] = {}  # load: staging -> device
        self._load_errors: dict[int, list[int]] = {}  # failed load job -> its block ids

    # ------------------------------------------------------------ device copies

    def _on_side_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    def _fence(self) -> Any:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _gather(self, block_ids: np.ndarray, staging: torch.Tensor) -> Any:
        """Queue the copy of the blocks' pages into staging, one contiguous transfer per
        chunk of rows; returns the fence of the copy."""
        with self._on_side_stream():
            index = torch.as_tensor(block_ids.astype(np.int64)).to(self.device)
            for first in range(0, len(block_ids), self.chunk_rows):
                rows = index[first:first + self.chunk_rows]
                parts = [t.index_select(0, rows).reshape(len(rows), -1)[:, :page]
                         for t, page in zip(self.tensors, self.pages, strict=True)]
                packed = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                staging[first:first + len(rows)].copy_(packed, non_blocking=True)
            return self._fence()

    def _scatter(self, block_ids: np.ndarray, staging: torch.Tensor) -> Any:
        """Queue the copy of staged pages into the blocks; returns the fence."""
        with self._on_side_stream():
            index = torch.as_tensor(block_ids.astype(np.int64)).to(self.device)
            for first in range(0, len(block_ids), self.chunk_rows):
                rows = index[first:first + self.chunk_rows]
                packed = staging[first:first + len(rows)].to(self.device, non_blocking=True)
                offset = 0
                for tensor, page in zip(self.tensors, self.pages, strict=True):
                    # Rows may be strided (packed blocks): index the tensor itself.
                    view = tensor if tensor.dim() == 2 else tensor.flatten(1)
                    view[rows, :page] = packed[:, offset:offset + page]
                    offset += page
            return self._fence()

    @staticmethod
    def _fired(transfer: _Transfer, block: bool) -> bool:
        if transfer.fence is None:
            return True
        if block:
            transfer.fence.synchronize()
            return True
        return bool(transfer.fence.query())

    # ------------------------------------------------------------------ jobs

    def _begin(self, job_id: int, files: LoadStoreSpec,
               blocks: GPULoadStoreSpec) -> _Transfer | None:
        """A transfer with its staging buffer, or None (reported done) for no files."""
        assert isinstance(files, KvtierLoadStoreSpec)
        if not files.keys:
            self._report(job_id, 0, time.monotonic())
            return None
        # The first chunk may be partial: the files match the last block ids.
        block_ids = np.asarray(blocks.block_ids)[-len(files.keys):]
        staging = self.staging.acquire(len(files.keys), self._progress)
        return _Transfer(job_id, files.keys, block_ids, staging)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        transfer = self._begin(job_id, dst_spec, src_spec)
        if transfer is not None:
            transfer.fence = self._gather(transfer.block_ids, transfer.staging)
            self._copying_out[job_id] = transfer
            self._progress()
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        transfer = self._begin(job_id, src_spec, dst_spec)
        if transfer is not None:
            load_id = -job_id - 1  # store and load job ids share the store's namespace
            self._io[load_id] = transfer
            self.store.load(load_id, transfer.items())
        return True

    def _progress(self, block_on: Collection[int] = ()) -> None:
        """Move every transfer as far as it can go without waiting, except those in
        block_on, which are waited for: stores until their device copy is done, loads
        until they are finished."""
        for job_id, t in list(self._copying_out.items()):
            if self._fired(t, job_id in block_on):
                del self._copying_out[job_id]
                self._io[job_id] = t
                self.store.store(job_id, t.items())
        while True:
            waiting = {-j - 1 for j in block_on} & self._io.keys()
            if waiting:
                self.store.drain()
            for outcome in self.store.finished():
                t = self._io.pop(outcome.job_id)
                if outcome.kind == "store":
                    # Always a success to vLLM: a store that failed never becomes visible.
                    self.staging.release(t.staging)
                    self._report(t.job_id, len(t.keys) * self.page_total, t.started)
                elif not outcome.success:
                    # Nothing unverified reaches the KV cache: the job's blocks are left
                    # for vLLM to recompute (take_load_errors), the job reported failed.
                    self.staging.release(t.staging)
                    self._load_errors[t.job_id] = [int(b) for b in t.block_ids]
                    self._report(t.job_id, 0, t.started, success=False)
                else:
                    t.fence = self._scatter(t.block_ids, t.staging)
                    self._copying_in[t.job_id] = t
            if not waiting:
                break
        for job_id, t in list(self._copying_in.items()):
            if self._fired(t, job_id in block_on):
                del self._copying_in[job_id]
                self.staging.release(t.staging)  # the device copy has read it
                self._report(job_id, len(t.keys) * self.page_total, t.started)

    def _report(self, job_id: int, size: int, started: float, success: bool = True) -> None:
        self._done.append(TransferResult(job_id=job_id, success=success, transfer_size=size,
                                         transfer_time=time.monotonic() - started))

    def take_load_errors(self) -> dict[int, list[int]]:
        """GPU block ids that failed loads left unfilled, by job id, since the last call
        (each such job is reported by get_finished() with success=False)."""
        out, self._load_errors = self._load_errors, {}
        return out

    def get_finished(self) -> list[TransferResult]:
        self._progress()
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Stores: until their GPU source pages are copied (vLLM reuses the blocks next).
        Loads: until their pages are in the KV cache."""
        self._progress(block_on=job_ids)

    def shutdown(self) -> None:
        self.store.close()


class KvtierOffloadingSpec(OffloadingSpec):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if "root_dir" not in self.extra_config:
            raise ValueError("KvtierOffloadingSpec needs root_dir in kv_connector_extra_config")
        self._manager: KvtierOffloadingManager | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            stores = []
            for rank in range(max(1, self.config.parallel.world_size)):
                fields = rank_fingerprint(self.config, rank)
                store = _store(self, fields, lookups_only=True)
                store.layout.write_config(fields)
                stores.append(store)
            self._manager = KvtierOffloadingManager(
                stores, events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return KvtierOffloadingWorker(
            _store(self, spec_fingerprint(self)), kv_caches, self.blocks_per_chunk,
            max_staging_bytes=int(self.extra_config.get("max_staging_bytes", 1 << 30)))
