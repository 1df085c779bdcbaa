"""Pure status computation: observations in, the TieredPrefixCache status out, built as
the typed status (api/v1alpha1/status.py) that also defines the CRD's status schema.

Every condition carries observedGeneration; lastTransitionTime changes only when a
condition's status does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier_evictor.report import ABOVE_LOW_WATERMARK, ERROR, FREED, NOTHING_TO_DO
from kvtier_operator.api.v1alpha1 import (
    Condition,
    EvictionStatus,
    TieredPrefixCache,
    TieredPrefixCacheStatus,
    UsageStatus,
)
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe import EvictorRun, PodView

READY, STORAGE_READY, INJECTED, EVICTOR_HEALTHY = "Ready", "StorageReady", "Injected", \
    "EvictorHealthy"
PREREQUISITES_READY = "PrerequisitesReady"
ENGINE_VERSION = "EngineVersion"
CONDITION_TYPES = (READY, STORAGE_READY, INJECTED, EVICTOR_HEALTHY, PREREQUISITES_READY,
                   ENGINE_VERSION)


@dataclass
class Cond:
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""


@dataclass
class StorageObservation:
    """What reconciling the claim found out."""

    claim: str | None = None
    phase: str | None = None
    capacity: str | None = None
    condition: Cond = field(default_factory=lambda: Cond("True", "NoStorageTier",
                                                         "no shared-filesystem tier"))


@dataclass
class PodCounts:
    injected: int
    pending: list[str]


def count_pods(tpc: TieredPrefixCache, pods: list[PodView], config_hash: str) -> PodCounts:
    injected, pending = 0, []
    for pod in pods:
        if pod.namespace != tpc.namespace or not pod.active or pod.opted_out:
            continue
        if not tpc.spec.selector.matches(pod.label_dict):
            continue
        if pod.cache == tpc.name and pod.config_hash == config_hash:
            injected += 1
        else:
            pending.append(pod.name)
    return PodCounts(injected, sorted(pending))


def injected_condition(counts: PodCounts, conflicts: list[str]) -> Cond:
    if conflicts:
        return Cond("False", "Conflict", "; ".join(conflicts))
    if counts.pending:
        shown = ", ".join(counts.pending[:5]) + (" ..." if len(counts.pending) > 5 else "")
        return Cond("False", "PodsPending",
                    f"{len(counts.pending)} selected pod(s) run without the current config "
                    f"({shown}); they get it when restarted (rollout: Auto restarts them)")
    if counts.injected == 0:
        return Cond("True", "NoPodsSelected", "no running pod matches spec.selector yet")
    return Cond("True", "AllInjected", f"{counts.injected} pod(s) carry the current config")


def latest_run(runs: list[EvictorRun], tpc: TieredPrefixCache) -> EvictorRun | None:
    mine = [r for r in runs if r.namespace == tpc.namespace and r.cache == tpc.name]
    return max(mine, key=lambda r: r.finished_at, default=None)


def evictor_condition(tpc: TieredPrefixCache, run: EvictorRun | None) -> Cond:
    if tpc.spec.storage is None:
        return Cond("True", "NoStorageTier", "no shared tier to evict from")
    if tpc.spec.eviction.suspend:
        return Cond("Unknown", "Suspended", "spec.eviction.suspend is true; nothing evicts")
    if run is None:
        return Cond("Unknown", "NoRunYet", f"the evictor runs on '{tpc.spec.eviction.schedule}'")
    if run.report is None:
        return Cond("False", "ReportUnreadable", f"pod {run.pod}: {run.problem}")
    outcome = run.report.outcome
    if outcome in (NOTHING_TO_DO, FREED):
        return Cond("True", "Healthy", f"last run ({run.pod}): {outcome}")
    if outcome == ABOVE_LOW_WATERMARK:
        return Cond("False", "AboveLowWatermark",
                    f"last run ({run.pod}) could not get below the low watermark "
                    f"({run.report.usage_after.percent:.1f}% used): everything left was used "
                    "within minIdle; grow the claim or lower minIdle")
    errors = "; ".join(run.report.error_messages[:3]) or "see the pod's logs"
    return Cond("False", "EvictorError" if outcome == ERROR else "Unknown", errors)


def eviction_status(run: EvictorRun | None) -> tuple[EvictionStatus | None, UsageStatus | None]:
    """(lastEviction, usage) status blocks from the latest run."""
    if run is None or run.report is None:
        return None, None
    r = run.report
    last = EvictionStatus(
        time=run.finished_at or r.finished_at, outcome=r.outcome,
        files_deleted=r.files_deleted, bytes_freed=r.bytes_freed,
        temp_files_reaped=r.temp_files_reaped,
        usage_before=round(r.usage_before.percent, 2),
        usage_after=round(r.usage_after.percent, 2),
        duration_seconds=r.duration_seconds, errors=r.errors, job=run.job,
    )
    usage = UsageStatus(
        percent=round(r.usage_after.percent, 2),
        inode_percent=round(r.usage_after.inode_percent, 2),
        used_bytes=r.usage_after.used_bytes, capacity_bytes=r.usage_after.capacity_bytes,
        observed_at=run.finished_at or r.finished_at,
    )
    return last, usage


def prerequisites_condition(missing: list[str], unknown: list[str], checked: int) -> Cond:
    """What the engine needs that others manage (adapter.prerequisites), as found."""
    if missing:
        return Cond("False", "PrerequisitesMissing",
                    "; ".join(missing) + " (pods would crash-loop without it: create it or "
                    "fix the field)")
    if unknown:
        return Cond("Unknown", "PrerequisitesUnchecked", "; ".join(unknown))
    if checked == 0:
        return Cond("True", "NoPrerequisites", "the engine needs nothing kvtier can check")
    return Cond("True", "Found", f"{checked} prerequisite object(s) exist")


def engine_version_condition(tpc: TieredPrefixCache) -> Cond:
    """Which engine version kvtier renders for (engines/<engine>/versions.py)."""
    table = adapter_for(tpc.spec).versions
    if table is None:
        return Cond("True", "NotVersioned", "kvtier renders one configuration for every "
                    "version of this engine")
    if tpc.spec.engine_version is not None:
        return Cond("True", "Declared", f"spec.engineVersion: kvtier renders for "
                    f"{table.engine} {tpc.spec.engine_version}")
    return Cond("Unknown", "EngineVersionUnknown",
                f"spec.engineVersion is unset: kvtier renders for {table.engine} "
                f"{table.oldest}, the oldest it supports, and checks each pod's image tag "
                f"where it is a {table.engine} release; set spec.engineVersion to render "
                "for a newer one")


def ready_condition(storage: Cond, injected: Cond, evictor: Cond,
                    prerequisites: Cond | None = None) -> Cond:
    blocking = [(name, c) for name, c in ((PREREQUISITES_READY, prerequisites),
                                         (STORAGE_READY, storage), (INJECTED, injected),
                                         (EVICTOR_HEALTHY, evictor))
                if c is not None and c.status == "False"]
    if blocking:
        return Cond("False", blocking[0][1].reason,
                    "; ".join(f"{name}: {c.message}" for name, c in blocking))
    return Cond("True", "Ready", "storage, pods and evictor are as specified")


def conditions(new: dict[str, Cond], previous: list[dict[str, Any]] | None,
               generation: int | None, now: str) -> list[Condition]:
    """The conditions in CONDITION_TYPES order; `previous`: the live object's (raw)."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for kind in CONDITION_TYPES:
        c = new.get(kind)
        if c is None:
            continue
        old = before.get(kind)
        since = old.get("lastTransitionTime") if old and old.get("status") == c.status else now
        # observedGeneration only where known (unset fields are not written: status_doc).
        extra: dict[str, Any] = {} if generation is None else {"observed_generation": generation}
        out.append(Condition(type=kind, status=c.status, reason=c.reason, message=c.message,
                             last_transition_time=since, **extra))
    return out


def status_doc(status: TieredPrefixCacheStatus) -> dict[str, Any]:
    """The status as the API stores it (camelCase JSON), serialised once. Fields set to
    None stay (a merge patch then clears them, e.g. pvc when the shared tier goes);
    fields never set are left out (an invalid spec keeps the last configHash)."""
    return status.model_dump(mode="json", by_alias=True, exclude_unset=True)
