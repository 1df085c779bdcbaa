"""The engine and connector a cache configures, and the settings blocks only one engine
or connector reads (spec.tpu, spec.sglang, spec.mooncake). Which block goes with which
engine is the engines' knowledge (engines/registry.py), checked by validation/."""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property

from pydantic import ConfigDict, Field, model_validator

from kvtier_operator.api.quantity import quantity_bytes
from kvtier_operator.api.v1alpha1.fields import (
    ENUM_BOUND,
    ApiModel,
    ConfigMapKey,
    ConfigMapName,
    DaemonSetName,
    MountPath,
    Namespace,
    Quantity,
    ResourceName,
    ServiceName,
)


class Engine(StrEnum):
    """The model server in the selected pods (engines/ holds one adapter per engine and
    connector)."""

    vllm = "vllm"  # vLLM on NVIDIA GPUs
    vllm_tpu = "vllm-tpu"  # vLLM on Google TPUs (tpu-inference)
    sglang = "sglang"  # SGLang with HiCache on NVIDIA GPUs


class Connector(StrEnum):
    """How the engine offloads: native is the engine's own offloading (vLLM's
    OffloadingConnector on GPU, tpu-inference's TPUOffloadConnector on TPU)."""

    native = "native"
    lmcache = "lmcache"
    mooncake_store = "mooncake-store"
    kvbm = "kvbm"



HBM_STAGING_TWICE = ("spec.tpu: stagingSize is hbmStagingSize's deprecated name; give only "
                     "hbmStagingSize")


class TpuSettings(ApiModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "!has(self.stagingSize) || !has(self.hbmStagingSize)",
         "message": HBM_STAGING_TWICE}]})

    page_size: int = Field(
        ge=1, le=8192,
        description="Tokens per KV block (page) of vLLM on TPU: tpu-inference's offload "
        "chunk is one block, so the CPU tier holds cpu.size / (pageSize x kvBytesPerToken) "
        "chunks. tpu-inference chooses it from max_model_len and max_num_seqs (128 for its "
        "defaults); the engine logs it at start (see docs/sizing.md).",
    )
    hosts: int = Field(
        default=1, ge=1, le=256,
        description="TPU hosts (pods) per replica: 1 for a single-host Deployment, the "
        "LeaderWorkerSet size for multi-host. Each host pins its shard of the CPU tier; "
        "the router then routes to leaders only. A pod whose LeaderWorkerSet size "
        "(leaderworkerset.sigs.k8s.io/size) differs, or that has none when hosts > 1, is "
        "left uninjected and reported.",
    )
    hbm_staging_size: Quantity | None = Field(
        default=None,
        description="HBM per replica set aside to stage blocks between TPU and host "
        "memory (TPU_OFFLOAD_NUM_STAGING_BLOCKS, in blocks of pageSize tokens); default "
        "tpu-inference's 128 blocks. It comes out of the HBM the KV cache could use.",
    )
    staging_size: Quantity | None = Field(
        default=None,
        description="Deprecated: hbmStagingSize's name before 0.2, read the same way; rename "
        "it hbmStagingSize.",
    )

    @model_validator(mode="after")
    def _staging_once(self) -> TpuSettings:
        if self.hbm_staging_size is not None and self.staging_size is not None:
            raise ValueError(HBM_STAGING_TWICE.removeprefix("spec.tpu: "))
        return self

    @property
    def hbm_staging(self) -> str | None:
        """hbmStagingSize, or its deprecated name stagingSize."""
        return self.hbm_staging_size if self.hbm_staging_size is not None \
            else self.staging_size

    @cached_property
    def staging_bytes(self) -> int | None:
        """hbmStagingSize in bytes, parsed once; None when unset."""
        return None if self.hbm_staging is None else quantity_bytes(self.hbm_staging)


class ServiceRef(ApiModel):
    name: ServiceName = Field(description="The Service's name.")
    namespace: Namespace | None = Field(
        default=None, description="Its namespace; default the TieredPrefixCache's.")


class SglangWritePolicy(StrEnum):
    """SGLang's --hicache-write-policy."""

    write_through = "write_through"
    write_through_selective = "write_through_selective"
    write_back = "write_back"


class SglangIoBackend(StrEnum):
    """SGLang's --hicache-io-backend on GPUs (its kernel_ascend is for Ascend NPUs)."""

    kernel = "kernel"
    direct = "direct"


class SglangPrefetchPolicy(StrEnum):
    """SGLang's --hicache-storage-prefetch-policy: when a prefetch from the file tier
    counts."""

    best_effort = "best_effort"
    wait_complete = "wait_complete"
    timeout = "timeout"


