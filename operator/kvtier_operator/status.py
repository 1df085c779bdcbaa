"""Pure status computation: observations in, the TieredPrefixCache status out, built as
the typed status (api/v1alpha1/status.py) that also defines the CRD's status schema.

Every condition carries observedGeneration; lastTransitionTime changes only when a
condition's status does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvtier_evictor.report import ABOVE_LOW_WATERMARK, ERROR, FREED, NOTHING_TO_DO
from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import (
    Condition,
    EvictionStatus,
    LatencyStatus,
    ObservationStatus,
    RecomputeStatus,
    SkippedStatus,
    TieredPrefixCache,
    TieredPrefixCacheStatus,
    TierStatus,
    UsageStatus,
)
from kvtier_operator.engines.figures import (
    BYTES_LOADED,
    DROPPED_WRITES,
    OFFLOADED,
    PROMOTED_BYTES,
    SHARED_HIT_TOKENS,
    SHARED_TIERS_SEPARATOR,
    STORES,
    Key,
)
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe import EvictorRun, PodView
from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.observe.reads import LATE, STARVED
from kvtier_operator.observe.window import OVERFLOW, PodSums, WindowSum, quantile

log = logging.getLogger("kvtier_operator.status")

READY, STORAGE_READY, INJECTED, EVICTOR_HEALTHY = "Ready", "StorageReady", "Injected", \
    "EvictorHealthy"
PREREQUISITES_READY = "PrerequisitesReady"
ENGINE_VERSION = "EngineVersion"
# Observed, advisory: never part of Ready.
METRICS_READABLE, TIERS_EFFECTIVE = "MetricsReadable", "TiersEffective"
CONDITION_TYPES = (READY, STORAGE_READY, INJECTED, EVICTOR_HEALTHY, PREREQUISITES_READY,
                   ENGINE_VERSION, METRICS_READABLE, TIERS_EFFECTIVE)


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
    # pending pods whose workload owner has not opted in to this cache's restarts
    not_opted_in: list[str] = field(default_factory=list)


def count_pods(tpc: TieredPrefixCache, pods: list[PodView], config_hash: str) -> PodCounts:
    """Selected pods that run the engine: injected with the current config, or pending.
    A pod where no engine runs (no container the webhook would inject, and never injected
    by this cache) is neither: it is not the cache's to count or restart (audit N2)."""
    engine = adapter_for(tpc.spec).launcher.label
    injected, pending, not_opted_in = 0, [], []
    for pod in pods:
        if pod.namespace != tpc.namespace or not pod.active or pod.opted_out:
            continue
        if not tpc.spec.selector.matches(pod.label_dict):
            continue
        if pod.cache != tpc.name and engine not in pod.engines:
            continue
        if pod.cache == tpc.name and pod.config_hash == config_hash:
            injected += 1
        else:
            pending.append(pod.name)
            if pod.opted_in_to != tpc.name:
                not_opted_in.append(pod.name)
    return PodCounts(injected, sorted(pending), sorted(not_opted_in))


def opt_in_condition(tpc: TieredPrefixCache, counts: PodCounts) -> Cond:
    """rollout: Auto with pending pods whose workloads have not opted in: what to add."""
    shown = ", ".join(counts.not_opted_in[:5]) + (" ..." if len(counts.not_opted_in) > 5
                                                   else "")
    return Cond("False", "RolloutNotOptedIn", (
        f"{len(counts.not_opted_in)} pending pod(s) ({shown}) belong to workloads whose pod "
        f"template lacks the label {names.LABEL_CACHE}: {tpc.name}; rollout: Auto restarts "
        "only workloads whose owner added it. Add it to the workload's pod template (that "
        "edit restarts the pods with the current config), or restart them yourself"))


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
    # Whether the run published BlockRemoved (spec.router.evictionEventsEndpoint).
    published = bool(r.events_published or r.events_dropped or r.events_ignored
                     or r.events_problem)
    last = EvictionStatus(
        time=run.finished_at or r.finished_at, outcome=r.outcome,
        files_deleted=r.files_deleted, bytes_freed=r.bytes_freed,
        temp_files_reaped=r.temp_files_reaped,
        usage_before=round(r.usage_before.percent, 2),
        usage_after=round(r.usage_after.percent, 2),
        duration_seconds=r.duration_seconds, errors=r.errors, job=run.job,
        events_published=r.events_published if published else None,
        events_dropped=r.events_dropped if published else None,
        events_ignored=r.events_ignored if published else None,
        events_problem=(r.events_problem[:500] or None) if published else None,
    )
    usage = UsageStatus(
        percent=round(r.usage_after.percent, 2),
        inode_percent=round(r.usage_after.inode_percent, 2),
        used_bytes=r.usage_after.used_bytes, capacity_bytes=r.usage_after.capacity_bytes,
        observed_at=run.finished_at or r.finished_at,
    )
    return last, usage


