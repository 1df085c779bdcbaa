"""The TieredPrefixCache API (kvtier.dev/v1alpha1): the single source of truth.

The CRD schema (crds/), the validating webhook, `kvtier render` and the docs are all
derived from these models. Field descriptions become `kubectl explain` text.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvtier_operator import API_VERSION, KIND, rules
from kvtier_operator.cron import SCHEDULE
from kvtier_operator.durations import duration_seconds
from kvtier_operator.quantity import (
    CR_MAX_INT,
    CR_MAX_LENGTH,
    CR_QUANTITY_REGEX,
    MIB,
    normalize_quantity,
    quantity_bytes,
)
from kvtier_operator.rules import Rule

# A size: checked against a bounded grammar before any conversion (see quantity.py). The
# CRD carries the same grammar as a pattern: a CEL rule on an int-or-string field would
# be costed as a 3 MB string, which the API server refuses.
Quantity: TypeAlias = Annotated[
    str,
    BeforeValidator(normalize_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "maxLength": CR_MAX_LENGTH,
                    "pattern": CR_QUANTITY_REGEX, "minimum": 1, "maximum": CR_MAX_INT}),
]


def rule_schema(*field_rules: Rule) -> WithJsonSchema:
    """The CRD schema of a string field under `field_rules`: the rules as CEL rules with
    the same messages (and the strictest maxLength). The field's type pairs it with one
    AfterValidator per rule, so the model checks what the API server checks."""
    return WithJsonSchema({
        "type": "string", "maxLength": min(r.max_length for r in field_rules),
        "x-kubernetes-validations": [r.cel() for r in field_rules]})


def item_schema(rule: Rule) -> WithJsonSchema:
    """The CRD schema of a string in a list or map: pattern and maxLength (a CEL rule there
    is costed per item); the field's type pairs it with the model's check of the rule."""
    return WithJsonSchema({"type": "string", **rule.pattern_schema()})


# String fields under rules (rules.py): static types, so type checkers see `str`.
ModelName: TypeAlias = Annotated[
    str, AfterValidator(rules.MODEL_NAME.check), rule_schema(rules.MODEL_NAME)]
StorageClassName: TypeAlias = Annotated[
    str, AfterValidator(rules.STORAGE_CLASS_NAME.check), rule_schema(rules.STORAGE_CLASS_NAME)]
ClaimName: TypeAlias = Annotated[
    str, AfterValidator(rules.CLAIM_NAME.check), rule_schema(rules.CLAIM_NAME)]
MountPath: TypeAlias = Annotated[
    str, AfterValidator(rules.MOUNT_PATH.check), AfterValidator(rules.MOUNT_PATH_PLACE.check),
    rule_schema(rules.MOUNT_PATH, rules.MOUNT_PATH_PLACE)]
Schedule: TypeAlias = Annotated[str, AfterValidator(SCHEDULE.check), rule_schema(SCHEDULE)]
ConfigMapName: TypeAlias = Annotated[
    str, AfterValidator(rules.CONFIG_MAP_NAME.check), rule_schema(rules.CONFIG_MAP_NAME)]
ContainerName: TypeAlias = Annotated[
    str, AfterValidator(rules.CONTAINER_NAME.check), rule_schema(rules.CONTAINER_NAME)]
ServiceName: TypeAlias = Annotated[
    str, AfterValidator(rules.SERVICE_NAME.check), rule_schema(rules.SERVICE_NAME)]
Namespace: TypeAlias = Annotated[
    str, AfterValidator(rules.NAMESPACE.check), rule_schema(rules.NAMESPACE)]
ConfigMapKey: TypeAlias = Annotated[
    str, AfterValidator(rules.CONFIG_MAP_KEY.check), rule_schema(rules.CONFIG_MAP_KEY)]

LabelKey: TypeAlias = Annotated[
    str, AfterValidator(rules.check_label_key), item_schema(rules.LABEL_KEY)]
LabelValue: TypeAlias = Annotated[
    str, AfterValidator(rules.LABEL_VALUE.check), item_schema(rules.LABEL_VALUE)]
# Map keys cannot carry a schema in a CRD; the model checks them.
MapLabelKey: TypeAlias = Annotated[str, AfterValidator(rules.check_label_key)]

DEFAULT_FILE_TOKENS = 256  # storage.blockSize when unset
STAGING_WITH_CPU_TIER = (
    "spec.storage.stagingSize applies without a CPU tier only (kvtier's own staging "
    "between GPU and files); with spec.cpu vLLM's CPU tier stages: remove stagingSize")
GPU_DIRECT_NEEDS_STORAGE = (
    "spec.cpu is required unless kvtier offloads straight from GPU memory to the shared "
    "volume (connector native with storage backend kvtier); add cpu.size, e.g. 100Gi")
BLOCK_SIZE_WITH_CPU_TIER = (
    "spec.storage.blockSize applies with a CPU tier only: without spec.cpu each file holds "
    "one GPU block; remove blockSize")
# Enum strings the CRD's CEL rules concatenate: a bound keeps the API server's cost
# estimate small (an unbounded string is costed as the largest request).
ENUM_BOUND: dict[str, Any] = {"maxLength": 32}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
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


class StorageBackend(StrEnum):
    kvtier = "kvtier"
    vllm_fs = "vllm-fs"


class DeletePolicy(StrEnum):
    Retain = "Retain"
    Delete = "Delete"


class RolloutPolicy(StrEnum):
    Auto = "Auto"
    Manual = "Manual"


class CapacitySource(StrEnum):
    Filesystem = "Filesystem"
    ClaimSize = "ClaimSize"


# ---------------------------------------------------------------- selector


# A selector names a handful of labels; these bounds keep the webhook's overlap check
# (every other cache in the namespace) and the CRD's rule costs small.
MAX_SELECTOR_TERMS = 32
MAX_SELECTOR_VALUES = 64


class LabelSelectorRequirement(ApiModel):
    key: LabelKey = Field(description="Label key the requirement applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[LabelValue] | None = Field(
        default=None,
        max_length=MAX_SELECTOR_VALUES,
        description="Values for In and NotIn; must be empty for Exists and DoesNotExist.",
    )

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs at least one value in values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values; remove values")
        return self


class LabelSelector(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.matchLabels) && size(self.matchLabels) > 0)"
                    " || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
                    "message": "spec.selector must select something: set matchLabels "
                    "(e.g. llm-d.ai/role: decode) or matchExpressions",
                }
            ]
        }
    )
    match_labels: dict[MapLabelKey, LabelValue] | None = Field(
        default=None, max_length=MAX_SELECTOR_TERMS,
        description="Pods whose labels contain all of these key/value pairs."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=MAX_SELECTOR_TERMS,
        description="Set-based label requirements; all must hold."
    )

    @model_validator(mode="after")
    def _not_empty(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError(
                "the selector is empty and would select every pod; set matchLabels "
                "(e.g. llm-d.ai/role: decode) or matchExpressions"
            )
        return self

    def query(self) -> str:
        """The selector in the API's labelSelector syntax."""
        terms = [f"{k}={v}" for k, v in sorted((self.match_labels or {}).items())]
        for req in self.match_expressions or []:
            values = ",".join(req.values or [])
            terms.append({"In": f"{req.key} in ({values})",
                          "NotIn": f"{req.key} notin ({values})",
                          "Exists": req.key, "DoesNotExist": f"!{req.key}"}[req.operator])
        return ",".join(terms)

    def matches(self, labels: dict[str, str]) -> bool:
        for key, value in (self.match_labels or {}).items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions or []:
            present = req.key in labels
            if req.operator == "In" and labels.get(req.key) not in (req.values or []):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in (req.values or []):
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


