"""The TieredPrefixCache status: what kvtier observed and did (the CRD's status schema)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtier_operator.api.v1alpha1.fields import ApiModel


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