def prerequisites_condition(missing: list[str], unknown: list[str], checked: int,
                            refused: list[str] | None = None) -> Cond:
    """What the engine needs that others manage (adapter.prerequisites), as found;
    `refused`: references kvtier does not follow (another namespace, not allowed)."""
    if refused:
        return Cond("False", "ReferenceNotAllowed", "; ".join(refused))
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


# ------------------------------------------------------------ observed tiers and advice

# Advice thresholds: enough traffic to judge, and what counts as a problem.
MIN_PROMPT_TOKENS = 10_000  # over the window, before a tier is called idle
IDLE_CPU_PERCENT = 1.0
FAILING_LOADS_PERCENT = 5.0
MIN_LOADS = 20
TOO_SMALL_STORAGE_SHARE = 50.0  # % of offloaded hits that came from the volume
CPU_FULL_PERCENT = 90.0
SKIPPED_PERCENT = 20.0  # of the requests prefilled, before a skipped tier is advice
MIN_REQUESTS = 20
DROPPED_WRITES_PERCENT = 10.0  # of the stores asked of a tier, before drops are advice
MIN_STORES = 20
# The most characters of an advice or metrics condition's message (and of its Event):
# figures, reasons and problems come from pods, so nothing they say grows it further.
MAX_MESSAGE = 2000
# Dropped-write reasons a WritesDropped message names: the largest ones.
MAX_REASONS_SAID = 6
# Where a tier's write threads are set, for the advice on dropped writes.
WRITE_THREADS_FIELD = {"storage": "spec.storage.writeThreads",
                       "localDisk": "spec.localDisk.writeThreads",
                       "objectStore": "spec.objectStore.maxConcurrency"}


@dataclass
class ObservedTiers:
    tiers: list[TierStatus] | None = None
    recompute: RecomputeStatus | None = None
    hit_percent: float | None = None
    observation: ObservationStatus | None = None
    metrics: Cond | None = None
    advice: Cond | None = None
    cpu_capacity_tokens: int | None = None  # per pod, the least the engines report


def _pct(part: float | None, whole: float | None) -> float | None:
    """part as % of whole, within 0-100; None without a (finite, positive) whole."""
    if part is None or whole is None or not math.isfinite(part) or \
            not math.isfinite(whole) or whole <= 0 or part < 0:
        return None
    return round(min(100.0, 100.0 * part / whole), 2)


def _share(pairs: Iterable[tuple[float | None, float | None]]) -> float | None:
    """A share over the pods that have both its parts ((part, whole) per pod): a pod
    that lacks one adds to neither."""
    parts: list[float] = []
    wholes: list[float] = []
    for part, whole in pairs:
        if part is not None and whole is not None:
            parts.append(part)
            wholes.append(whole)
    if not parts:
        return None
    return _pct(math.fsum(parts), math.fsum(wholes))


def _int(value: float | None) -> int | None:
    """A count for status: None where not a finite, non-negative number."""
    return None if value is None or not math.isfinite(value) or value < 0 else round(value)


def _finite(w: WindowSum) -> WindowSum:
    """The window without sums that are not finite numbers (missing, with why)."""
    bad = {k for k, v in w.counters.items() if not math.isfinite(v)}
    # Nothing to leave out (the common case, so no copy): no sum is infinite. A step is
    # a difference of two finite, non-negative readings (PodHistory.add), always finite.
    if not bad and all(math.isfinite(v) for pod in w.per_pod() for v in pod.counters.values()):
        return w

    def kept(counters: dict[Key, float]) -> dict[Key, float]:
        return {k: v for k, v in counters.items() if k not in bad and math.isfinite(v)}

    return replace(w, counters=kept(w.counters),
                   missing={**w.missing, **{k: OVERFLOW for k in bad}},
                   pods=[PodSums(kept(p.counters), [kept(step) for step in p.steps])
                         for p in w.per_pod()])