# ------------------------------------------------------------------- model


class ModelGeometry(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.kvBytesPerToken) || (has(self.layers) && has(self.kvHeads)"
                    " && has(self.headDim) && has(self.dtype))",
                    "message": "spec.model needs kvBytesPerToken, or all of layers, kvHeads, "
                    "headDim and dtype",
                }
            ]
        }
    )
    name: ModelName = Field(
        description="Model name as vLLM serves it (e.g. Qwen/Qwen3-32B); used by LMCache "
        "and the router config.",
    )
    kv_bytes_per_token: int | None = Field(
        default=None,
        gt=0,
        description="KV-cache bytes one token occupies in one replica, summed over all "
        "layers and tensor-parallel ranks. Give this, or layers/kvHeads/headDim/dtype.",
    )
    layers: int | None = Field(default=None, gt=0, description="Attention layers holding KV.")
    kv_heads: int | None = Field(
        default=None, gt=0, description="KV heads per layer (num_key_value_heads)."
    )
    head_dim: int | None = Field(default=None, gt=0, description="Dimension of one head.")
    dtype: Literal["bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = (
        Field(default=None, description="KV-cache dtype: bfloat16, float16, float32 or fp8*.")
    )

    @model_validator(mode="after")
    def _geometry(self) -> ModelGeometry:
        parts = {"layers": self.layers, "kvHeads": self.kv_heads, "headDim": self.head_dim,
                 "dtype": self.dtype}
        given = [k for k, v in parts.items() if v is not None]
        if given and len(given) < len(parts):
            missing = ", ".join(k for k in parts if parts[k] is None)
            raise ValueError(
                f"incomplete KV geometry: {missing} missing; give all of layers, kvHeads, "
                "headDim and dtype, or only kvBytesPerToken"
            )
        if not given and self.kv_bytes_per_token is None:
            raise ValueError(
                "no KV geometry: give kvBytesPerToken, or layers, kvHeads, headDim and dtype"
            )
        if given and self.kv_bytes_per_token is not None:
            computed = self._computed()
            if computed != self.kv_bytes_per_token:
                raise ValueError(
                    f"kvBytesPerToken {self.kv_bytes_per_token} disagrees with "
                    f"layers x kvHeads x headDim x 2 x dtype bytes = {computed}; "
                    "fix one or give only one of them"
                )
        return self

    def _computed(self) -> int:
        assert self.layers and self.kv_heads and self.head_dim and self.dtype
        return self.layers * self.kv_heads * self.head_dim * 2 * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token if self.kv_bytes_per_token is not None else self._computed()


