"""vLLM on NVIDIA GPUs: its own OffloadingConnector (CPU tier, kvtier or vLLM file tier,
or, without a CPU tier, kvtier's own offloading spec straight to files) and LMCache."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import (
    DEFAULT_FILE_TOKENS,
    Connector,
    Engine,
    RouterScoring,
    StorageBackend,
    TieredPrefixCache,
    TieredPrefixCacheSpec,
)
from kvtier_operator.engines.base import Adapter, ExtraVolume, NoCpuTier, PodRole
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
# The tiers chained around it (spec.localDisk before it, spec.objectStore after it):
# offload/kvtier_offload/vllm_local_tier.py and vllm_object_tier.py.
LOCAL_TIER_TYPE = "KvtierLocalTier"
LOCAL_TIER_MODULE = "kvtier_offload.vllm_local_tier"
OBJECT_TIER_TYPE = "KvtierObjectTier"
OBJECT_TIER_MODULE = "kvtier_offload.vllm_object_tier"
# Without a CPU tier: kvtier's own OffloadingSpec (offload/kvtier_offload/vllm_spec.py)
# under kvtier's connector (vllm_connector.py), which reports a block it could not load
# so that vLLM recomputes it (vLLM's own OffloadingConnector would stop the engine).
KVTIER_SPEC_NAME = "KvtierOffloadingSpec"
KVTIER_SPEC_MODULE = "kvtier_offload.vllm_spec"
KVTIER_CONNECTOR = "KvtierOffloadingConnector"
KVTIER_CONNECTOR_MODULE = "kvtier_offload.vllm_connector"
LMCACHE_DISK_DIR = "lmcache"  # below the volume mount; the evictor's `lmcache` layout
# Where LMCache's processes keep their Prometheus files (LMCache's own default and llm-d's
# guide), on an emptyDir: fresh for each pod, writable whatever the root filesystem.
LMCACHE_PROMETHEUS_DIR = "/tmp/lmcache_prometheus"
PROMETHEUS_VOLUME = "kvtier-lmcache-prometheus"
FILE_OVER_STAGING = (
    "spec.storage.blockSize: without a CPU tier kvtier's pinned staging "
    "(spec.storage.hostStagingSize, {staging} bytes once rounded down to a power of two) "
    "must hold at least {files} files, and one file of {tokens} tokens takes {file} bytes "
    "of this model's KV (spec.model); {fix}")
NO_CPU_TIER_NEEDS_STORAGE = (
    "spec.cpu is required unless kvtier offloads straight from GPU memory to the shared "
    "volume (connector native with storage backend kvtier); add cpu.size, e.g. 100Gi")


class VllmNative(Adapter):
    engine = Engine.vllm
    connector = Connector.native
    title = ("vLLM on GPU, its OffloadingConnector: CPU tier in /dev/shm, then kvtier's "
             "local-disk tier, the shared file tier (kvtier's backend or vLLM's fs tier) and "
             "kvtier's object-store tier; without a CPU tier kvtier's own spec moves blocks "
             "between GPU and files")
    launcher = VLLM
    takes_storage: ClassVar[bool] = True
    storage_backends: ClassVar[tuple[StorageBackend, ...]] = (
        StorageBackend.kvtier, StorageBackend.vllm_fs)
    no_cpu_tier: ClassVar[NoCpuTier | None] = NoCpuTier(StorageBackend.kvtier,
                                                        NO_CPU_TIER_NEEDS_STORAGE)
    publishes_kv_events: ClassVar[bool] = True
    takes_local_disk: ClassVar[bool] = True
    takes_object_store: ClassVar[bool] = True

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
        elif spec.local_disk is not None:
            asked.append(Asked(OUT_OF_TREE_TIER, "spec.localDisk"))
        elif spec.object_store is not None:
            asked.append(Asked(OUT_OF_TREE_TIER, "spec.objectStore"))
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
            _check_files_fit_staging(spec)
        if s is not None and s.max_size_per_replica is not None:
            raise ValueError(
                "storage.maxSizePerReplica applies to connector lmcache only; remove it "
                "(the evictor bounds the native tiers)"
            )
        if s is not None and s.direct_io is not None:
            raise ValueError(
                "storage.directIO applies to connector lmcache only; remove it (kvtier's "
                "backend probes O_DIRECT itself, vLLM's fs tier does not use it)"
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
        extra: dict[str, Any] = {"cpu_bytes_to_use": spec.cpu_bytes}
        tiers = self._secondary_tiers(spec)
        if tiers:
            extra = {
                "spec_name": "TieringOffloadingSpec",
                **extra,
                "block_size": (spec.storage.block_tokens if spec.storage is not None
                               else DEFAULT_FILE_TOKENS),
                "secondary_tiers": tiers,
            }
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    def _secondary_tiers(self, spec: TieredPrefixCacheSpec) -> list[dict[str, Any]]:
        """vLLM's tiering stores every chunk to each secondary tier and looks them up in
        this order: the node's disk, the shared volume, the object store (fastest first).
        With precise scoring each tier announces its blocks (medium STORAGE; the local
        disk with locality LOCAL, the object store REMOTE) on the engine's stream."""
        tiers: list[dict[str, Any]] = []
        disk = spec.local_disk
        if disk is not None:
            tiers.append({"type": LOCAL_TIER_TYPE, "module_path": LOCAL_TIER_MODULE,
                          "root_dir": disk.mount_path, "capacity_bytes": disk.bytes,
                          "n_read_threads": disk.read_threads,
                          "n_write_threads": disk.write_threads,
                          **store_nice(disk.store_nice)})
        storage = spec.storage
        backend = self.storage_backend(spec)
        if storage is not None and backend is not None:
            tier: dict[str, Any]
            if backend == StorageBackend.vllm_fs:
                tier = {"type": "fs"}
            else:
                tier = {"type": KVTIER_TIER_TYPE, "module_path": KVTIER_TIER_MODULE,
                        **store_nice(storage.store_nice)}
            tiers.append(tier | {
                "root_dir": storage.mount_path,
                "n_read_threads": storage.read_threads,
                "n_write_threads": storage.write_threads,
            })
        store = spec.object_store
        if store is not None:
            # Never a credential here (this is vLLM's command line): boto3 reads them
            # from the env the Secret gives (engines/chained_tiers.credential_env).
            tier = {"type": OBJECT_TIER_TYPE, "module_path": OBJECT_TIER_MODULE,
                    "bucket": store.bucket, "prefix": store.prefix,
                    "addressing_style": str(store.addressing_style),
                    "max_concurrency": store.max_concurrency}
            if store.endpoint is not None:
                tier["endpoint_url"] = store.endpoint
            if store.region is not None:
                tier["region"] = store.region
            tiers.append(tier)
        if spec.router.scoring == RouterScoring.precise:
            for tier in tiers:
                tier["enable_kv_events"] = True
        return tiers

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        env = super().env(tpc, role)
        if tpc.spec.no_cpu_tier and role == PodRole.server:
            # kvtier's stores run in the worker processes: their metrics reach /metrics
            # only through prometheus-client's multiprocess mode (names.METRICS_MOUNT).
            env[names.ENV_MULTIPROC_DIR] = names.METRICS_MOUNT
        return env

    def extra_volumes(self, tpc: TieredPrefixCache) -> list[ExtraVolume]:
        if not tpc.spec.no_cpu_tier:
            return []
        return [ExtraVolume({"name": names.VOLUME_METRICS,
                             "emptyDir": {"sizeLimit": names.METRICS_SIZE_LIMIT}},
                            names.METRICS_MOUNT, read_only=False)]

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        workers = 1
        if spec.no_cpu_tier and len(command_line(container)) <= MAX_COMMAND_CHARS:
            # Without a CPU tier each worker process pins its own staging (a command line
            # too long to read is a conflict anyway).
            workers = sizing.worker_processes(container)
        return sizing.pod_sizing(spec, existing_shm_bytes, workers)

    def file_tokens(self, spec: TieredPrefixCacheSpec) -> int | None:
        """The block_size kvtier renders (tokens per offloaded file), None where it
        renders none (a CPU tier alone: vLLM's own default)."""
        if spec.no_cpu_tier:
            return sizing.direct_file_tokens(spec)
        if self._secondary_tiers(spec):
            return spec.storage.block_tokens if spec.storage is not None \
                else DEFAULT_FILE_TOKENS
        return None

    def container_conflict(self, spec: TieredPrefixCacheSpec,
                           container: dict[str, Any]) -> str | None:
        # vLLM refuses to start when its offloaded block_size is not a multiple of the
        # GPU block size (vllm/v1/kv_offload config); say so at admission instead.
        tokens = self.file_tokens(spec)
        if tokens is None or len(command_line(container)) > MAX_COMMAND_CHARS:
            return None
        gpu = sizing.gpu_block_tokens(container)
        if gpu is None or tokens % gpu == 0:
            return None
        fits = max(gpu, tokens // gpu * gpu)
        return (f"container {container.get('name')!r} runs vLLM with --block-size {gpu}, "
                f"which does not divide the {tokens}-token files kvtier renders (vLLM "
                f"would refuse to start): set spec.storage.blockSize to a multiple of "
                f"{gpu}, e.g. {fits}")

    def sweeps_shm(self, spec: TieredPrefixCacheSpec) -> bool:
        # vLLM's CPU tier is a region in /dev/shm (vllm_offload_*.mmap[.N]).
        return not spec.no_cpu_tier

    def needs_offload_package(self, spec: TieredPrefixCacheSpec) -> bool:
        # kvtier's tiers or spec, or the /dev/shm sweep run before every start.
        return (self.storage_backend(spec) == StorageBackend.kvtier or self.sweeps_shm(spec)
                or spec.local_disk is not None or spec.object_store is not None)

    def evictor_layout(self, spec: TieredPrefixCacheSpec) -> str | None:
        backend = self.storage_backend(spec)
        return None if backend is None else str(backend)

    def router_cpu_blocks(self, spec: TieredPrefixCacheSpec) -> int | None:
        # Without a CPU tier the files are every replica's: they do not steer routing.
        return None if spec.no_cpu_tier else super().router_cpu_blocks(spec)


def store_nice(value: int | None) -> dict[str, int]:
    """kvtier's store_nice setting where the spec sets one (else the backend's default)."""
    return {} if value is None else {"store_nice": value}


def lmcache_disk_dir(mount_path: str) -> str:
    """LMCache's disk tier directory on the shared volume (its own, below the mount)."""
    return f"{mount_path.rstrip('/')}/{LMCACHE_DISK_DIR}"


def kv_events_config(tpc: TieredPrefixCache) -> dict[str, Any] | None:
    """vLLM's --kv-events-config for precise scoring: a ZMQ PUB bound on every pod at
    spec.router.kvEventsPort, where the router's per-pod subscriber connects. At
    llm-d-router ebab687 that subscriber names the pod <pod IP>:<InferencePool target
    port> itself and overrides the topic's pod segment (preciseprefixcache/extractor.go:80,
    pkg/kvevents/pool.go:321-323), so the topic only has to start with the router's filter
    "kv@" and have exactly three '@' parts (engineadapter/common.go:36-45). Its model
    segment seeds the router's block keys (kvblock/token_processor.go:168-174), so it is
    the name requests target: spec.model.name, which may not hold '@' here."""
    spec = tpc.spec
    if not spec.router.enabled or spec.router.scoring != RouterScoring.precise:
        return None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{spec.router.kv_events_port}",
        "topic": f"kv@{tpc.metadata.name}@{spec.model.name}",
    }


