"""kvtier as a secondary tier of vLLM's TieringOffloadingSpec (vLLM 0.28+, built on 0.32, 0.33).

vLLM's own CPU tier moves KV between GPU and pinned CPU memory; this tier moves whole
CPU-tier rows between that memory and block files, in the scheduler process. Loaded by
vLLM from the kv-transfer-config the operator renders:

    {"type": "KvtierStorageTier", "module_path": "kvtier_offload.vllm_tier",
     "root_dir": "/mnt/files-storage", "n_read_threads": 16, "n_write_threads": 16}

A node-local directory (local NVMe) goes before the shared one in secondary_tiers, with
"capacity_bytes": the tier then never holds more than that (capacity.py).

Failures are first-class here: a failed load makes vLLM recompute, so the store reports
exactly what it could verify and nothing more.

Never slower than recompute (recompute_bound.py), as in GPU-direct mode and with the same
decision (RequestWaits): vLLM's tiering asks a secondary tier only whether each chunk is
there (HIT, MISS, or RETRY: ask again next step, the request waits), stops a request's
scan at the first MISS and promotes each HIT at once. So the tier answers RETRY while the
volume's answers are worth waiting for, and MISS from the chunk where waiting (or
loading) would cost more than recomputing: the chunks already found load, the rest is
recomputed, counted in kvtier_offload_tier_skipped{reason}. The tier never sees the
engine's steps, so it times prompts itself (PromptTimes: first scheduled, on_schedule_end,
to its last chunk cascaded here) and loads from submit_load to their result. Setting
"recompute_bound": false keeps only the fixed lookup_pending_seconds deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier_offload.fileformat import VERSION as FILE_FORMAT
from kvtier_offload.layout import fingerprint, vllm_fields
from kvtier_offload.metrics import DEFINITIONS, SHARED_TIER, Metrics, Recorder
from kvtier_offload.recompute_bound import (
    PromptTimes,
    Rate,
    RequestWaits,
    load_estimate,
    recorded_end,
)
from kvtier_offload.tier_events import TierEvents

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata

log = logging.getLogger("kvtier_offload")


def fingerprint_config(spec: Any, row_bytes: int) -> dict[str, Any]:
    """What makes this tier's files incompatible: the shared fields plus the CPU-tier row
    size (a row holds every worker's cell of a chunk)."""
    return {**vllm_fields(spec.config), "mode": "tier", "row_bytes": row_bytes}


# kvtier's labels on vLLM 0.33's vllm:kv_offload_config_info, on this tier's series (vLLM
# adds the reserved "tier" label itself): where the files are, their fingerprint directory
# and the block file format. The same names as GPU-direct mode (vllm_spec.CONFIG_INFO_KEYS,
# kept apart so that this module never imports torch).
CONFIG_INFO_KEYS = ("kvtier_root", "kvtier_fingerprint", "kvtier_file_format")


class KvtierStorageTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE
    # The tier label on this tier's kvtier_offload_* series (metrics.TIER): the shared
    # volume's; the local and object tiers name their own.
    metrics_tier: ClassVar[str] = SHARED_TIER
    # vLLM 0.33 may poll a tier from its own thread between steps if the tier opts in.
    # Not this one: the block store (its lookup cache, job table and finished queue) is
    # only ever entered from vLLM's scheduler thread. (0.32 has no such thread.)
    tolerates_off_thread_polling: ClassVar[bool] = False

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: Any = None,
        o_direct: str = "auto",
        fsync: bool = False,
        free_space_floor_percent: float = 2.0,
        write_queue_seconds: float = 10.0,
        capacity_bytes: int | str | None = None,
        recompute_bound: bool = True,
        store_nice: int = 10,  # StoreConfig.store_nice
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # Here, not at the top: vLLM's API server imports this module for the metric
        # definitions alone and should not compile the block store's machine code.
        from kvtier_offload.capacity import parse_capacity
        from kvtier_offload.store import BlockStore, StoreConfig

        self.locality = Locality(locality) if locality is not None else None
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        self._recorder = Recorder()  # exported through vLLM's stats, see get_stats
        config = fingerprint_config(offloading_spec, self.block_size_bytes)
        self.store = BlockStore(StoreConfig(
            root=root_dir, fingerprint=fingerprint(config), read_threads=n_read_threads,
            write_threads=n_write_threads, o_direct=o_direct, fsync=fsync,
            free_space_floor_percent=free_space_floor_percent,
            write_queue_seconds=write_queue_seconds,
            store_nice=store_nice,
            # A node-local root (local NVMe) bounds itself: LRU inside the backend.
            capacity_bytes=0 if capacity_bytes is None else parse_capacity(
                capacity_bytes, self.block_size_bytes),
        ), metrics=Metrics(self._recorder, self.metrics_tier))
        self.store.layout.write_config(config)
        self._bound_requests(offloading_spec, recompute_bound, n_read_threads)
        self.events = TierEvents.configured(offloading_spec, tier_type, enable_kv_events,
                                            self.medium, self.locality)
        if self.events is not None:
            self.store.removals = self.events.removals
        log.info("kvtier tier at %s (fingerprint %s, O_DIRECT %s, %d load and %d store "
                 "threads, stores at nice +%d)", self.store.layout.base,
                 self.store.layout.fingerprint, self.store.o_direct,
                 self.store.pool.read_threads, self.store.pool.write_threads,
                 self.store.pool.store_nice)

    def _bound_requests(self, offloading_spec: Any, recompute_bound: bool,
                        read_threads: int,
                        clock: Callable[[], float] = time.monotonic) -> None:
        """The recompute bound's state (recompute_bound.py): the engine's prompt times,
        this tier's load times, each request's wait (on clock: tests pass a fake one)."""
        if not isinstance(recompute_bound, bool):
            raise ValueError(f"{type(self).__name__}: recompute_bound must be true or "
                             f"false (JSON), not {recompute_bound!r}")
        self.recompute_bound = recompute_bound
        self.tokens_per_key = max(1, int(offloading_spec.tokens_per_block[0]) *
                                  int(offloading_spec.blocks_per_chunk))
        self.read_threads = max(1, int(read_threads))
        self._clock = clock
        self.prefill = PromptTimes(clock)
        self.load_rate = Rate()
        self.waits = RequestWaits(self.prefill, self.tokens_per_key, self._skipped, clock)
        self._loads: dict[int, tuple[float, int]] = {}  # job id -> (submitted, tokens)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.prefill.scheduled(context.new_req_ids)
        self.waits.preempted(getattr(context, "preempted_req_ids", None) or ())

    def on_request_finished(self, req_context: ReqContext) -> None:
        # vLLM calls this after the request's last cascade was submitted here.
        self.prefill.finished(req_context.req_id)
        self.waits.finished(req_context.req_id)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33+ (0.32 never asks): the labels config_info() fills."""
        return CONFIG_INFO_KEYS

    def config_info(self) -> dict[str, str | int]:
        """vLLM 0.33+: this tier's facts on vllm:kv_offload_config_info (read once)."""
        layout = self.store.layout
        return {"kvtier_root": layout.root, "kvtier_fingerprint": layout.fingerprint,
                "kvtier_file_format": FILE_FORMAT}

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        raw = bytes(key)
        if not self.recompute_bound:
            present = self.store.lookup(raw)
        else:
            req_id = req_context.req_id
            end = self.waits.end_token(req_id, req_context.get_offload_key_position(key))
            present = self.waits.answer(req_id, end,
                                        lambda patient: self.store.lookup(raw, patient),
                                        self._load_seconds, self.store.expected_lookup_wait,
                                        lambda: recorded_end(req_context))
        if present is None:
            return LookupResult.RETRY  # resolving in the background; vLLM asks again
        return LookupResult.HIT if present else LookupResult.MISS

    def _skipped(self, reason: str) -> None:
        self.store.metrics.tier_skipped.labels(reason).inc()

    def _load_seconds(self, tokens: int) -> float | None:
        return load_estimate(tokens, self.load_rate, self.store.stat_seconds(),
                             self.tokens_per_key, self.read_threads)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        return  # recency lives on the files' atime, refreshed on every hit and load

    # Both run on vLLM's scheduler thread: rows go by index (no buffer object per row) and
    # OffloadKey is bytes (a NewType), so nothing is copied here.
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self.store.store_rows(job_metadata.job_id, keys, self._rows, job_metadata.chunk_ids)
        context = job_metadata.req_context
        ends = [e for e in map(context.get_offload_key_position, keys) if e is not None]
        if ends:  # the prompt's chunks computed so far (recompute_bound.PromptTimes)
            self.prefill.stored(context.req_id, min(ends) - self.tokens_per_key, max(ends))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loads[job_metadata.job_id] = (self._clock(),
                                            len(job_metadata.keys) * self.tokens_per_key)
        self.store.load_rows(job_metadata.job_id, list(job_metadata.keys), self._rows,
                             job_metadata.chunk_ids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for outcome in self.store.finished():
            submitted = self._loads.pop(outcome.job_id, None)
            if submitted is not None and outcome.success:
                # what a hit costs a request, submitted to done (a failed load, which may
                # end at once on a missing file, says nothing of that)
                self.load_rate.add(self._clock() - submitted[0], submitted[1])
            if outcome.kind == "load" and not outcome.success:
                ok = outcome.ok_prefix
                results.append(JobResult(job_id=outcome.job_id, success=False,
                                         successful_keys=tuple(OffloadKey(k) for k in ok)
                                         if ok else None,
                                         transfer_time=outcome.seconds,
                                         transfer_bytes=len(ok) * self.block_size_bytes))
                continue
            if outcome.kind == "store" and self.events is not None:
                self.events.stored(k for k, good in zip(outcome.keys, outcome.ok,
                                                        strict=True) if good)
            results.append(JobResult(job_id=outcome.job_id, success=outcome.success,
                                     transfer_time=outcome.seconds,
                                     transfer_bytes=outcome.nbytes))
        return results

    def has_pending_work(self) -> bool:
        return self.store.pending_jobs() > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        """BlockStored for the files written, BlockRemoved for those this tier removed
        (corrupt, or evicted by its capacity bound), in vLLM's events (tier_events)."""
        return self.events.take() if self.events is not None else ()

    def drain_jobs(self) -> None:
        self.store.drain()

    @classmethod
    def build_metric_definitions(
            cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """kvtier_offload_*, declared to vLLM's API server, which serves /metrics."""
        from vllm.v1.kv_offload.base import (
            OffloadingCounterMetadata,
            OffloadingGaugeMetadata,
            OffloadingHistogramMetadata,
        )

        out: dict[str, OffloadingMetricMetadata] = {}
        for name, d in DEFINITIONS.items():
            if d.kind == "Histogram":
                out[name] = OffloadingHistogramMetadata(documentation=d.doc,
                                                        labelnames=d.labels,
                                                        buckets=d.buckets)
            elif d.kind == "Gauge":
                out[name] = OffloadingGaugeMetadata(documentation=d.doc, labelnames=d.labels)
            else:
                out[name] = OffloadingCounterMetadata(documentation=d.doc, labelnames=d.labels)
        return out

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What the store counted since vLLM last asked (each scheduler step), for vLLM
        to carry to its API server."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        usage = self.store.bounded_usage()
        if usage is not None:  # how full a bounded tier is, each time vLLM asks
            self.store.metrics.used.set(usage[0])
            self.store.metrics.capacity.set(usage[1])
        counts, gauges, observed = self._recorder.take()
        if not (counts or observed or gauges):
            return None
        stats = OffloadingConnectorStats()
        for (name, labels), amount in counts.items():
            stats.increase_counter(name, amount, labels)
        for (name, labels), value in gauges.items():
            stats.set_gauge(name, value, labels)
        for (name, labels), values in observed.items():
            for value in values:
                stats.observe_histogram(name, value, labels)
        return stats

    def shutdown(self) -> None:
        self.store.close()
        # vLLM unmaps its CPU region after this returns; our view of it would make that
        # fail and keep the mapping alive. The rows are not used after shutdown.
        self._rows = np.empty((0, 0), np.uint8)