# --------------------------------------------------------------------- CPU


class CpuTier(ApiModel):
    size: Quantity = Field(
        description="CPU RAM tier per replica (vLLM cpu_bytes_to_use), e.g. 100Gi. The pod's "
        "memory request and /dev/shm grow by this much (see docs/sizing.md)."
    )

    @property
    def bytes(self) -> int:
        return quantity_bytes(self.size)


# ----------------------------------------------------------------- storage


ONCE_POD_ALONE = ("spec.storage.pvc.accessModes: ReadWriteOncePod cannot be combined with "
                  "other access modes (Kubernetes refuses such a claim); use ReadWriteMany to "
                  "share the tier")


AccessMode: TypeAlias = Literal[
    "ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany"]


def _share_by_default() -> list[AccessMode]:
    return ["ReadWriteMany"]


class ClaimTemplate(ApiModel):
    size: Quantity = Field(description="Requested capacity of the new PVC, e.g. 9000Gi.")
    storage_class_name: StorageClassName | None = Field(
        default=None,
        description="StorageClass of the new PVC (e.g. lustre, efs-sc). Omit for the "
        "cluster's default class; an explicit empty string is refused.",
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_share_by_default,
        json_schema_extra={"default": ["ReadWriteMany"], "x-kubernetes-validations": [
            {"rule": "size(self) == 1 || !self.exists(m, m == 'ReadWriteOncePod')",
             "message": ONCE_POD_ALONE}]},
        min_length=1,
        description="Access modes of the new PVC. ReadWriteMany lets every replica share it.",
    )

    @field_validator("access_modes")
    @classmethod
    def _once_pod_alone(cls, value: list[str]) -> list[str]:
        if "ReadWriteOncePod" in value and len(value) > 1:
            raise ValueError(ONCE_POD_ALONE.split(": ", 1)[1])
        return value
    delete_policy: DeletePolicy = Field(
        default=DeletePolicy.Retain,
        description="Retain keeps the PVC and its cached KV when the TieredPrefixCache is "
        "deleted; Delete removes it with the resource.",
    )

    @field_validator("storage_class_name", mode="before")
    @classmethod
    def _no_empty_class(cls, value: object) -> object:
        if value == "":
            raise ValueError(
                "an empty storageClassName disables dynamic provisioning; omit it to use "
                "the default class, or name a class"
            )
        return value