class SglangSettings(ApiModel):
    page_size: int = Field(
        default=64, ge=1, le=4096,
        description="SGLang's --page-size, tokens per KV page: also the router's block size "
        "(the scorer and SGLang must agree) and the tokens in one shared-tier file. 64 as "
        "in llm-d's SGLang guides.",
    )
    write_policy: SglangWritePolicy = Field(
        default=SglangWritePolicy.write_through,
        json_schema_extra=ENUM_BOUND,
        description="--hicache-write-policy: write_through (every page goes to the CPU "
        "tier when computed), write_through_selective (only pages hit again) or write_back "
        "(only on eviction from GPU memory).",
    )
    io_backend: SglangIoBackend = Field(
        default=SglangIoBackend.kernel,
        json_schema_extra=ENUM_BOUND,
        description="--hicache-io-backend between GPU and CPU memory: kernel (SGLang's "
        "transfer kernels) or direct (cudaMemcpy).",
    )
    prefetch_policy: SglangPrefetchPolicy = Field(
        default=SglangPrefetchPolicy.wait_complete,
        json_schema_extra=ENUM_BOUND,
        description="With spec.storage: --hicache-storage-prefetch-policy, how long a "
        "request waits for pages from the file tier: wait_complete (until every page "
        "found is loaded; llm-d's guide), timeout or best_effort.",
    )
    metadata_cache: bool = Field(
        default=True,
        description="With spec.storage: SGLang's file backend keeps which pages exist in "
        "memory for metadataCacheTTLSeconds instead of asking the volume each time "
        "(SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE; on in llm-d's guide). Pages "
        "the evictor deleted may look present that long; a missed page is recomputed.",
    )
    metadata_cache_ttl_seconds: float = Field(
        default=5.0, gt=0, le=3600, alias="metadataCacheTTLSeconds",
        description="How long the file backend trusts its metadata cache, in seconds "
        "(SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL; 5 as in llm-d's guide).",
    )


class MooncakeProtocol(StrEnum):
    """The transfer protocol of Mooncake's client config (its `protocol`)."""

    rdma = "rdma"
    tcp = "tcp"


class DaemonSetRef(ApiModel):
    name: DaemonSetName = Field(description="The DaemonSet's name.")
    namespace: Namespace | None = Field(
        default=None, description="Its namespace; default the TieredPrefixCache's.")


class MooncakeOffload(ApiModel):
    """Mooncake's SSD tier (llm-d's mooncake-store fs variant): the pods lend no memory
    segment (standalone-store); a client DaemonSet on every node owns the pool and
    offloads it to its local SSD."""

    client_daemon_set: DaemonSetRef = Field(
        description="The mooncake_client DaemonSet (--enable_offload=true, its SSD path in "
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH) that someone else runs; checked to exist "
        "(e.g. mooncake-client in namespace mooncake).",
    )
    root_dir: MountPath = Field(
        default="/data/mooncake-offload",
        description="The master's root_fs_dir: Mooncake's client library checks that this "
        "directory exists in the model server, so kvtier mounts an empty directory there.",
    )


class MooncakeSettings(ApiModel):
    config_map_name: ConfigMapName = Field(
        description="ConfigMap (in this namespace) holding Mooncake's client config JSON "
        "(master_server_address, metadata_server, protocol, global_segment_size...); "
        "mounted read-only and named by MOONCAKE_CONFIG_PATH.",
    )
    config_key: ConfigMapKey = Field(
        default="mooncake_config.json", description="The key of that JSON in the ConfigMap.")
    master_service: ServiceRef | None = Field(
        default=None,
        description="The mooncake master's Service, checked to exist before pods are "
        "expected to start (e.g. mooncake-master-store in namespace mooncake).",
    )
    protocol: MooncakeProtocol = Field(
        default=MooncakeProtocol.rdma,
        json_schema_extra=ENUM_BOUND,
        description="The protocol the client config names (vLLM's default rdma): with rdma "
        "each model-server container requests and limits one rdmaResource. kvtier checks "
        "that the ConfigMap says the same (PrerequisitesReady).",
    )
    rdma_resource: ResourceName = Field(
        default="rdma/ib",
        description="The extended resource of the RDMA device plugin (protocol rdma).",
    )
    offload: MooncakeOffload | None = Field(
        default=None,
        description="Mooncake's SSD tier: vLLM loads asynchronously (load_async), the "
        "client config must be standalone-store with global_segment_size 0 and "
        "enable_offload true (checked), and the client DaemonSet must exist.",
    )

