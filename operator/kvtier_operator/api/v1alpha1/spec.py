"""TieredPrefixCacheSpec: the tiers, the engine and the policies of one cache, with the
rules that hold whatever the engine. Rules that need an engine's knowledge (which
connectors, tiers and settings it takes) are validation/'s, which adds them to the CRD."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from kvtier_operator.api.quantity import quantity_bytes
from kvtier_operator.api.v1alpha1.eviction import CapacitySource, Eviction
from kvtier_operator.api.v1alpha1.fields import ENUM_BOUND, ApiModel, ContainerName, Quantity
from kvtier_operator.api.v1alpha1.geometry import ModelGeometry
from kvtier_operator.api.v1alpha1.local_disk import LocalDiskTier
from kvtier_operator.api.v1alpha1.object_store import ObjectStoreTier
from kvtier_operator.api.v1alpha1.peer_sharing import PEER_SHARING_REFUSED, PeerSharing
from kvtier_operator.api.v1alpha1.router import Router, RouterScoring
from kvtier_operator.api.v1alpha1.selector import LabelSelector
from kvtier_operator.api.v1alpha1.settings import (
    Connector,
    Engine,
    MooncakeSettings,
    SglangSettings,
    TpuSettings,
)
from kvtier_operator.api.v1alpha1.tiers import CpuTier, StorageTier

STAGING_WITH_CPU_TIER = (
    "spec.storage.hostStagingSize applies without a CPU tier only (kvtier's own staging "
    "between GPU and files); with spec.cpu vLLM's CPU tier stages: remove hostStagingSize "
    "(or its deprecated name stagingSize)")
MORE_TIERS_NEED_CPU = (
    "spec.localDisk and spec.objectStore chain behind the CPU tier (vLLM's tiering "
    "offloading spec): add cpu.size, e.g. 100Gi")


SYNC_LOADS_HYBRID = (
    "spec.syncLoadBudget: in-step (sync) loads cannot be recomputed when they fail on a "
    "model with several KV cache groups (spec.model.kvCacheGroups > 1): vLLM takes failed "
    "block ids from one group only; remove syncLoadBudget")


class RolloutPolicy(StrEnum):
    Auto = "Auto"
    Manual = "Manual"

# The router reads a KV-events topic kv@<pod>@<model> by splitting it at "@" and takes it
# apart only when there are exactly three parts (llm-d-router ebab687,
# pkg/kvevents/engineadapter/common.go:36-45); otherwise its model is empty and every
# block the pods announce is keyed under the wrong model, never matching a request.
MODEL_NAME_IN_TOPIC = (
    "spec.model.name: with spec.router.scoring precise the model name travels in the "
    "KV-events topic kv@<pod>@<model>, which the router splits at '@'; use the served "
    "model name without '@' (vLLM --served-model-name), or scoring approximate")


# Rules that hold whatever the engine; validation/ adds the engines' own when it builds
# the CRD (crd.openapi_schema).
SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": "!has(self.cpu) || !has(self.storage) || "
        "(!has(self.storage.hostStagingSize) && !has(self.storage.stagingSize))",
        "message": STAGING_WITH_CPU_TIER,
    },
    {
        "rule": "!has(self.syncLoadBudget) || !has(self.model.kvCacheGroups) || "
        "self.model.kvCacheGroups == 1",
        "message": SYNC_LOADS_HYBRID,
    },
    {
        "rule": "has(self.cpu) || (!has(self.localDisk) && !has(self.objectStore))",
        "message": MORE_TIERS_NEED_CPU,
    },
    {"rule": "!has(self.peerSharing)", "message": PEER_SHARING_REFUSED},
    {
        "rule": "!has(self.router) || !has(self.router.scoring) || "
        "self.router.scoring != 'precise' || !self.model.name.contains('@')",
        "message": MODEL_NAME_IN_TOPIC,
    },
]


def _spec_schema(schema: dict[str, Any]) -> None:
    schema["x-kubernetes-validations"] = [dict(r) for r in SPEC_RULES]


class TieredPrefixCacheSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=_spec_schema)

    selector: LabelSelector = Field(
        description="Selects the model-server pods in this namespace to give the cache to."
    )
    engine: Engine = Field(
        default=Engine.vllm,
        json_schema_extra=ENUM_BOUND,
        description="The model server in the selected pods: vllm (vLLM on NVIDIA GPUs), "
        "vllm-tpu (vLLM on Google TPUs with tpu-inference) or sglang (SGLang with HiCache "
        "on NVIDIA GPUs). It decides which connectors "
        "and tiers are possible (docs/architecture.md lists them).",
    )
    engine_version: str | None = Field(
        default=None,
        pattern=r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))?$",
        max_length=32,
        description="The engine's version in the selected pods, major.minor[.patch] (e.g. "
        "0.33). kvtier renders for it and refuses features it lacks "
        "(docs/support-matrix.md). Unset: each pod's image tag where it is a vLLM release "
        "(vllm/vllm-openai:v0.33.0), else the oldest supported version (0.32), reported "
        "by the EngineVersion condition. Engine vllm only.",
    )
    container_name: ContainerName | None = Field(
        default=None,
        description="Container running the engine; default: the one whose command starts "
        "it (vllm serve), or on multi-host TPU workers the Ray worker container. On a "
        "multi-host worker pod without a container of this name (leader and worker "
        "containers named differently), the one container whose command runs a worker is "
        "injected.",
    )
    model: ModelGeometry = Field(description="The served model and its KV geometry.")
    connector: Connector = Field(
        default=Connector.native,
        json_schema_extra=ENUM_BOUND,
        description="native (the engine's own offloading: vLLM OffloadingConnector on GPU, "
        "TPUOffloadConnector on TPU), lmcache (LMCacheConnectorV1), mooncake-store (vLLM "
        "MooncakeStoreConnector) or kvbm (NVIDIA Dynamo KVBM's DynamoConnector).",
    )
    cpu: CpuTier | None = Field(
        default=None,
        description="The CPU RAM tier of each replica. Leave it out to offload straight "
        "from GPU memory to the shared volume (connector native, storage backend kvtier: "
        "kvtier's own vLLM offloading spec).",
    )
    local_disk: LocalDiskTier | None = Field(
        default=None,
        description="Optional node-local disk tier (local NVMe) of each replica, between "
        "the CPU tier and the shared volume, bounded per pod by kvtier's backend.",
    )
    storage: StorageTier | None = Field(
        default=None, description="Optional shared-filesystem tier behind the CPU tier "
        "(and the local disk)."
    )
    object_store: ObjectStoreTier | None = Field(
        default=None,
        description="Optional S3-compatible object store, the last tier (behind the shared "
        "volume where there is one), shared by every replica and held to a byte budget.",
    )
    peer_sharing: PeerSharing | None = Field(
        default=None,
        description="Not available: replicas sharing blocks peer to peer is refused, "
        "with the reason (docs/architecture.md, Peer sharing); share through storage or "
        "objectStore.",
    )
    sync_load_budget: Quantity | None = Field(
        default=None,
        description="vLLM 0.33 and later, connector native: bytes each worker may load "
        "within a scheduler step (sync_load_budget_bytes), so a short cache hit is served "
        "in-step instead of a step later. Needs spec.engineVersion 0.33 or later (or pods "
        "whose image says so); refused for hybrid models (model.kvCacheGroups > 1), whose "
        "failed in-step loads vLLM cannot recompute.",
    )
    tpu: TpuSettings | None = Field(
        default=None, description="Engine vllm-tpu only (and required there): TPU page size, "
        "hosts per replica and HBM staging.")
    mooncake: MooncakeSettings | None = Field(
        default=None, description="Connector mooncake-store only (and required there): "
        "where Mooncake's client config is and which master it needs.")
    sglang: SglangSettings | None = Field(
        default=None, description="Engine sglang only (and required there; `sglang: {}` "
        "takes the defaults): HiCache page size, write policy and I/O backend.")
    eviction: Eviction = Field(
        default_factory=Eviction,
        description="The evictor CronJob that keeps the shared volume under its watermarks.",
    )
    router: Router = Field(default_factory=Router, description="llm-d router config rendering.")
    rollout: RolloutPolicy = Field(
        default=RolloutPolicy.Manual,
        description="Pods already running without the current config: Auto restarts their "
        "workload one at a time; Manual only reports them as pending.",
    )
    hash_seed: int | None = Field(
        default=None,
        ge=0,
        le=4294967295,
        description="PYTHONHASHSEED for every selected pod; default derived from the "
        "namespace and name. Give two caches the same seed to share files.",
    )

    @model_validator(mode="after")
    def _staging_without_cpu_tier(self) -> TieredPrefixCacheSpec:
        if self.cpu is not None and self.storage is not None and (
                self.storage.host_staging is not None):
            raise ValueError(STAGING_WITH_CPU_TIER)
        return self

    @model_validator(mode="after")
    def _model_name_fits_the_topic(self) -> TieredPrefixCacheSpec:
        if self.router.scoring == RouterScoring.precise and "@" in self.model.name:
            raise ValueError(MODEL_NAME_IN_TOPIC)
        return self

    @model_validator(mode="after")
    def _no_peer_sharing(self) -> TieredPrefixCacheSpec:
        if self.peer_sharing is not None:
            raise ValueError(PEER_SHARING_REFUSED)
        return self

    @model_validator(mode="after")
    def _more_tiers_behind_cpu(self) -> TieredPrefixCacheSpec:
        if self.cpu is None and (self.local_disk is not None or self.object_store is not None):
            raise ValueError(MORE_TIERS_NEED_CPU)
        return self

    @model_validator(mode="after")
    def _sync_loads_one_group(self) -> TieredPrefixCacheSpec:
        if self.sync_load_budget is not None and self.model.kv_cache_groups > 1:
            raise ValueError(SYNC_LOADS_HYBRID)
        return self

    @model_validator(mode="after")
    def _claim_size_needs_pvc(self) -> TieredPrefixCacheSpec:
        s = self.storage
        if s is None:
            return self
        if self.eviction.capacity == CapacitySource.ClaimSize and s.pvc is None:
            raise ValueError(
                "eviction.capacity ClaimSize measures usage against storage.pvc.size, but "
                "existingClaim has no size kvtier knows; use capacity Filesystem or pvc"
            )
        return self

    def deprecated_fields(self) -> list[tuple[str, str]]:
        """(field given under a deprecated name, its name now), read as before."""
        found = []
        if self.storage is not None and self.storage.staging_size is not None:
            found.append(("spec.storage.stagingSize", "hostStagingSize"))
        if self.tpu is not None and self.tpu.staging_size is not None:
            found.append(("spec.tpu.stagingSize", "hbmStagingSize"))
        return found

    @property
    def no_cpu_tier(self) -> bool:
        """No CPU tier: kvtier's own offloading spec moves GPU blocks to and from files."""
        return self.cpu is None

    @property
    def sync_load_budget_bytes(self) -> int | None:
        return None if self.sync_load_budget is None else quantity_bytes(self.sync_load_budget)

    @property
    def cpu_bytes(self) -> int:
        return self.cpu.bytes if self.cpu is not None else 0