class StorageTier(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.pvc) != has(self.existingClaim)",
                    "message": "spec.storage needs exactly one of pvc (a new claim) or "
                    "existingClaim (the name of one you manage)",
                },
            ]
        }
    )
    backend: StorageBackend | None = Field(
        default=None,
        json_schema_extra=ENUM_BOUND,
        description="Who writes the shared files with connector native: kvtier (the "
        "injected kvtier backend; the default) or vllm-fs (vLLM's built-in fs tier). Leave "
        "unset with connector lmcache, which writes its own disk files.",
    )
    pvc: ClaimTemplate | None = Field(
        default=None, description="Create a PersistentVolumeClaim for the shared tier."
    )
    existing_claim: ClaimName | None = Field(
        default=None,
        description="Use this existing PVC (never modified or deleted by kvtier).",
    )
    mount_path: MountPath = Field(
        default="/mnt/files-storage",
        description="Where the volume is mounted in the model-server container.",
    )
    block_size: int | None = Field(
        default=None,
        ge=16,
        multiple_of=16,
        description="Tokens per offloaded file (vLLM block_size): a positive multiple of 16 "
        "and of the GPU block size; default 256. Leave unset without a CPU tier, where each "
        "file holds one GPU block.",
    )
    read_threads: int = Field(default=16, ge=1, le=256, description="Parallel file readers.")
    write_threads: int = Field(default=16, ge=1, le=256, description="Parallel file writers.")
    max_size_per_replica: Quantity | None = Field(
        default=None,
        description="LMCache only: the disk cap of one replica (LMCACHE_MAX_LOCAL_DISK_SIZE). "
        "Defaults to the new PVC's size times highWatermark; required with existingClaim.",
    )
    staging_size: Quantity | None = Field(
        default=None,
        description="Without a CPU tier only: the pinned host memory each vLLM worker process "
        "(one per GPU) uses to stage KV pages between GPU and files (kvtier's "
        "max_staging_bytes); default 1Gi. The pod's memory request grows by this much per "
        "worker process (see docs/sizing.md).",
    )

    @field_validator("staging_size")
    @classmethod
    def _staging_size(cls, value: str | None) -> str | None:
        if value is not None and quantity_bytes(value) < MIB:
            raise ValueError(f"{value!r} is too small to stage a KV block; use e.g. 1Gi")
        return value

    @property
    def file_tokens(self) -> int:
        """Tokens per file with a CPU tier (vLLM's block_size for the tiers)."""
        return self.block_size if self.block_size is not None else DEFAULT_FILE_TOKENS

    @model_validator(mode="after")
    def _one_claim(self) -> StorageTier:
        if self.pvc is not None and self.existing_claim is not None:
            raise ValueError(
                "pvc and existingClaim are mutually exclusive; keep pvc to let kvtier create "
                "the claim, or existingClaim to use yours"
            )
        if self.pvc is None and self.existing_claim is None:
            raise ValueError("needs pvc (a new claim) or existingClaim (the name of yours)")
        return self


# ------------------------------------------------------- engine settings


class TpuSettings(ApiModel):
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
    staging_size: Quantity | None = Field(
        default=None,
        description="HBM per replica set aside to stage blocks between TPU and host "
        "memory (TPU_OFFLOAD_NUM_STAGING_BLOCKS, in blocks of pageSize tokens); default "
        "tpu-inference's 128 blocks. It comes out of the HBM the KV cache could use.",
    )


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


# ---------------------------------------------------------------- eviction