def _tier_names(tpc: TieredPrefixCache, offloaded: tuple[str, ...],
                window: WindowSum) -> list[str]:
    out = ["gpu", *offloaded]
    out += sorted({tier for (figure, tier) in window.counters
                   if tier and tier not in out and figure != SHARED_HIT_TOKENS})
    return out


def _split_basis(pod: dict[Key, float], tiers: list[str]) -> dict[str, float] | None:
    """What to split several tiers' shared hits by: each tier's bytes loaded over the
    pod's window (kvtier's backend), else the bytes the engine promoted from it,
    whichever every one of them has a figure for; None where neither (a missing figure
    is never taken as a zero)."""
    for figure in (BYTES_LOADED, PROMOTED_BYTES):
        basis = {t: pod.get((figure, t)) for t in tiers}
        if all(v is not None and v >= 0 for v in basis.values()):
            return {t: v or 0.0 for t, v in basis.items()}
    return None


def _hits(counters: dict[Key, float], pod: dict[Key, float]
          ) -> tuple[dict[str, float], set[str]]:
    """Prompt tokens served per tier (a pod's over the window, or over one step of it),
    and which tiers' figures are derived: where the engine counts several tiers together
    (SHARED_HIT_TOKENS), their tokens are split by each tier's bytes loaded over the
    pod's window (one block holds as many tokens in any tier; _split_basis). Without a
    figure for every one of them, or with none loaded, they stay together under
    `offloaded`."""
    hits: dict[str, float] = {}
    shared: list[tuple[str, float]] = []
    for (figure, tier), v in counters.items():  # one pass: a reconcile runs this per step
        if figure == "hit_tokens":
            hits[tier] = v
        elif figure == SHARED_HIT_TOKENS:
            shared.append((tier, v))
    derived: set[str] = set()
    for group, tokens in shared:
        tiers = group.split(SHARED_TIERS_SEPARATOR)
        loaded = _split_basis(pod, tiers)
        basis = sum(loaded.values()) if loaded else 0.0
        if not tokens:  # none to split: each tier's share of them is none
            for t in tiers:
                hits[t] = hits.get(t, 0.0)
            derived.update(tiers)
        elif loaded and basis > 0:
            for t in tiers:
                hits[t] = hits.get(t, 0.0) + tokens * loaded[t] / basis
            derived.update(tiers)
        else:
            hits[OFFLOADED] = hits.get(OFFLOADED, 0.0) + tokens
    return hits, derived


def observed_tiers(tpc: TieredPrefixCache, offloaded: tuple[str, ...],
                   obs: CacheObservation | None, usage: UsageStatus | None,
                   enabled: bool, last_run: EvictorRun | None = None) -> ObservedTiers:
    """status.tiers, status.recompute, the Hit figure and the two conditions from the
    latest observation round (None: none yet). Figures a pod reported cannot stop the
    reconcile: where they cannot be made into status, the figures are left out and the
    MetricsReadable condition says why."""
    try:
        return _observed_tiers(tpc, offloaded, obs, usage, enabled, last_run)
    except (ArithmeticError, ValueError) as err:  # ValueError: pydantic's refusals too
        log.exception("figures for %s left out of status", tpc.name)
        out = ObservedTiers()
        out.metrics = Cond("Unknown", "FiguresUnusable",
                           f"the pods' figures could not be made into status ({err}); "
                           "the operator's log has the detail")
        out.advice = Cond("Unknown", "NotObserved", "no usable figures this round")
        return out