def _check_files_fit_staging(spec: TieredPrefixCacheSpec) -> None:
    """An explicit blockSize without a CPU tier: the worker's staging must hold a few
    files (its constructor refuses a file larger than staging, at the pod's start)."""
    tokens = sizing.direct_file_tokens(spec)
    staged = sizing.staged_bytes(spec)
    need = sizing.MIN_STAGED_FILES * sizing.direct_file_bytes(spec, tokens)
    if need <= staged:
        return
    fits = tokens
    while fits > 16 and sizing.MIN_STAGED_FILES * sizing.direct_file_bytes(spec, fits) > staged:
        fits = max(16, (fits // 2) // 16 * 16)
    raise ValueError(FILE_OVER_STAGING.format(
        staging=staged, files=sizing.MIN_STAGED_FILES, tokens=tokens,
        file=sizing.direct_file_bytes(spec, tokens),
        fix=(f"lower blockSize to {fits} or less, or raise hostStagingSize"
             if sizing.MIN_STAGED_FILES * sizing.direct_file_bytes(spec, fits) <= staged
             else "even 16-token files do not fit: raise hostStagingSize")))


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
            **store_nice(storage.store_nice),
            "max_staging_bytes": sizing.staging_bytes(spec),
            # vLLM's chunk: one file per block_size tokens (a multiple of the GPU block)
            "block_size": sizing.direct_file_tokens(spec),
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
        # LMCache's metrics from every process (vLLM's workers and the API server) meet
        # in one directory, an emptyDir of the pod's (extra_volumes).
        env[names.ENV_MULTIPROC_DIR] = LMCACHE_PROMETHEUS_DIR
        storage = spec.storage
        if storage is not None:
            env["LMCACHE_LOCAL_DISK"] = f"file://{lmcache_disk_dir(storage.mount_path)}/"
            env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = str(sizing.lmcache_disk_gb(spec))
            env["LMCACHE_CHUNK_SIZE"] = str(storage.block_tokens)
            # LMCache tests use_odirect for truth: a JSON boolean, never a string ("False"
            # would be true).
            direct = True if storage.direct_io is None else storage.direct_io
            env["LMCACHE_EXTRA_CONFIG"] = json.dumps({"use_odirect": direct})
        return env

    def tier_directory(self, spec: TieredPrefixCacheSpec) -> str:
        return LMCACHE_DISK_DIR

    def extra_volumes(self, tpc: TieredPrefixCache) -> list[ExtraVolume]:
        return [ExtraVolume(volume={"name": PROMETHEUS_VOLUME, "emptyDir": {}},
                            mount_path=LMCACHE_PROMETHEUS_DIR, read_only=False)]

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        return sizing.pod_sizing(spec, existing_shm_bytes)

    def evictor_layout(self, spec: TieredPrefixCacheSpec) -> str | None:
        return "lmcache" if spec.storage is not None else None
