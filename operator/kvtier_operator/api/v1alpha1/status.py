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
    events_published: int | None = Field(
        default=None, description="BlockRemoved block hashes the router's socket accepted "
        "(spec.router.evictionEventsEndpoint).")
    events_dropped: int | None = Field(
        default=None, description="Block hashes not published: no subscriber, unreachable "
        "endpoint, full queue; eviction went on.")
    events_ignored: int | None = Field(
        default=None, description="Deleted files whose names carry no block hash.")
    events_problem: str | None = Field(
        default=None, description="The first publishing problem of the run.")


class LatencyStatus(ApiModel):
    p50_seconds: float | None = Field(default=None, description="Median, over the window.")
    p99_seconds: float | None = Field(default=None, description="99th percentile.")


class SkippedStatus(ApiModel):
    """Requests that recomputed (the rest of) their prefix rather than use the tier,
    because waiting for its lookups or loading from it would have cost more than
    recomputing (kvtier's recompute bound, GPU-direct mode; the backend's
    kvtier_offload_tier_skipped), over the window."""

    requests: int | None = Field(default=None, description="Requests that skipped the tier.")
    lookup_wait: int | None = Field(
        default=None, description="Of those, the tier's lookups would have answered after "
        "recompute ends (reason lookup-wait).")
    load_slower: int | None = Field(
        default=None, description="Of those, loading would have taken longer than "
        "recomputing (reason load-slower).")
    percent: float | None = Field(
        default=None, description="Share of the requests the engine prefilled, %.")


class TierStatus(ApiModel):
    """What one tier delivered over the window, from the selected pods' metrics. A figure
    the pods do not export is left out and `unobserved` says why: never a zero."""

    name: str = Field(description="gpu, cpu, localDisk, storage, objectStore, or another "
                      "tier the engine names (offloaded: hits an engine did not attribute "
                      "to one tier).")
    hit_percent: float | None = Field(
        default=None, description="Share of prompt tokens served from this tier, %.")
    hit_tokens: int | None = Field(default=None, description="Prompt tokens served from it.")
    hit_source: Literal["engine", "derived"] | None = Field(
        default=None, description="engine: the engine counts this tier's hits itself; "
        "derived: the engine counts them together with other tiers (vLLM's source disk "
        "covers localDisk, storage and objectStore), and kvtier split that count by each "
        "tier's bytes loaded over the window.")
    bytes_loaded: int | None = Field(default=None, description="Bytes loaded from it.")
    bytes_stored: int | None = Field(default=None, description="Bytes stored into it.")
    load_latency: LatencyStatus | None = Field(
        default=None, description="One load's latency, where the engine exports a histogram.")
    failed_loads: int | None = Field(
        default=None, description="Loads that failed and were recomputed.")
    skipped: SkippedStatus | None = Field(
        default=None, description="Requests that recomputed rather than wait for or load "
        "this tier, where the backend counts them (kvtier's tiers in GPU-direct mode).")
    dropped_writes: int | None = Field(
        default=None, description="Block stores the backend dropped rather than write (its "
        "write queue over budget, writers backing off, the free-space floor), where it "
        "counts them (kvtier_offload_dropped_writes; from the first drop).")
    dropped_writes_percent: float | None = Field(
        default=None, description="Share of the block stores asked of this tier that were "
        "dropped, %.")
    capacity_bytes: int | None = Field(default=None, description="Capacity per pod, bytes.")
    capacity_tokens: int | None = Field(default=None, description="Capacity per pod, tokens.")
    used_percent: float | None = Field(default=None, description="Use, % of capacity.")
    unobserved: str | None = Field(
        default=None, description="Why figures of this tier are missing, if any are.")
    observed_at: str | None = Field(default=None, description="When this was observed.")


class RecomputeStatus(ApiModel):
    percent: float | None = Field(
        default=None, description="Share of prompt tokens computed (no tier had them), %.")
    tokens: int | None = Field(default=None, description="Prompt tokens computed.")
    prompt_tokens: int | None = Field(
        default=None, description="Prompt tokens asked for over the window.")
    observed_at: str | None = Field(default=None, description="When this was observed.")


class ObservationStatus(ApiModel):
    """How the figures in tiers and recompute were obtained."""

    window_seconds: float | None = Field(
        default=None, description="The span the tier figures cover.")
    pods_read: int | None = Field(default=None, description="Pods whose metrics were read.")
    pods_unreadable: int | None = Field(
        default=None, description="Selected pods whose metrics could not be read.")
    problems: list[str] | None = Field(
        default=None, description="Why figures are missing, per pod (at most ten).")
    observed_at: str | None = Field(default=None, description="The latest read.")


class RouterCapacityStatus(ApiModel):
    cpu_blocks: int | None = Field(
        default=None, description="The CPU-tier capacity per replica the router is given, "
        "in router blocks.")
    source: Literal["engine", "computed"] | None = Field(
        default=None, description="engine: the engine's own figure (vLLM 0.33's "
        "kv_offload_config_info); computed: from cpu.size and the model's geometry.")


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
    hit_percent: float | None = Field(
        default=None, description="Share of prompt tokens served from the offloaded tiers "
        "(all but gpu) over the window, % (the Hit column).")
    tiers: list[TierStatus] | None = Field(
        default=None, description="What each tier delivered over the window.")
    recompute: RecomputeStatus | None = Field(
        default=None, description="Prompt tokens no tier had, over the window.")
    observation: ObservationStatus | None = Field(
        default=None, description="How the tier figures were read.")
    router_capacity: RouterCapacityStatus | None = Field(
        default=None, description="The router's CPU-tier capacity and where it came from.")