def _observed_tiers(tpc: TieredPrefixCache, offloaded: tuple[str, ...],
                    obs: CacheObservation | None, usage: UsageStatus | None,
                    enabled: bool, last_run: EvictorRun | None) -> ObservedTiers:
    out = ObservedTiers()
    if not enabled:
        out.metrics = Cond("Unknown", "ObservationOff",
                           "the operator's observation is off (observe.enabled: false in the "
                           "Helm values); no tier figures")
        out.advice = Cond("Unknown", "NotObserved", "no figures: observation is off")
        return out
    if obs is None:
        out.metrics = Cond("Unknown", "NotReadYet", "the pods' metrics have not been read yet")
        out.advice = Cond("Unknown", "NotObserved", "no figures yet")
        return out
    w = _finite(obs.window)
    out.observation = ObservationStatus(
        window_seconds=round(w.span, 1) if w.pods_with_steps else None,
        pods_read=obs.pods_read, pods_unreadable=obs.pods_unreadable,
        problems=obs.problems or None, observed_at=obs.observed_at)
    out.metrics = _metrics_condition(obs)
    if not obs.reads or obs.pods_read == 0:
        out.advice = Cond("Unknown", "NotObserved", out.metrics.message)
        return out
    prompt = w.counters.get(("prompt_tokens", "")) if w.pods_with_steps else None
    if not w.pods_with_steps:
        no_traffic = "one read so far: shares need two (the next round)"
    elif prompt is None:
        no_traffic = w.missing.get(("prompt_tokens", ""), "no prompt-token figure")
    else:
        no_traffic = "no prompt tokens over the window"
    tiers = []
    pods = w.per_pod()
    pod_hits = [_hits(pod.counters, pod.counters) for pod in pods]
    hit_tokens = _summed_hits([hits for hits, _ in pod_hits])
    derived: set[str] = set().union(*(tiers for _, tiers in pod_hits))
    # Shares: over each pod's steps that have both parts (the same span for both).
    steps = [(step, pod.counters) for pod in pods for step in pod.steps]
    step_hits = [(_hits(step, basis)[0], step.get(("prompt_tokens", ""))) for step, basis in steps]

    def share(part: Key, whole: Key) -> float | None:
        return _share((step[part], step.get(whole)) for step, _ in steps if part in step)

    names = _tier_names(tpc, offloaded, w)
    names += [t for t in hit_tokens if t not in names]
    hit_shares = _shares_by_tier(step_hits)
    for name in names:
        def counter(figure: str, tier: str = name) -> float | None:
            return w.counters.get((figure, tier)) if w.pods_with_steps else None

        def gauge(figure: str, tier: str = name, pick: Callable[[list[float]], float] = min
                  ) -> float | None:
            values = w.gauges.get((figure, tier))
            return pick(values) if values else None

        hits = hit_tokens.get(name)
        buckets = w.buckets(("load_seconds", name))
        p50, p99 = quantile(0.5, buckets), quantile(0.99, buckets)
        reasons = sorted({why for (fig, tier), why in w.missing.items()
                          if tier == name and (fig, tier) not in w.counters
                          and (fig, tier) not in w.gauges and (fig, tier) not in w.histograms})
        if not prompt:
            reasons.insert(0, no_traffic)
        status = TierStatus(
            name=name, hit_percent=hit_shares.get(name),
            hit_tokens=_int(hits),
            hit_source=None if hits is None else "derived" if name in derived else "engine",
            bytes_loaded=_int(counter("bytes_loaded")), bytes_stored=_int(counter("bytes_stored")),
            load_latency=LatencyStatus(p50_seconds=_round(p50), p99_seconds=_round(p99))
            if p50 is not None else None,
            failed_loads=_int(counter("failed_loads")),
            skipped=_skipped(counter, share(("skipped_requests", name), ("requests", ""))),
            dropped_writes=_int(counter(DROPPED_WRITES)),
            dropped_writes_percent=share((DROPPED_WRITES, name), (STORES, name)),
            capacity_bytes=_int(gauge("capacity_bytes")),
            capacity_tokens=_int(gauge("capacity_tokens")),
            used_percent=_round(gauge("used_percent", pick=lambda v: sum(v) / len(v))),
            unobserved="; ".join(reasons) or None, observed_at=obs.observed_at)
        if name == "storage" and usage is not None:
            status.capacity_bytes = usage.capacity_bytes
            status.used_percent = usage.percent
        tiers.append(status)
    out.tiers = tiers
    recomputed = w.counters.get(("recomputed_tokens", "")) if w.pods_with_steps else None
    out.recompute = RecomputeStatus(
        percent=share(("recomputed_tokens", ""), ("prompt_tokens", "")),
        tokens=_int(recomputed),
                                    prompt_tokens=_int(prompt), observed_at=obs.observed_at)
    out.hit_percent = _share((_offloaded(hits), p) for hits, p in step_hits)
    # The router's LRU is sized from it: only a positive, finite figure counts.
    capacity = [v for v in w.gauges.get(("capacity_tokens", "cpu"), ())
                if math.isfinite(v) and v >= 1]
    out.cpu_capacity_tokens = int(min(capacity)) if capacity else None
    out.advice = _advice(tpc, w, tiers, prompt, last_run)
    return out


