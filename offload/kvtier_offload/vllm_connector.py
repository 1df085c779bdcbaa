"""kvtier's vLLM connector (vLLM 0.32, 0.33): the OffloadingConnector, able to fail a load.

vLLM's OffloadingConnector asserts that every worker transfer succeeded, so a block file
that is corrupt, short, missing or unreadable when its load runs would stop the engine.
This connector's worker side instead turns a failed load job into load errors for the
GPU blocks it did not fill, and with `kv_load_failure_policy: "recompute"` vLLM's
scheduler recomputes them; the job still counts as completed and its request as
finished receiving, so nothing leaks or waits forever. Loaded by vLLM with

    {"kv_connector": "KvtierOffloadingConnector",
     "kv_connector_module_path": "kvtier_offload.vllm_connector",
     "kv_load_failure_policy": "recompute", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec", ...}}

The offloading worker (kvtier_offload.vllm_spec.KvtierOffloadingWorker) reports a load
it could not verify through get_finished() with success=False, and take_load_errors()
gives the GPU block ids that load left unfilled, by job id.

How each failure reaches vLLM's scheduler:
- one KV cache group (the usual case): the failed blocks, through
  get_block_ids_with_load_errors(); the request keeps the prefix before the first bad
  block and recomputes from there;
- several groups (hybrid models): block ids are unique only within a group and vLLM
  refuses block-level errors, so the request is reported in failed_recving and is
  recomputed whole.

vLLM 0.33's sync loads (kv_connector_extra_config.sync_load_budget_bytes > 0): a hit that
fits the step's budget is loaded within the step (submit_load(..., expedited=True), then
wait()) for a request that is already running; vLLM keeps it in _load_jobs with no request
id and expects no finished_recving for it. A sync load that fails is reported by its GPU
block ids only, through get_block_ids_with_load_errors(): vLLM's scheduler then rolls the
running request back to its first bad block and recomputes from there (its sampled token
of that step is dropped). That needs block ids, so sync loads are refused for models with
several KV cache groups (here and in KvtierOffloadingSpec).

On the scheduler's side it times the engine's steps for the manager's recompute bound
(recompute_bound.PrefillRate): each step from the scheduler handing it out
(build_connector_meta, with its scheduled tokens) to its output coming back
(update_connector_output).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

log = logging.getLogger("kvtier_offload")


class KvtierConnectorWorker(OffloadingConnectorWorker):
    """vLLM's worker-side connector, with failed loads reported instead of asserted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._failed_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()

    @property
    def block_level_errors(self) -> bool:
        """Whether vLLM can take failed loads as block ids (one KV cache group)."""
        return len(self.kv_cache_config.kv_cache_groups) == 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        finished_recving: set[str] = set()
        results = self.worker.get_finished()
        # After get_finished(): the errors of every job it reported failed are in.
        errors: dict[int, list[int]] = self.worker.take_load_errors()
        meta = self._connector_worker_meta
        for result in results:
            job_id = result.job_id
            # A load is a job in _load_jobs: its request id, or None for a sync load
            # (vLLM 0.33), whose request already runs.
            is_load = job_id in self._load_jobs
            req_id = self._load_jobs.pop(job_id, None)
            if result.success:
                if result.transfer_time is not None and result.transfer_size is not None:
                    stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                    stats.record(result.transfer_size, result.transfer_time)
            elif req_id is not None:
                self._fail(req_id, errors.get(job_id, ()))
            elif is_load:
                self._fail_sync(job_id, errors.get(job_id, ()))
            # A failed store needs nothing: its keys are simply never found.
            meta.mark_completed(job_id)  # done either way: the scheduler frees the job
            if req_id is not None:
                finished_recving.add(req_id)  # failed or not, the request stops waiting
        return set(), finished_recving

    def _fail_sync(self, job_id: int, block_ids: Any) -> None:
        """A sync load that failed: its request is running on these blocks, so only
        their ids can make vLLM recompute them (never finished_recving: nothing waits)."""
        blocks = {int(b) for b in block_ids}
        if not (self.block_level_errors and blocks):
            # Unreachable while the spec and connector refuse sync loads with several
            # groups, and a failed load always names its blocks: stop rather than let a
            # request run on blocks that were never filled.
            raise RuntimeError(
                f"kvtier: sync load job {job_id} failed and vLLM cannot be told which "
                "blocks to recompute (several KV cache groups, or no block ids); refusing "
                "to continue with unfilled KV blocks")
        log.warning("kvtier: sync load job %d left %d block(s) unfilled; reported as load "
                    "errors, vLLM recomputes them", job_id, len(blocks))
        self._failed_block_ids.update(blocks)

    def _fail(self, req_id: str, block_ids: Any) -> None:
        if self.block_level_errors and block_ids:
            self._failed_block_ids.update(int(b) for b in block_ids)
        else:  # no block ids to give (or vLLM could not map them): recompute it whole
            self._failed_req_ids.add(req_id)

    def take_failed_block_ids(self) -> set[int]:
        out, self._failed_block_ids = self._failed_block_ids, set()
        return out

    def take_failed_req_ids(self) -> set[str]:
        out, self._failed_req_ids = self._failed_req_ids, set()
        return out


class KvtierOffloadingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector with kvtier's failure reporting on the worker side."""

    connector_worker: Any  # set by vLLM's __init__ (None on the scheduler side)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+ (0.32 never asks): no. The worker keeps views of the KV cache
        tensors and staging built from them when the caches are registered, and
        unregister_kv_caches()/restore_kv_caches() do not rebuild them, so after a wake-up
        loads and stores could address memory that is no longer the KV cache. vLLM then
        refuses enable_sleep_mode with this connector at startup instead."""
        return False

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        if len(groups) > 1 and int((extra or {}).get("sync_load_budget_bytes", 0) or 0) > 0:
            raise ValueError(
                "kvtier: sync_load_budget_bytes > 0 (vLLM's in-step \"sync\" loads) needs "
                f"a model with one KV cache group; this one has {len(groups)} (vLLM cannot "
                "recompute a failed sync load by block id there). Remove "
                "sync_load_budget_bytes from kv_connector_extra_config.")
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            parent = self.connector_worker  # holds no transfers yet: rebuilt on its spec
            self.connector_worker = KvtierConnectorWorker(
                parent.spec, parent.vllm_config, parent.kv_cache_config)

    @property
    def _kvtier_worker(self) -> KvtierConnectorWorker:
        assert isinstance(self.connector_worker, KvtierConnectorWorker)
        return self.connector_worker

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        failed = self._kvtier_worker.take_failed_req_ids()
        return KVConnectorTransferResults(
            finished_sending=set(finished_sending or ()),
            finished_recving=set(finished_recving or ()) | failed,
            failed_recving=failed,
        )

    def _prefill_rate(self) -> Any:
        """The manager's PrefillRate (None on a worker, or with another spec's manager)."""
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        return getattr(manager, "prefill", None)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        prefill = self._prefill_rate()
        if prefill is not None:
            # Paired with its output in order (an empty step is left out: its output
            # may never come back).
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            prompt = sum(n for n in scheduled.values() if n > 1)  # a decode is one token
            prefill.step_scheduled(int(scheduler_output.total_num_scheduled_tokens), prompt)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        prefill = self._prefill_rate()
        if prefill is not None:
            prefill.step_done()
        # vLLM tells the manager a load is complete, never whether it succeeded; it is
        # told here: requests done receiving in a step without any load error loaded
        # well, so a preempted one may hit those blocks again (a step with an error
        # keeps every request of it a miss for what it loaded: safe, not exact).
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        if connector_output.invalid_block_ids or connector_output.failed_recving:
            failed = getattr(manager, "loads_failed", None)
            if failed is not None:  # what the worker refused is gone: KV events
                failed(set(connector_output.finished_recving or ()) |
                       set(connector_output.failed_recving or ()))
            return
        succeeded = getattr(manager, "loads_succeeded", None)
        if succeeded is not None:
            succeeded(connector_output.finished_recving or ())

    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM asks right after get_transfer_results(), in the same step: the errors of
        # a request arrive no later than the step that reports it finished receiving.
        if self.connector_worker is None:
            return set()
        return self._kvtier_worker.take_failed_block_ids()