class Eviction(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.lowWatermark < self.highWatermark",
                    "message": "spec.eviction.lowWatermark must be below highWatermark",
                },
                {
                    "rule": "self.inodeLowWatermark < self.inodeHighWatermark",
                    "message": "spec.eviction.inodeLowWatermark must be below inodeHighWatermark",
                },
            ]
        }
    )
    schedule: Schedule = Field(
        default="*/5 * * * *",
        description="Cron schedule of the evictor CronJob (five fields or @hourly etc.).",
    )
    high_watermark: int = Field(
        default=85, ge=1, le=100, description="Start evicting above this % of bytes used."
    )
    low_watermark: int = Field(
        default=70, ge=1, le=99, description="Evict until bytes used fall below this %."
    )
    inode_high_watermark: int = Field(
        default=90, ge=1, le=100, description="Start evicting above this % of inodes used."
    )
    inode_low_watermark: int = Field(
        default=80, ge=1, le=99, description="Evict until inodes used fall below this %."
    )
    min_idle: str = Field(
        default="10m",
        max_length=32,
        pattern=r"^([0-9]+(h|m|s))+$",
        description="Never delete a file used more recently than this (e.g. 10m, 1h).",
    )
    capacity: CapacitySource = Field(
        default=CapacitySource.Filesystem,
        description="Filesystem: usage from statvfs. ClaimSize: usage against the PVC's size, "
        "for filesystems whose statvfs reports a whole shared export (NFS, EFS, Lustre).",
    )
    suspend: bool = Field(default=False, description="Suspend the evictor CronJob.")
    fs_group: int | None = Field(
        default=None,
        ge=0,
        le=2147483647,  # Kubernetes' largest group id
        description="fsGroup of the evictor pod, so it may delete files the model servers "
        "wrote (match the model servers' group).",
    )

    @field_validator("min_idle")
    @classmethod
    def _duration(cls, value: str) -> str:
        duration_seconds(value)
        return value

    @model_validator(mode="after")
    def _watermarks(self) -> Eviction:
        if not self.low_watermark < self.high_watermark:
            raise ValueError(
                f"lowWatermark {self.low_watermark} must be below highWatermark "
                f"{self.high_watermark} (0 < low < high <= 100); lower lowWatermark"
            )
        if not self.inode_low_watermark < self.inode_high_watermark:
            raise ValueError(
                f"inodeLowWatermark {self.inode_low_watermark} must be below "
                f"inodeHighWatermark {self.inode_high_watermark}; lower inodeLowWatermark"
            )
        return self

    @property
    def min_idle_seconds(self) -> int:
        return duration_seconds(self.min_idle)


# ------------------------------------------------------------------ router


class Router(ApiModel):
    enabled: bool = Field(
        default=False,
        description="Render the llm-d router (EPP) prefix-cache scorer config into a ConfigMap.",
    )
    config_map_name: ConfigMapName | None = Field(
        default=None,
        description="Name of that ConfigMap; default <name>-router. Renaming it deletes the "
        "one the operator made under the old name."
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="Tokens per router prefix block (the EPP's blockSizeTokens); the CPU "
        "lruCapacityPerServer is computed with it. Default: the engine's (16 for vLLM).",
    )


# -------------------------------------------------------------------- spec


def _engine_rules(schema: dict[str, Any]) -> None:
    """The CRD's engine/connector rules, generated from the adapter registry, and the
    transition rules keeping them fixed on a live cache (imported here, when the schema
    is built, because the adapters import these models)."""
    from kvtier_operator.engines.immutable import transition_rules
    from kvtier_operator.engines.registry import cel_rules

    schema.setdefault("x-kubernetes-validations", []).extend(cel_rules() + transition_rules())


# Rules that hold whatever the engine; the registry adds its own (see _engine_rules).
SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": "has(self.cpu) || ((!has(self.engine) || self.engine == 'vllm') && "
        "(!has(self.connector) || self.connector == 'native') && has(self.storage) && "
        "(!has(self.storage.backend) || self.storage.backend == 'kvtier'))",
        "message": GPU_DIRECT_NEEDS_STORAGE,
    },
    {
        "rule": "has(self.cpu) || !has(self.storage) || !has(self.storage.blockSize)",
        "message": BLOCK_SIZE_WITH_CPU_TIER,
    },
    {
        "rule": "!has(self.cpu) || !has(self.storage) || "
        "!has(self.storage.stagingSize)",
        "message": STAGING_WITH_CPU_TIER,
    },
]


def _spec_schema(schema: dict[str, Any]) -> None:
    schema["x-kubernetes-validations"] = [dict(r) for r in SPEC_RULES]
    _engine_rules(schema)


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
    storage: StorageTier | None = Field(
        default=None, description="Optional shared-filesystem tier behind the CPU tier."
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
                self.storage.staging_size is not None):
            raise ValueError(STAGING_WITH_CPU_TIER)
        return self

    @model_validator(mode="after")
    def _cross(self) -> TieredPrefixCacheSpec:
        # The engine's adapter says which tiers, backends and settings it takes.
        from kvtier_operator.engines.registry import check_spec

        check_spec(self)
        s = self.storage
        if s is None:
            return self
        if self.eviction.capacity == CapacitySource.ClaimSize and s.pvc is None:
            raise ValueError(
                "eviction.capacity ClaimSize measures usage against storage.pvc.size, but "
                "existingClaim has no size kvtier knows; use capacity Filesystem or pvc"
            )
        return self

    @property
    def gpu_direct(self) -> bool:
        """No CPU tier: kvtier's own offloading spec moves GPU blocks to and from files."""
        return self.cpu is None

    @property
    def cpu_bytes(self) -> int:
        return self.cpu.bytes if self.cpu is not None else 0

    @property
    def storage_backend(self) -> StorageBackend | None:
        """The effective backend of the shared tier (the adapter's default when unset);
        None without one, or where the connector writes its own files (lmcache)."""
        from kvtier_operator.engines.registry import adapter_for

        return adapter_for(self).storage_backend(self)