def _shares_by_tier(step_hits: list[tuple[dict[str, float], float | None]]
                    ) -> dict[str, float | None]:
    """Each tier's share of prompt tokens over the steps that have both its hits and the
    prompt tokens (_share's rule, for every tier in one pass over the steps)."""
    parts: dict[str, list[float]] = {}
    wholes: dict[str, list[float]] = {}
    for hits, prompt in step_hits:
        if prompt is None:
            continue
        for tier, tokens in hits.items():
            parts.setdefault(tier, []).append(tokens)
            wholes.setdefault(tier, []).append(prompt)
    return {tier: _pct(math.fsum(parts[tier]), math.fsum(wholes[tier])) for tier in parts}


def _summed_hits(per_pod: list[dict[str, float]]) -> dict[str, float]:
    """Hit tokens per tier over the pods (a sum that is not finite is left out)."""
    out: dict[str, float] = {}
    for hits in per_pod:
        for tier, tokens in hits.items():
            out[tier] = out.get(tier, 0.0) + tokens
    return {t: v for t, v in out.items() if math.isfinite(v)}


def _offloaded(hits: dict[str, float]) -> float | None:
    """A pod's tokens served from the offloaded tiers (None: no figure for any)."""
    offloaded = [v for t, v in hits.items() if t != "gpu"]
    return math.fsum(offloaded) if offloaded else None


def _skipped(counter: Callable[[str], float | None], percent: float | None
             ) -> SkippedStatus | None:
    total = counter("skipped_requests")
    if total is None:
        return None
    return SkippedStatus(requests=_int(total),
                         lookup_wait=_int(counter("skipped_requests:lookup-wait")),
                         load_slower=_int(counter("skipped_requests:load-slower")),
                         percent=percent)


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)


def _metrics_condition(obs: CacheObservation) -> Cond:
    if not obs.reads:
        return Cond("Unknown", "NoEngineMetrics",
                    "kvtier reads no figures from this engine's metrics")
    if obs.pods_selected == 0:
        return Cond("Unknown", "NoPodsToRead", "no injected pod to read yet")
    failed = obs.pods_unreadable - obs.pods_late - obs.pods_starved
    late = (f"{obs.pods_late} of {obs.pods_selected} pod(s) skipped this round: the "
            "round's parse time ran out (other pods' pages slow to parse, or the operator "
            "short of CPU); they are read again next round") if obs.pods_late else ""
    starved = (f"{obs.pods_starved} of {obs.pods_selected} pod(s) not read in time this "
               "round: the operator's reading process waited for the CPU (it runs after "
               "the webhook and the handlers); give the operator more CPU (the chart's "
               "resources.requests.cpu) or its reads more time (observe.timeoutSeconds)"
               ) if obs.pods_starved else ""
    ours = "; ".join(why for why in (starved, late) if why)
    if failed > 0:
        first = next((p for p in obs.problems
                      if not p.endswith(LATE) and not p.endswith(STARVED)), "")
        return Cond("False", "MetricsUnreadable", _bounded(
            f"{failed} of {obs.pods_selected} pod(s) gave no figures ({first}); open the "
            "metrics port to the operator, fix the page, or set the "
            "kvtier.dev/metrics-port annotation" + (f"; {ours}" if ours else "")))
    # the operator's own CPU or budget, not the pods': nothing to fix on them
    if starved:
        return Cond("Unknown", "ObservationStarved", _bounded(ours))
    if late:
        return Cond("Unknown", "MetricsReadLate", late)
    return Cond("True", "MetricsRead", f"read {obs.pods_read} pod(s)")


