"""The operator's Prometheus metrics (kvtier_operator_*)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvtier_operator.api.v1alpha1 import TieredPrefixCacheStatus

RECONCILES = Counter("kvtier_operator_reconciles", "Reconciles by result",
                     ["result"])  # ok | degraded | invalid | retry | error
RECONCILE_SECONDS = Histogram("kvtier_operator_reconcile_duration_seconds",
                              "Time to reconcile one TieredPrefixCache")
MANAGED_CACHES = Gauge("kvtier_operator_managed_caches", "TieredPrefixCaches watched")
INJECTED_PODS = Gauge("kvtier_operator_injected_pods",
                      "Selected pods carrying the current config", ["namespace", "cache"])
PENDING_PODS = Gauge("kvtier_operator_pending_pods",
                     "Selected pods running without the current config", ["namespace", "cache"])
ERRORS = Counter("kvtier_operator_errors", "Errors by kind",
                 ["kind"])  # rejected | retryable | unexpected
VOLUME_USAGE = Gauge("kvtier_operator_volume_usage_percent",
                     "Shared volume bytes used, %, from the latest evictor report",
                     ["namespace", "cache"])
EVICTED_FILES = Gauge("kvtier_operator_last_eviction_files_deleted",
                      "Files the latest evictor run deleted", ["namespace", "cache"])
EVICTED_BYTES = Gauge("kvtier_operator_last_eviction_bytes_freed",
                      "Bytes the latest evictor run freed", ["namespace", "cache"])
EVICTION_EVENTS = Gauge("kvtier_operator_last_eviction_events",
                        "Block hashes of the latest evictor run's BlockRemoved events, by "
                        "outcome (published, dropped, ignored)",
                        ["namespace", "cache", "outcome"])
READY = Gauge("kvtier_operator_ready", "1 when the TieredPrefixCache is Ready",
              ["namespace", "cache"])

# What each tier delivered over the observation window (status.tiers), by cache and tier.
# A figure the pods do not export is not set (a series with no sample, never a zero).
TIER_LABELS = ["namespace", "cache", "tier"]
TIER_HIT = Gauge("kvtier_tier_hit_percent",
                 "Share of prompt tokens served from the tier over the window, %", TIER_LABELS)
TIER_BYTES_LOADED = Gauge("kvtier_tier_bytes_loaded",
                          "Bytes loaded from the tier over the window", TIER_LABELS)
TIER_BYTES_STORED = Gauge("kvtier_tier_bytes_stored",
                          "Bytes stored into the tier over the window", TIER_LABELS)
TIER_LOAD_P50 = Gauge("kvtier_tier_load_latency_p50_seconds",
                      "Median latency of one load from the tier", TIER_LABELS)
TIER_LOAD_P99 = Gauge("kvtier_tier_load_latency_p99_seconds",
                      "99th percentile latency of one load from the tier", TIER_LABELS)
TIER_FAILED_LOADS = Gauge("kvtier_tier_failed_loads",
                          "Loads from the tier that failed and were recomputed, over the window",
                          TIER_LABELS)
TIER_SKIPPED = Gauge("kvtier_tier_skipped_requests",
                     "Requests that recomputed rather than wait for or load the tier, over "
                     "the window", TIER_LABELS)
TIER_DROPPED_WRITES = Gauge("kvtier_tier_dropped_writes",
                            "Block stores the tier's backend dropped rather than write, over "
                            "the window", TIER_LABELS)
TIER_USED = Gauge("kvtier_tier_used_percent", "Tier use, % of capacity", TIER_LABELS)
TIER_CAPACITY = Gauge("kvtier_tier_capacity_bytes", "Tier capacity per pod, bytes",
                      TIER_LABELS)
RECOMPUTE = Gauge("kvtier_tier_recompute_percent",
                  "Share of prompt tokens computed (no tier had them) over the window, %",
                  ["namespace", "cache"])
HIT = Gauge("kvtier_tier_offloaded_hit_percent",
            "Share of prompt tokens served from the offloaded tiers over the window, %",
            ["namespace", "cache"])
_TIER_FIGURES = ((TIER_HIT, "hit_percent"), (TIER_BYTES_LOADED, "bytes_loaded"),
                 (TIER_BYTES_STORED, "bytes_stored"), (TIER_FAILED_LOADS, "failed_loads"),
                 (TIER_USED, "used_percent"), (TIER_CAPACITY, "capacity_bytes"),
                 (TIER_DROPPED_WRITES, "dropped_writes"))


def _set(gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
    if value is None:
        try:
            gauge.remove(*labels)
        except KeyError:
            pass
    else:
        gauge.labels(*labels).set(value)


# The tiers each cache's gauges were last set for: a tier that leaves status.tiers (or a
# cache that stops being observed, turns invalid or is deleted) takes its samples along.
_EXPORTED_TIERS: dict[tuple[str, str], set[str]] = {}
_TIER_GAUGES = (*(gauge for gauge, _ in _TIER_FIGURES), TIER_LOAD_P50, TIER_LOAD_P99,
                TIER_SKIPPED)
_CACHE_GAUGES = (INJECTED_PODS, PENDING_PODS, VOLUME_USAGE, EVICTED_FILES, EVICTED_BYTES,
                 READY, RECOMPUTE, HIT)


def _remove_tier(cache: tuple[str, str], tier: str) -> None:
    for gauge in _TIER_GAUGES:
        _set(gauge, (*cache, tier), None)


def export_tiers(cache: tuple[str, str], status: TieredPrefixCacheStatus) -> None:
    """The status's tier figures as kvtier_tier_* gauges; absent figures: no sample, and
    tiers no longer in the status (none where it has no tiers): no samples at all."""
    current = {tier.name for tier in status.tiers or []}
    for gone in _EXPORTED_TIERS.pop(cache, set()) - current:
        _remove_tier(cache, gone)
    if current:
        _EXPORTED_TIERS[cache] = current
    for tier in status.tiers or []:
        labels = (*cache, tier.name)
        for gauge, attr in _TIER_FIGURES:
            _set(gauge, labels, getattr(tier, attr))
        latency = tier.load_latency
        _set(TIER_LOAD_P50, labels, latency.p50_seconds if latency else None)
        _set(TIER_LOAD_P99, labels, latency.p99_seconds if latency else None)
        _set(TIER_SKIPPED, labels, tier.skipped.requests if tier.skipped else None)
    _set(RECOMPUTE, cache, status.recompute.percent if status.recompute else None)
    _set(HIT, cache, status.hit_percent)


def export_status(cache: tuple[str, str], status: TieredPrefixCacheStatus,
                  valid: bool) -> None:
    """A reconciled cache's gauges; an invalid cache has none (its figures would be a
    previous spec's)."""
    if not valid:
        forget_cache(cache)
        return
    INJECTED_PODS.labels(*cache).set(status.injected_pods or 0)
    PENDING_PODS.labels(*cache).set(status.pending_pods or 0)
    READY.labels(*cache).set(
        status.conditions is not None and status.conditions[0].status == "True")
    if status.usage is not None and status.usage.percent is not None:
        VOLUME_USAGE.labels(*cache).set(status.usage.percent)
    last = status.last_eviction
    if last is not None:
        EVICTED_FILES.labels(*cache).set(last.files_deleted or 0)
        EVICTED_BYTES.labels(*cache).set(last.bytes_freed or 0)
        if last.events_published is not None:
            for outcome, count in (("published", last.events_published),
                                   ("dropped", last.events_dropped),
                                   ("ignored", last.events_ignored)):
                EVICTION_EVENTS.labels(*cache, outcome).set(count or 0)
    export_tiers(cache, status)


def forget_cache(cache: tuple[str, str]) -> None:
    """Every gauge sample of one cache (deleted, or invalid): none of another's."""
    for tier in _EXPORTED_TIERS.pop(cache, set()):
        _remove_tier(cache, tier)
    for gauge in _CACHE_GAUGES:
        _set(gauge, cache, None)
    for outcome in ("published", "dropped", "ignored"):
        _set(EVICTION_EVENTS, (*cache, outcome), None)
