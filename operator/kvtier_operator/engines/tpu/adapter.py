"""vLLM on Google TPUs (tpu-inference): TPUOffloadConnector, a CPU tier in pinned host
memory, configured by env only; single-host Deployments and multi-host LeaderWorkerSets
(the leader runs `vllm serve`, the workers run Ray workers that hold shards)."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from kvtier_operator.api.quantity import format_bytes
from kvtier_operator.api.v1alpha1 import Connector, Engine, TieredPrefixCache, TieredPrefixCacheSpec
from kvtier_operator.engines.base import Adapter, PodRole
from kvtier_operator.engines.cmdline.argv import MAX_COMMAND_CHARS, command_line
from kvtier_operator.engines.sizing import PodSizing, pinned_process_sizing
from kvtier_operator.engines.tpu import sizing
from kvtier_operator.engines.vllm.launch import VllmLauncher

TPU_CONNECTOR = "TPUOffloadConnector"
TPU_CONNECTOR_MODULE = "tpu_inference.offload.tpu_offload_connector"
# Env names tpu-inference reads (tpu_inference/envs.py; tests check them against it).
ENV_CPU_CHUNKS = "TPU_OFFLOAD_NUM_CPU_CHUNKS"
ENV_STAGING_BLOCKS = "TPU_OFFLOAD_NUM_STAGING_BLOCKS"
ENV_MULTIHOST_BACKEND = "TPU_MULTIHOST_BACKEND"  # must be "ray" (or unset) on multi-host
# LeaderWorkerSet labels every pod with its index in the group; the leader is 0.
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
# ... and annotates it with the group's size, leader included (its LWS_GROUP_SIZE env).
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
MAX_HOSTS = 256  # spec.tpu.hosts' bound
# A multi-host worker: llm-d's `multi-node-serving.sh worker`, or a plain `ray start
# --address=...` (both only join the leader's Ray cluster; they serve nothing).
_WORKER = re.compile(r"multi-node-serving\.sh[ \t'\"]+worker(?![A-Za-z0-9_\-])"
                     r"|ray[ \t]+start[ \t][^\n;&|]*--address")


class TpuLauncher(VllmLauncher):
    command_words: ClassVar[str] = ("'vllm serve' (or, on a multi-host worker, "
                                    "multi-node-serving.sh worker / ray start --address)")

    def runs_worker(self, container: dict[str, Any]) -> bool:
        line = command_line(container)
        return len(line) <= MAX_COMMAND_CHARS and _WORKER.search(line) is not None


class VllmTpuNative(Adapter):
    engine = Engine.vllm_tpu
    connector = Connector.native
    title = ("vLLM on TPU, tpu-inference's TPUOffloadConnector: CPU tier in pinned host "
             "memory (no shared file tier)")
    launcher = TpuLauncher()
    settings_block: ClassVar[str | None] = "tpu"

    def validate(self, spec: TieredPrefixCacheSpec) -> None:
        super().validate(spec)
        chunk = sizing.tpu_chunk_bytes(spec)
        if sizing.tpu_cpu_chunks(spec) < 1:
            raise ValueError(
                f"spec.cpu.size {spec.cpu.size if spec.cpu else 0} holds no TPU chunk (one "
                f"chunk = tpu.pageSize x kvBytesPerToken = {format_bytes(chunk)}); raise it")
        if spec.tpu is not None and spec.tpu.hbm_staging is not None and \
                sizing.tpu_staging_blocks(spec) < 1:
            raise ValueError(
                f"spec.tpu.hbmStagingSize {spec.tpu.hbm_staging} holds no block (one block = "
                f"tpu.pageSize x kvBytesPerToken = {format_bytes(chunk)}); raise it")

    def fingerprint(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        tpu = tpc.spec.tpu
        assert tpu is not None  # validation requires the block
        # The shape config hashes have carried (the field's name before 0.2), whichever
        # name the spec uses: running pods keep their hash.
        return super().fingerprint(tpc) | {"tpu": {
            "page_size": tpu.page_size, "hosts": tpu.hosts, "staging_size": tpu.hbm_staging}}

    def launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        # No kv_connector_extra_config: the connector reads env only.
        return {"kv_connector": TPU_CONNECTOR, "kv_connector_module_path": TPU_CONNECTOR_MODULE,
                "kv_role": "kv_both"}

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        spec = tpc.spec
        env = super().env(tpc, role)
        env[ENV_CPU_CHUNKS] = str(sizing.tpu_cpu_chunks(spec))
        env[ENV_STAGING_BLOCKS] = str(sizing.tpu_staging_blocks(spec))
        if spec.tpu is not None and spec.tpu.hosts > 1:
            env[ENV_MULTIHOST_BACKEND] = "ray"
        return env

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        return pinned_process_sizing(sizing.tpu_host_bytes(spec), existing_shm_bytes)

    def group_conflict(self, spec: TieredPrefixCacheSpec, pod: dict[str, Any],
                       workload: dict[str, Any] | None = None) -> str | None:
        """spec.tpu.hosts against the real host count: each host pins 1/hosts of the CPU
        tier (a hosts larger than the group under-sizes every pod's memory), and hosts > 1
        runs Ray and routes to leaders only."""
        hosts = spec.tpu.hosts if spec.tpu is not None else 1
        size, where = _group_size(pod, workload)
        fix = f"spec.tpu.hosts is {hosts} but {where}"
        if size is None:
            if hosts == 1:
                return None  # a single-host pod (a Deployment's)
            return (f"{fix}: multi-host needs the pods of a LeaderWorkerSet of that size; "
                    "set spec.tpu.hosts to 1 for single-host pods")
        count = size if isinstance(size, int) else int(size) if (
            isinstance(size, str) and size.isdigit() and len(size) < 4) else 0
        if not 1 <= count <= MAX_HOSTS:
            return f"{fix} is {str(size)[:20]!r}, not a host count (1 to {MAX_HOSTS})"
        if count != hosts:
            return (f"{fix} is {count}: each host would pin 1/{hosts} of the CPU tier; set "
                    f"spec.tpu.hosts to {count}")
        return None

    def router_cpu_blocks(self, spec: TieredPrefixCacheSpec) -> int | None:
        return sizing.tpu_router_blocks(spec, self.router_block_size(spec))

    def router_server_labels(self, tpc: TieredPrefixCache) -> dict[str, str] | None:
        tpu = tpc.spec.tpu
        # Multi-host: only the leader runs vLLM's HTTP server.
        return {LWS_WORKER_INDEX: "0"} if tpu is not None and tpu.hosts > 1 else None


def _group_size(pod: dict[str, Any], workload: dict[str, Any] | None) -> tuple[Any, str]:
    """The pod's group size as written (None: not a LeaderWorkerSet pod) and where it was
    read, for messages."""
    if workload is not None:
        kind = str(workload.get("kind"))[:40]
        if kind != "LeaderWorkerSet":
            return None, f"a {kind} is no LeaderWorkerSet"
        group = (workload.get("spec") or {}).get("leaderWorkerTemplate") or {}
        # LeaderWorkerSet defaults an unset size to 1.
        return group.get("size", 1), "the LeaderWorkerSet's spec.leaderWorkerTemplate.size"
    meta = pod.get("metadata") or {}
    for kind in ("annotations", "labels"):
        values = meta.get(kind) or {}
        if isinstance(values, dict) and LWS_SIZE in values:
            return values[LWS_SIZE], f"the pod's {LWS_SIZE} {kind[:-1]}"
    return None, f"the pod has no {LWS_SIZE} annotation (no LeaderWorkerSet pod)"