def _bounded(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."


def _skipped_advice(tier: str, skipped: SkippedStatus, requests: float) -> str:
    share = 100.0 * (skipped.requests or 0) / requests
    why = []
    if skipped.lookup_wait:
        why.append(f"{skipped.lookup_wait} because its lookups would have answered after "
                   "recompute ended (the volume's metadata round trips: a storage class with "
                   "faster lookups, or more tokens per file, router.blockSize)")
    if skipped.load_slower:
        why.append(f"{skipped.load_slower} because loading would have taken longer than "
                   "recomputing (the volume's read throughput: a faster volume, or no "
                   "shared tier for this model)")
    return (f"{skipped.requests} of {int(requests)} requests ({share:.0f}%, over "
            f"{SKIPPED_PERCENT:g}%) recomputed rather than use the {tier} tier: "
            + "; ".join(why or ["for a reason this kvtier does not know"]))


# The backend's reasons for dropping a store (kept by the engines' readers, e.g.
# engines/vllm/metrics.py DROP_REASONS), each with its own fix; every other reason is
# writes not keeping up.
FREE_SPACE_FLOOR = "free-space-floor"
PARTIAL_FILE = "partial-file"
STAGING_FULL = "staging-full"
# Where a tier's host staging buffer is sized (GPU-direct mode, without a CPU tier).
STAGING_SIZE_FIELD = "spec.storage.hostStagingSize"


def _floor_fix(tier: str, count: float) -> str:
    if tier == "localDisk":
        return (f"{int(count)} at the local disk's free-space floor: the disk fills before "
                "the tier reaches its own bound; set spec.localDisk.capacity below the "
                "space the disk really has (the tier evicts at it), or give it a larger disk")
    return (f"{int(count)} at the volume's free-space floor: evict more "
            "(eviction.schedule, highWatermark) or grow the volume")


def _dropped_advice(tier: str, w: WindowSum, dropped: float, stores: float) -> str:
    reasons = {figure.partition(":")[2]: v for (figure, t), v in w.counters.items()
               if t == tier and figure.startswith(f"{DROPPED_WRITES}:") and v}
    floor = reasons.pop(FREE_SPACE_FLOOR, 0.0)
    partial = reasons.pop(PARTIAL_FILE, 0.0)
    staging = reasons.pop(STAGING_FULL, 0.0)
    largest = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_REASONS_SAID]
    said = ", ".join(f"{int(v)} {reason[:40]}" for reason, v in sorted(largest))
    fixes = []
    if reasons or not (floor or partial or staging):
        threads = WRITE_THREADS_FIELD.get(tier)
        more = f"more write threads ({threads})" if threads else "more write threads"
        fixes.append(f"its writes do not keep up ({said or 'reason unknown'}): a faster "
                     f"volume or {more}")
    if staging:
        fixes.append(f"{int(staging)} with the host staging buffer full: a larger "
                     f"{STAGING_SIZE_FIELD}")
    if partial:
        fixes.append(f"{int(partial)} partial-file: chunks whose blocks had left the "
                     "model's sliding-window (hybrid) layers before they were stored; a "
                     "property of the model's layers that no setting changes")
    if floor:
        fixes.append(_floor_fix(tier, floor))
    return (f"the {tier} tier dropped {int(dropped)} of {int(stores)} block stores "
            f"({100.0 * dropped / stores:.0f}%, over {DROPPED_WRITES_PERCENT:g}%) rather than "
            "write them; " + "; ".join(fixes))


def _loads_advice(w: WindowSum, tiers: list[TierStatus], cpu: TierStatus | None,
                  found: list[tuple[str, str]]) -> None:
    """LoadsFailing and VolumeSlowerThanRecompute, per tier behind HBM (on the tier's
    own hit tokens: the engine's, or split by status from a shared count)."""
    prefill = w.counters.get(("prefill_seconds", ""))
    computed = w.counters.get(("recomputed_tokens", ""))
    for tier in tiers:
        if tier.name in ("gpu", "cpu", OFFLOADED):
            continue
        loads = w.counters.get(("loads", tier.name))
        failed = w.counters.get(("failed_loads", tier.name))
        if loads and failed is not None and loads >= MIN_LOADS and \
                100.0 * failed / loads > FAILING_LOADS_PERCENT:
            found.append(("LoadsFailing",
                          f"{100.0 * failed / loads:.1f}% of {int(loads)} loads from the "
                          f"{tier.name} tier failed and were recomputed (over "
                          f"{FAILING_LOADS_PERCENT:g}%); see the pods' "
                          "kvtier_offload_corrupt_files and the tier's volume's health"))
        # Its loads: straight into HBM without a CPU tier, promotions into the CPU tier
        # with one (the engines' readers file either as the tier's load time).
        load_time = w.counters.get(("load_time_seconds", tier.name))
        if load_time and tier.hit_tokens and prefill and computed:
            per_load, per_compute = load_time / tier.hit_tokens, prefill / computed
            if per_load > per_compute:
                into = " into the CPU tier" if cpu is not None else ""
                where = "the volume" if tier.name == "storage" else f"the {tier.name} tier"
                found.append(("VolumeSlowerThanRecompute",
                              f"loading from {where}{into} takes {per_load * 1e6:.1f} us "
                              f"per token, computing {per_compute * 1e6:.1f} us (the "
                              f"engine's prefill time); a faster volume for {where}, or "
                              "fewer tokens per file (router.blockSize), or no "
                              f"{tier.name} tier for this model"))


