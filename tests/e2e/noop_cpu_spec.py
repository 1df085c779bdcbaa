"""vLLM's own CPU tier (CPUOffloadingSpec: its scheduler-side manager, lookups, stats and
metrics, all real) with its worker replaced by one that moves no data and reports every
transfer done: vLLM refuses its CPU-tier worker on the CPU platform, and the metric pages
(tests/fixtures/metrics/) need the scheduler's figures, not the bytes. Loaded by vLLM
through spec_module_path; never used to produce tokens that are checked.

NoopTieringOffloadingSpec: the same under vLLM's TieringOffloadingSpec, whose secondary
tiers (kvtier's storage tier as the operator renders it) stay real and move the primary
region's bytes (zeros, as no worker fills it) to and from files."""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class NoopWorker(OffloadingWorker):
    def __init__(self) -> None:
        self._done: list[TransferResult] = []

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self._done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        self._done.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return None


class NoopCpuOffloadingSpec(CPUOffloadingSpec):
    def get_worker(self, kv_caches):
        if not self._worker:
            self._worker = NoopWorker()
        return self._worker


class NoopTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiered spec (its CPU-tier manager and the secondary tiers, real) with the
    same CPU-tier worker that moves no data: the secondary tiers store what the CPU
    region holds, which is enough for their events, never for tokens."""

    def get_worker(self, kv_caches):
        if not self._worker:
            self._worker = NoopWorker()
        return self._worker
