"""vLLM on NVIDIA GPUs: its own OffloadingConnector (CPU tier, kvtier or vLLM file tier,
or, without a CPU tier, kvtier's own offloading spec straight to files) and LMCache."""

from __future__ import annotations

from typing import Any, ClassVar

from kvtier_operator.api.v1alpha1 import (
    BLOCK_SIZE_WITH_CPU_TIER,
    Connector,
    Engine,
    RouterScoring,
    StorageBackend,
    TieredPrefixCache,
    TieredPrefixCacheSpec,
)
from kvtier_operator.engines.base import Adapter, NoCpuTier, PodRole
from kvtier_operator.engines.cmdline.argv import MAX_COMMAND_CHARS, command_line
from kvtier_operator.engines.sizing import PodSizing
from kvtier_operator.engines.versions import Asked
from kvtier_operator.engines.vllm import sizing
from kvtier_operator.engines.vllm.launch import VLLM
from kvtier_operator.engines.vllm.versions import (
    FS_TIER_EXTERNAL_EVICTOR,
    KV_LOAD_FAILURE_POLICY,
    OUT_OF_TREE_TIER,
    SYNC_LOAD_BUDGET,
    VLLM_VERSIONS,
)

# The kvtier storage tier, loaded by vLLM's TieringOffloadingSpec from the injected
# package (offload/kvtier_offload/vllm_tier.py defines it).
KVTIER_TIER_TYPE = "KvtierStorageTier"
KVTIER_TIER_MODULE = "kvtier_offload.vllm_tier"
# Without a CPU tier: kvtier's own OffloadingSpec (offload/kvtier_offload/vllm_spec.py)
# under kvtier's connector (vllm_connector.py), which reports a block it could not load
# so that vLLM recomputes it (vLLM's own OffloadingConnector would stop the engine).
KVTIER_SPEC_NAME = "KvtierOffloadingSpec"
KVTIER_SPEC_MODULE = "kvtier_offload.vllm_spec"
KVTIER_CONNECTOR = "KvtierOffloadingConnector"
KVTIER_CONNECTOR_MODULE = "kvtier_offload.vllm_connector"
LMCACHE_DISK_DIR = "lmcache"
NO_CPU_TIER_NEEDS_STORAGE = (
    "spec.cpu is required unless kvtier offloads straight from GPU memory to the shared "
    "volume (connector native with storage backend kvtier); add cpu.size, e.g. 100Gi")


class VllmNative(Adapter):
    engine = Engine.vllm
    connector = Connector.native
    title = ("vLLM on GPU, its OffloadingConnector: CPU tier in /dev/shm, shared file tier "
             "by kvtier's backend or vLLM's fs tier; without a CPU tier kvtier's own spec "
             "moves blocks between GPU and files")
    launcher = VLLM
    takes_storage: ClassVar[bool] = True
    storage_backends: ClassVar[tuple[StorageBackend, ...]] = (
        StorageBackend.kvtier, StorageBackend.vllm_fs)
    no_cpu_tier: ClassVar[NoCpuTier | None] = NoCpuTier(StorageBackend.kvtier,
                                                        NO_CPU_TIER_NEEDS_STORAGE)
    publishes_kv_events: ClassVar[bool] = True

    def kv_events_config(self, tpc: TieredPrefixCache) -> dict[str, Any] | None:
        return kv_events_config(tpc)

    versions = VLLM_VERSIONS
    sync_loads: ClassVar[bool] = True

    def asked_features(self, spec: TieredPrefixCacheSpec) -> list[Asked]:
        asked = []
        backend = self.storage_backend(spec)
        if spec.no_cpu_tier:
            asked.append(Asked(KV_LOAD_FAILURE_POLICY, "spec.cpu left out (no CPU tier)"))
        elif backend == StorageBackend.kvtier:
            asked.append(Asked(OUT_OF_TREE_TIER, "spec.storage.backend kvtier"))
        if backend == StorageBackend.vllm_fs:
            asked.append(Asked(FS_TIER_EXTERNAL_EVICTOR, "spec.storage.backend vllm-fs"))
        if spec.sync_load_budget is not None:
            asked.append(Asked(SYNC_LOAD_BUDGET, "spec.syncLoadBudget"))
        return asked

    def validate(self, spec: TieredPrefixCacheSpec) -> None:
        s = spec.storage
        if spec.cpu is None:
            if s is None or self.storage_backend(spec) != StorageBackend.kvtier:
                raise ValueError(NO_CPU_TIER_NEEDS_STORAGE)
            if s.block_size is not None:
                raise ValueError(BLOCK_SIZE_WITH_CPU_TIER)
        if s is not None and s.max_size_per_replica is not None:
            raise ValueError(
                "storage.maxSizePerReplica applies to connector lmcache only; remove it "
                "(the evictor bounds the native tiers)"
            )

    def launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        options = self._launch_options(tpc)
        budget = tpc.spec.sync_load_budget_bytes
        if budget is not None:
            # 0.33 and later only: validation and the pods' version check hold that.
            options["kv_connector_extra_config"]["sync_load_budget_bytes"] = budget
        return options

    def _launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        spec = tpc.spec
        if spec.no_cpu_tier:
            return _no_cpu_tier_config(tpc)
        storage = spec.storage
        backend = self.storage_backend(spec)
        extra: dict[str, Any] = {"cpu_bytes_to_use": spec.cpu_bytes}
        if storage is not None and backend is not None:
            tier: dict[str, Any]
            if backend == StorageBackend.vllm_fs:
                tier = {"type": "fs"}
            else:
                tier = {"type": KVTIER_TIER_TYPE, "module_path": KVTIER_TIER_MODULE}
            tier |= {
                "root_dir": storage.mount_path,
                "n_read_threads": storage.read_threads,
                "n_write_threads": storage.write_threads,
            }
            if spec.router.scoring == RouterScoring.precise:
                # The tier announces its blocks (medium STORAGE) on the engine's stream.
                tier["enable_kv_events"] = True
            extra = {
                "spec_name": "TieringOffloadingSpec",
                **extra,
                "block_size": storage.block_tokens,
                "secondary_tiers": [tier],
            }
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        workers = 1
        if spec.no_cpu_tier and len(command_line(container)) <= MAX_COMMAND_CHARS:
            # Without a CPU tier each worker process pins its own staging (a command line
            # too long to read is a conflict anyway).
            workers = sizing.worker_processes(container)
        return sizing.pod_sizing(spec, existing_shm_bytes, workers)

    def sweeps_shm(self, spec: TieredPrefixCacheSpec) -> bool:
        # vLLM's CPU tier is a region in /dev/shm (vllm_offload_*.mmap[.N]).
        return not spec.no_cpu_tier

    def needs_offload_package(self, spec: TieredPrefixCacheSpec) -> bool:
        # kvtier's tier or spec, or the /dev/shm sweep run before every start.
        return self.storage_backend(spec) == StorageBackend.kvtier or self.sweeps_shm(spec)

    def evictor_layout(self, spec: TieredPrefixCacheSpec) -> str | None:
        backend = self.storage_backend(spec)
        return None if backend is None else str(backend)

    def router_cpu_blocks(self, spec: TieredPrefixCacheSpec) -> int | None:
        # Without a CPU tier the files are every replica's: they do not steer routing.
        return None if spec.no_cpu_tier else super().router_cpu_blocks(spec)