def _cpu_advice(tpc: TieredPrefixCache, tiers: list[TierStatus], cpu: TierStatus | None,
                prompt: float | None, found: list[tuple[str, str]]) -> None:
    """CpuTierTooSmall or CpuTierIdle, never both: a full CPU tier whose hits went to the
    volume is too small, whatever share it served itself."""
    if cpu is None or cpu.hit_tokens is None or not prompt:
        return
    behind = [t.hit_tokens or 0 for t in tiers if t.name not in ("gpu", "cpu")]
    storage = next((t.hit_tokens for t in tiers if t.name == "storage"), None)
    offloaded_hits = cpu.hit_tokens + sum(behind)
    if storage and offloaded_hits:
        share = 100.0 * storage / offloaded_hits
        full = cpu.used_percent is None or cpu.used_percent >= CPU_FULL_PERCENT
        if share > TOO_SMALL_STORAGE_SHARE and full:
            found.append(("CpuTierTooSmall",
                          f"{share:.0f}% of offloaded hits came from the volume, not the CPU "
                          f"tier ({tpc.spec.cpu.size if tpc.spec.cpu else '?'}"
                          + (f", {cpu.used_percent:.0f}% used" if cpu.used_percent is not None
                             else "") + "); grow spec.cpu.size"))
            return
    if prompt >= MIN_PROMPT_TOKENS and 100.0 * cpu.hit_tokens / prompt < IDLE_CPU_PERCENT:
        needed = [field for field, set_ in (("spec.localDisk", tpc.spec.local_disk),
                                            ("spec.objectStore", tpc.spec.object_store))
                  if set_ is not None]
        fix = (f"shrink spec.cpu (it stays: {' and '.join(needed)} need a CPU tier)"
               if needed else "shrink or drop spec.cpu")
        found.append(("CpuTierIdle",
                      f"the CPU tier served {100.0 * cpu.hit_tokens / prompt:.2f}% of "
                      f"{int(prompt)} prompt tokens; {fix}, or route repeated prefixes to "
                      "the same replicas"))


def _advice(tpc: TieredPrefixCache, w: WindowSum, tiers: list[TierStatus],
            prompt: float | None, run: EvictorRun | None) -> Cond:
    by = {t.name: t for t in tiers}
    found: list[tuple[str, str]] = []
    cpu = by.get("cpu")
    _loads_advice(w, tiers, cpu, found)
    for tier in tiers:
        dropped, stores = w.counters.get((DROPPED_WRITES, tier.name)), \
            w.counters.get((STORES, tier.name))
        if dropped and stores and stores >= MIN_STORES and \
                100.0 * dropped / stores > DROPPED_WRITES_PERCENT:
            found.append(("WritesDropped", _dropped_advice(tier.name, w, dropped, stores)))
    requests = w.counters.get(("requests", ""))
    for tier in tiers:
        skipped = tier.skipped
        if skipped is None or not skipped.requests or not requests or \
                requests < MIN_REQUESTS or 100.0 * skipped.requests / requests <= SKIPPED_PERCENT:
            continue
        found.append(("TierSkipped", _skipped_advice(tier.name, skipped, requests)))
    _cpu_advice(tpc, tiers, cpu, prompt, found)
    high = tpc.spec.eviction.high_watermark
    if run is not None and run.report is not None and tpc.spec.storage is not None and \
            run.report.usage_after.percent >= high:
        found.append(("EvictorBehind",
                      f"the volume is {run.report.usage_after.percent:.1f}% used after the "
                      f"last evictor run (highWatermark {high}%); run it more often "
                      "(eviction.schedule), lower minIdle, or grow the claim"))
    if found:
        return Cond("False", found[0][0], _bounded("; ".join(m for _, m in found)))
    if not prompt:
        return Cond("Unknown", "NotEnoughTraffic", "no prompt tokens over the window yet")
    return Cond("True", "TiersEffective",
                f"no advice: no tier's failed loads over {FAILING_LOADS_PERCENT:g}% and "
                "each tier serves what it holds")
