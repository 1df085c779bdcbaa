"""kvtier.dev/v1alpha1: the TieredPrefixCache API as pydantic data, one module per concept.

The CRD schema (crds/), `docs/reference.md` and `kubectl explain` are generated from
these types; they carry field-local checks only (validation/ adds the engines').
"""

from kvtier_operator.api.v1alpha1.eviction import (
    CapacitySource,
    Eviction,
)
from kvtier_operator.api.v1alpha1.fields import (
    ENUM_BOUND,
    ApiModel,
    ClaimName,
    ConfigMapKey,
    ConfigMapName,
    ContainerName,
    LabelKey,
    LabelValue,
    MapLabelKey,
    ModelName,
    MountPath,
    Namespace,
    Quantity,
    Schedule,
    ServiceName,
    StorageClassName,
    item_schema,
    rule_schema,
)
from kvtier_operator.api.v1alpha1.geometry import (
    DTYPE_BYTES,
    ModelGeometry,
)
from kvtier_operator.api.v1alpha1.resource import (
    ObjectMeta,
    TieredPrefixCache,
    spec_fingerprint,
)
from kvtier_operator.api.v1alpha1.router import (
    Router,
    RouterApiVersion,
    RouterScoring,
    TierWeights,
)
from kvtier_operator.api.v1alpha1.selector import (
    MAX_SELECTOR_TERMS,
    MAX_SELECTOR_VALUES,
    LabelSelector,
    LabelSelectorRequirement,
)
from kvtier_operator.api.v1alpha1.settings import (
    Connector,
    Engine,
    MooncakeSettings,
    ServiceRef,
    SglangIoBackend,
    SglangSettings,
    SglangWritePolicy,
    TpuSettings,
)
from kvtier_operator.api.v1alpha1.spec import (
    BLOCK_SIZE_WITH_CPU_TIER,
    SPEC_RULES,
    STAGING_WITH_CPU_TIER,
    RolloutPolicy,
    TieredPrefixCacheSpec,
)
from kvtier_operator.api.v1alpha1.status import (
    ClaimStatus,
    Condition,
    EvictionStatus,
    TieredPrefixCacheStatus,
    UsageStatus,
)
from kvtier_operator.api.v1alpha1.tiers import (
    DEFAULT_FILE_TOKENS,
    ONCE_POD_ALONE,
    AccessMode,
    ClaimTemplate,
    CpuTier,
    DeletePolicy,
    StorageBackend,
    StorageTier,
)

__all__ = [
    "BLOCK_SIZE_WITH_CPU_TIER",
    "DEFAULT_FILE_TOKENS",
    "DTYPE_BYTES",
    "ENUM_BOUND",
    "MAX_SELECTOR_TERMS",
    "MAX_SELECTOR_VALUES",
    "ONCE_POD_ALONE",
    "SPEC_RULES",
    "STAGING_WITH_CPU_TIER",
    "AccessMode",
    "ApiModel",
    "CapacitySource",
    "ClaimName",
    "ClaimStatus",
    "ClaimTemplate",
    "Condition",
    "ConfigMapKey",
    "ConfigMapName",
    "Connector",
    "ContainerName",
    "CpuTier",
    "DeletePolicy",
    "Engine",
    "Eviction",
    "EvictionStatus",
    "LabelKey",
    "LabelSelector",
    "LabelSelectorRequirement",
    "LabelValue",
    "MapLabelKey",
    "ModelGeometry",
    "ModelName",
    "MooncakeSettings",
    "MountPath",
    "Namespace",
    "ObjectMeta",
    "Quantity",
    "RolloutPolicy",
    "Router",
    "RouterApiVersion",
    "RouterScoring",
    "Schedule",
    "ServiceName",
    "ServiceRef",
    "SglangIoBackend",
    "SglangSettings",
    "SglangWritePolicy",
    "StorageBackend",
    "StorageClassName",
    "StorageTier",
    "TierWeights",
    "TieredPrefixCache",
    "TieredPrefixCacheSpec",
    "TieredPrefixCacheStatus",
    "TpuSettings",
    "UsageStatus",
    "item_schema",
    "rule_schema",
    "spec_fingerprint",
]