# ------------------------------------------------------------------ status


class Condition(ApiModel):
    type: str = Field(description="Ready, StorageReady, Injected, EvictorHealthy or "
                      "PrerequisitesReady.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="One CamelCase word saying why.")
    message: str = Field(default="", description="What happened and what to do, for people.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="The metadata.generation this condition describes."
    )


class ClaimStatus(ApiModel):
    name: str = Field(description="The PVC's name.")
    phase: str | None = Field(default=None, description="Pending, Bound or Lost.")
    capacity: str | None = Field(default=None, description="Capacity reported by the PVC.")


class UsageStatus(ApiModel):
    percent: float | None = Field(default=None, description="Bytes used, % of capacity.")
    inode_percent: float | None = Field(default=None, description="Inodes used, %.")
    used_bytes: int | None = Field(default=None, description="Bytes used.")
    capacity_bytes: int | None = Field(default=None, description="Capacity in bytes.")
    observed_at: str | None = Field(default=None, description="When this was measured.")


class EvictionStatus(ApiModel):
    time: str | None = Field(default=None, description="When the run finished (RFC 3339).")
    outcome: str | None = Field(
        default=None,
        description="nothing-to-do, freed, above-low-watermark or error (the evictor's "
        "exit outcome).",
    )
    files_deleted: int | None = Field(default=None, description="Block files deleted.")
    bytes_freed: int | None = Field(default=None, description="Bytes freed.")
    temp_files_reaped: int | None = Field(default=None, description="Stale temp files removed.")
    usage_before: float | None = Field(default=None, description="Bytes used before, %.")
    usage_after: float | None = Field(default=None, description="Bytes used after, %.")
    duration_seconds: float | None = Field(default=None, description="How long the run took.")
    errors: int | None = Field(default=None, description="Errors during the run.")
    job: str | None = Field(default=None, description="The Job that ran.")


class TieredPrefixCacheStatus(ApiModel):
    observed_generation: int | None = Field(
        default=None, description="The metadata.generation last reconciled."
    )
    conditions: list[Condition] | None = Field(
        default=None, description="Ready, StorageReady, Injected, EvictorHealthy and "
        "PrerequisitesReady (objects the engine needs that others manage)."
    )
    config_hash: str | None = Field(
        default=None, description="Hash of the pod configuration pods must carry."
    )
    pvc: ClaimStatus | None = Field(default=None, description="The shared-tier claim.")
    injected_pods: int | None = Field(
        default=None, description="Selected pods carrying the current configuration."
    )
    pending_pods: int | None = Field(
        default=None, description="Selected pods running without the current configuration."
    )
    usage: UsageStatus | None = Field(default=None, description="Shared volume usage.")
    last_eviction: EvictionStatus | None = Field(
        default=None, description="Summary of the latest evictor run."
    )


class ObjectMeta(ApiModel):
    model_config = ConfigDict(extra="allow")
    # kvtier derives object names and label values from the name (rules.CR_NAME).
    name: Annotated[str, AfterValidator(rules.CR_NAME.check)]
    namespace: Annotated[str, AfterValidator(rules.NAMESPACE.check)] = "default"
    generation: int | None = None
    uid: str | None = None


class TieredPrefixCache(ApiModel):
    api_version: Literal["kvtier.dev/v1alpha1"] = Field(default=API_VERSION)
    kind: Literal["TieredPrefixCache"] = Field(default=KIND)
    metadata: ObjectMeta
    spec: TieredPrefixCacheSpec
    status: TieredPrefixCacheStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def hash_seed(self) -> int:
        if self.spec.hash_seed is not None:
            return self.spec.hash_seed
        digest = hashlib.sha256(f"{self.namespace}/{self.name}".encode()).digest()
        return int.from_bytes(digest[:4], "big")


def spec_fingerprint(spec: TieredPrefixCacheSpec) -> str:
    """Stable short hash of a spec's JSON form (sorted keys)."""
    doc: dict[str, Any] = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