def kv_events_config(tpc: TieredPrefixCache) -> dict[str, Any] | None:
    """vLLM's --kv-events-config for precise scoring: a ZMQ PUB bound on every pod at
    spec.router.kvEventsPort, where the router's per-pod subscriber connects (it names
    the pod by its address, so the topic only has to start with the router's filter
    "kv@"; the model segment is the router's model name)."""
    spec = tpc.spec
    if not spec.router.enabled or spec.router.scoring != RouterScoring.precise:
        return None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{spec.router.kv_events_port}",
        "topic": f"kv@{tpc.metadata.name}@{spec.model.name}",
    }


def _no_cpu_tier_config(tpc: TieredPrefixCache) -> dict[str, Any]:
    """No CPU tier: kvtier's connector and spec; a load that fails is recomputed."""
    spec = tpc.spec
    storage = spec.storage
    assert storage is not None  # validate() requires the kvtier shared tier
    return {
        "kv_connector": KVTIER_CONNECTOR,
        "kv_connector_module_path": KVTIER_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": KVTIER_SPEC_NAME,
            "spec_module_path": KVTIER_SPEC_MODULE,
            "root_dir": storage.mount_path,
            "n_read_threads": storage.read_threads,
            "n_write_threads": storage.write_threads,
            "max_staging_bytes": sizing.staging_bytes(spec),
            # Precise scoring: the manager announces the blocks on the volume (medium
            # STORAGE) on the engine's KV events, as the tier does in tiered mode.
            **({"enable_kv_events": True}
               if spec.router.enabled and spec.router.scoring == RouterScoring.precise
               else {}),
        },
    }


class VllmLmcache(Adapter):
    engine = Engine.vllm
    versions = VLLM_VERSIONS
    connector = Connector.lmcache
    title = ("vLLM on GPU with LMCacheConnectorV1: CPU tier in pinned memory, optional "
             "disk files on the shared volume")
    launcher = VLLM
    takes_storage: ClassVar[bool] = True

    def validate(self, spec: TieredPrefixCacheSpec) -> None:
        if spec.cpu is None:
            raise ValueError(NO_CPU_TIER_NEEDS_STORAGE)
        s = spec.storage
        if s is None:
            return
        if s.backend is not None:
            raise ValueError(
                "storage.backend must be unset with connector lmcache, which writes its "
                "own disk files; remove backend or use connector native"
            )
        if s.existing_claim is not None and s.max_size_per_replica is None:
            raise ValueError(
                "storage.maxSizePerReplica is required with connector lmcache and "
                "existingClaim (kvtier cannot know the claim's size); set e.g. 500Gi"
            )

    def launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        spec = tpc.spec
        env = super().env(tpc, role)
        env["LMCACHE_LOCAL_CPU"] = "True"
        env["LMCACHE_MAX_LOCAL_CPU_SIZE"] = str(sizing.lmcache_cpu_gb(spec))
        if spec.storage is not None:
            env["LMCACHE_LOCAL_DISK"] = f"file://{spec.storage.mount_path}/{LMCACHE_DISK_DIR}/"
            env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = str(sizing.lmcache_disk_gb(spec))
            env["LMCACHE_CHUNK_SIZE"] = str(spec.storage.block_tokens)
        return env

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        return sizing.pod_sizing(spec, existing_shm_bytes)

    def evictor_layout(self, spec: TieredPrefixCacheSpec) -> str | None:
        return "lmcache" if spec.storage is not None else None
