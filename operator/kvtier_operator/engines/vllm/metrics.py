"""What vLLM's /metrics says about the tiers (0.32 and 0.33; tests on pages captured from
real API servers, tests/fixtures/metrics/).

- Prompt tokens by where their KV came from: `vllm:prompt_tokens_cached_by_source`
  (device, host, disk, p2p, external_unspecified), else the older pair
  `vllm:prefix_cache_hits` (HBM) and `vllm:external_prefix_cache_hits` (the connector);
  computed ones: `vllm:prompt_tokens_by_source{source="local_compute"}`.
- Bytes between HBM and the first offloaded medium: `vllm:kv_offload_load_bytes` and
  `_store_bytes` (the CPU tier where there is one, else the files), and the time spent
  loading from it, `vllm:kv_offload_load_time`.
- Under vLLM's TieringOffloadingSpec (a CPU tier with tiers behind it), each secondary
  tier's loads are promotions into the CPU tier: `vllm:kv_offload_tiering_read_time` and
  `_read_bytes`, labelled `tier="<index>:<class>"`, index 1 the first tier behind the CPU
  tier, in the order the operator renders them (the spec's offloaded tiers after cpu).
- kvtier's backend (the files): `kvtier_offload_bytes`, `_operations` (failed loads:
  any load outcome but ok, and `_corrupt_files`: files refused on load),
  `_latency_seconds` (load p50/p99), `_tier_skipped` (requests that recomputed rather than
  wait for or load the tier, by reason; the series appears at the first skip),
  `_dropped_writes` (stores dropped rather than written, by reason; from the first drop)
  beside the stores asked (`_operations{direction="store"}`, `_failed_writes`), each
  series labelled by its tier (localDisk, storage, objectStore). Where several of those
  tiers are configured, vLLM's "disk" hits cover them together (SHARED_HIT_TOKENS),
  which status splits by each tier's bytes loaded, else by the bytes vLLM promoted from
  each (`vllm:kv_offload_tiering_read_bytes`, PROMOTED_BYTES: vLLM's own fs tier has no
  kvtier series). A tier without kvtier's series gets none of their figures, no zeros.
  They reach /metrics through vLLM's
  stats channel when kvtier's tier runs under vLLM's TieringOffloadingSpec, and in
  GPU-direct mode through prometheus-client's multiprocess directory that kvtier
  renders (PROMETHEUS_MULTIPROC_DIR); where absent, `missing` says why.
- Capacity: 0.33's `vllm:kv_offload_config_info` (cpu_kv_cache_size_bytes and _tokens,
  cpu_num_chunks x cpu_blocks_per_chunk); use: `vllm:kv_offload_cpu_cache_usage_perc`,
  `vllm:kv_cache_usage_perc` (HBM), both fractions.
"""

from __future__ import annotations

import math

from kvtier_operator.engines.figures import (
    BYTES_LOADED,
    BYTES_STORED,
    CAPACITY_BYTES,
    CAPACITY_TOKENS,
    DROPPED_WRITES,
    FAILED_LOADS,
    HIT_TOKENS,
    LOAD_SECONDS,
    LOAD_TIME,
    LOADS,
    OFFLOADED,
    PREFILL_SECONDS,
    PROMOTED_BYTES,
    PROMPT_TOKENS,
    RECOMPUTED_TOKENS,
    REQUESTS,
    SHARED_HIT_TOKENS,
    SHARED_TIERS_SEPARATOR,
    SKIPPED_REQUESTS,
    STORES,
    USED_PERCENT,
    Labels,
    PodFigures,
    Samples,
    buckets,
    by_label,
    put,
    total,
)

SOURCE_TIER = {"device": "gpu", "host": "cpu", "disk": "storage", "p2p": "p2p"}
# kvtier's tiers on files or objects: vLLM counts a hit on any of them as source "disk";
# kvtier's own series name each one in their tier label (kvtier_offload.metrics.TIER).
KVTIER_TIERS = ("localDisk", "storage", "objectStore")
# A backend older than the tier label counted the shared tier only.
UNLABELLED_TIER = "storage"
KVTIER_UNREACHED = ("kvtier's backend metrics are not on this page: in GPU-direct mode they "
                    "live in vLLM's worker processes and reach /metrics through "
                    "PROMETHEUS_MULTIPROC_DIR, which kvtier renders for this mode (a pod "
                    "injected by an older kvtier lacks it: restart it; one that sets it "
                    "itself must point it at an empty directory)")
# The reasons kvtier's backend labels its dropped stores and skipped requests with
# (offload/kvtier_offload: store.py and object_store.py "queue-full" and
# "free-space-floor", write_admission.py's WriteAdmission.late "stale" and "backoff",
# vllm_spec.py "staging-full" and "partial-file"; recompute_bound.py LOOKUP_WAIT and
# LOAD_SLOWER). This reader may not import the backend: keep these in step with it
# (tests/operator/unit/test_observe_hostile_reasons.py checks). Any other label a pod
# sends is counted under OTHER_REASON, so a pod cannot grow the status or its messages.
DROP_REASONS = frozenset({"queue-full", "stale", "backoff", "free-space-floor",
                          "staging-full", "partial-file"})
SKIP_REASONS = frozenset({"lookup-wait", "load-slower"})
OTHER_REASON = "other"
CONFIG_INFO = "vllm:kv_offload_config_info"
TIERING_READ_TIME = "vllm:kv_offload_tiering_read_time"
TIERING_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
CPU_INFO_LABELS = ("cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes",
                   "cpu_kv_cache_size_tokens")
# Every family read below (the observer parses only these).
FAMILIES = frozenset({
    "vllm:prompt_tokens", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached_by_source",
    "vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits",
    "vllm:kv_offload_load_bytes", "vllm:kv_offload_store_bytes", "vllm:kv_offload_load_time",
    "vllm:request_prefill_time_seconds", "vllm:kv_cache_usage_perc",
    "vllm:kv_offload_cpu_cache_usage_perc", "vllm:kv_offload_config", TIERING_READ_TIME,
    TIERING_READ_BYTES,
    "kvtier_offload_bytes", "kvtier_offload_operations", "kvtier_offload_latency_seconds",
    "kvtier_offload_corrupt_files", "kvtier_offload_capacity_bytes", "kvtier_offload_used_bytes",
    "kvtier_offload_tier_skipped", "kvtier_offload_dropped_writes",
    "kvtier_offload_failed_writes",
})


def read(samples: Samples, offloaded: tuple[str, ...]) -> PodFigures:
    f = PodFigures()
    put(f, (PROMPT_TOKENS, ""), total(samples, "vllm:prompt_tokens_total"),
        "vllm:prompt_tokens is absent (is this vLLM's API server?)")
    put(f, (RECOMPUTED_TOKENS, ""), total(samples, "vllm:prompt_tokens_by_source_total",
                                          source="local_compute"),
        "vllm:prompt_tokens_by_source is absent (vLLM older than 0.12?)")
    _hits(f, samples, offloaded)
    first = offloaded[0] if offloaded else None
    if first is not None:
        for key, name in (((BYTES_LOADED, first), "vllm:kv_offload_load_bytes"),
                          ((BYTES_STORED, first), "vllm:kv_offload_store_bytes"),
                          ((LOAD_TIME, first), "vllm:kv_offload_load_time")):
            put(f, key, total(samples, f"{name}_total"),
                f"{name} is not on the page (vLLM creates it at the first transfer; "
                "none yet, or no offloading connector on this pod)")
    if first == "cpu":
        _promotions(f, samples, offloaded)
    put(f, (PREFILL_SECONDS, ""), total(samples, "vllm:request_prefill_time_seconds_sum"),
        "vllm:request_prefill_time_seconds is absent")
    put(f, (REQUESTS, ""), total(samples, "vllm:request_prefill_time_seconds_count"),
        "vllm:request_prefill_time_seconds is absent")
    _kvtier(f, samples, offloaded)
    _capacity(f, samples, offloaded)
    return f


def _hits(f: PodFigures, samples: Samples, offloaded: tuple[str, ...]) -> None:
    by_source = by_label(samples, "vllm:prompt_tokens_cached_by_source_total", "source")
    if by_source:
        for source, tokens in by_source.items():
            tier = SOURCE_TIER.get(source)
            if source == "disk":  # kvtier's tiers of files or objects
                disks = [t for t in offloaded if t in KVTIER_TIERS]
                if len(disks) > 1:  # together: status splits them by each one's loads
                    key = (SHARED_HIT_TOKENS, SHARED_TIERS_SEPARATOR.join(disks))
                    f.counters[key] = f.counters.get(key, 0.0) + tokens
                    continue
                tier = disks[0] if disks else OFFLOADED
            if tier is None:  # external_unspecified: the only offloaded tier, if one
                tier = offloaded[0] if len(offloaded) == 1 else OFFLOADED
            if tier != "gpu" and tier != OFFLOADED and tier not in offloaded:
                tier = OFFLOADED
            if tier == OFFLOADED and not tokens:
                continue
            f.counters[(HIT_TOKENS, tier)] = f.counters.get((HIT_TOKENS, tier), 0.0) + tokens
        for key in [k for k, v in f.counters.items() if not math.isfinite(v)]:
            del f.counters[key]
            f.missing[key] = "a NaN or infinite vllm:prompt_tokens_cached_by_source"
        return
    put(f, (HIT_TOKENS, "gpu"), total(samples, "vllm:prefix_cache_hits_total"),
        "vllm:prefix_cache_hits is absent (prefix caching off?)")
    external = total(samples, "vllm:external_prefix_cache_hits_total")
    if external is not None and offloaded:
        tier = offloaded[0] if len(offloaded) == 1 else OFFLOADED
        f.counters[(HIT_TOKENS, tier)] = external


def _promotions(f: PodFigures, samples: Samples, offloaded: tuple[str, ...]) -> None:
    """Each tier behind the CPU tier: the time vLLM spent promoting blocks from it (its
    loads, for the advice) and the bytes it promoted (the basis for splitting vLLM's
    "disk" hits where a tier's backend counts no bytes loaded: vLLM's own fs tier). vLLM
    creates the series at a tier's first promotion: until then (or where a value is not
    finite) the figure is absent, never a zero."""
    for family, figure in ((TIERING_READ_TIME, LOAD_TIME),
                           (TIERING_READ_BYTES, PROMOTED_BYTES)):
        per_tier: dict[str, float] = {}
        for labels, value in samples.get(f"{family}_total", ()):
            index, _, _ = labels.get("tier", "").partition(":")
            if index.isdigit() and 0 < int(index) < len(offloaded):
                tier = offloaded[int(index)]
                per_tier[tier] = per_tier.get(tier, 0.0) + value
        for tier, value in per_tier.items():
            if math.isfinite(value) and value >= 0:
                f.counters[(figure, tier)] = value


def _kvtier(f: PodFigures, samples: Samples, offloaded: tuple[str, ...]) -> None:
    tiers = [t for t in offloaded if t in KVTIER_TIERS]
    if not tiers:
        return
    if not any(name.startswith("kvtier_offload_") for name in samples):
        for tier in tiers:
            for key in ((FAILED_LOADS, tier), (LOAD_SECONDS, tier)):
                f.missing[key] = KVTIER_UNREACHED
        return
    labelled = _by_tier(samples)
    for tier in tiers:
        if tier not in labelled:
            # No series of kvtier's for this tier: another backend serves it (vLLM's own
            # fs tier under storage.backend vllm-fs exports none): no figures, no zeros.
            for key in ((FAILED_LOADS, tier), (LOAD_SECONDS, tier), (BYTES_LOADED, tier)):
                f.missing.setdefault(key, f"no kvtier_offload_* series for the {tier} tier "
                                     "(a backend other than kvtier's, such as vLLM's fs "
                                     "tier, exports none)")
            continue
        _kvtier_tier(f, labelled[tier], tier)


def _by_tier(samples: Samples) -> dict[str, dict[str, list[tuple[Labels, float]]]]:
    """kvtier's series by their tier label (one without it: the shared tier's)."""
    out: dict[str, dict[str, list[tuple[Labels, float]]]] = {}
    for name, series in samples.items():
        if not name.startswith("kvtier_offload_"):
            continue
        for labels, value in series:
            tier = labels.get("tier", UNLABELLED_TIER)
            out.setdefault(tier, {}).setdefault(name, []).append((labels, value))
    return out


def _kvtier_tier(f: PodFigures, samples: Samples, tier: str) -> None:
    loaded = total(samples, "kvtier_offload_bytes_total", direction="load")
    stored = total(samples, "kvtier_offload_bytes_total", direction="store")
    if loaded is not None:
        f.counters[(BYTES_LOADED, tier)] = loaded
    if stored is not None:
        f.counters[(BYTES_STORED, tier)] = stored
    outcomes = {labels.get("outcome", ""): v for labels, v in
                samples.get("kvtier_offload_operations_total", ()) if
                labels.get("direction") == "load"}
    # A block file refused on load (damaged, foreign, short) is counted by its reason in
    # kvtier_offload_corrupt_files, not as a load outcome: it is a failed load too.
    refused = sum(v for _, v in samples.get("kvtier_offload_corrupt_files_total", ()))
    failed = sum(v for k, v in outcomes.items() if k != "ok") + refused
    f.counters[(FAILED_LOADS, tier)] = failed
    f.counters[(LOADS, tier)] = outcomes.get("ok", 0.0) + failed
    # Stores dropped rather than written: absent until the first, like the skips below
    # (a backend that never dropped has no series; absent is no figure, not a zero).
    dropped = total(samples, "kvtier_offload_dropped_writes_total")
    if dropped is not None:
        stores = sum(v for labels, v in samples.get("kvtier_offload_operations_total", ())
                     if labels.get("direction") == "store")
        failed_writes = sum(v for _, v in samples.get("kvtier_offload_failed_writes_total", ()))
        if math.isfinite(stores + failed_writes):
            f.counters[(DROPPED_WRITES, tier)] = dropped
            f.counters[(STORES, tier)] = stores + failed_writes + dropped
            for reason, count in _known(by_label(
                    samples, "kvtier_offload_dropped_writes_total", "reason"),
                    DROP_REASONS).items():
                f.counters[(f"{DROPPED_WRITES}:{reason}", tier)] = count
    # The recompute bound's skips (GPU-direct mode): absent until the first, so absent is
    # no figure, not a zero (a backend without the bound never creates the series).
    skipped = by_label(samples, "kvtier_offload_tier_skipped_total", "reason")
    if skipped and all(math.isfinite(v) for v in skipped.values()):
        f.counters[(SKIPPED_REQUESTS, tier)] = sum(skipped.values())
        for reason, count in _known(skipped, SKIP_REASONS).items():
            f.counters[(f"{SKIPPED_REQUESTS}:{reason}", tier)] = count
    hist = buckets(samples, "kvtier_offload_latency_seconds", direction="load")
    if hist:
        f.histograms[(LOAD_SECONDS, tier)] = hist
    # A tier bounded inside the backend (the local disk) says how full it is.
    capacity = total(samples, "kvtier_offload_capacity_bytes")
    used = total(samples, "kvtier_offload_used_bytes")
    if capacity:
        f.gauges[(CAPACITY_BYTES, tier)] = capacity
        if used is not None:
            f.gauges[(USED_PERCENT, tier)] = 100.0 * used / capacity


def _known(by_reason: dict[str, float], known: frozenset[str]) -> dict[str, float]:
    """Counts by the backend's known reasons; every other label's under OTHER_REASON."""
    out: dict[str, float] = {}
    for reason, count in by_reason.items():
        key = reason if reason in known else OTHER_REASON
        out[key] = out.get(key, 0.0) + count
    return out


def _cpu_tier_info(samples: Samples) -> Labels | None:
    """The labels of the CPU tier's config-info series: the only series under
    CPUOffloadingSpec; under TieringOffloadingSpec one series per tier (label `tier`,
    "0:primary" for the CPU tier), where only the CPU tier's carries cpu_* values."""
    for labels, _ in samples.get(CONFIG_INFO, ()):
        if any(labels.get(name) for name in CPU_INFO_LABELS):
            return labels
    return None


def cpu_capacity(samples: Samples) -> tuple[int | None, int | None, int | None]:
    """(bytes, tokens, engine blocks) of the CPU tier from 0.33's config info; None each
    where absent (0.32, or a mode without vLLM's CPU tier)."""
    labels = _cpu_tier_info(samples)
    if labels is None:
        return None, None, None

    def number(name: str) -> int | None:
        """A positive, finite whole number; None for anything else a pod may say
        (negative, zero, inf, NaN, not a number): it sizes the router's LRU."""
        try:
            value = float(labels[name]) if labels.get(name) else None
        except ValueError:
            return None
        if value is None or not math.isfinite(value) or value < 1:
            return None
        return int(value)

    chunks, per_chunk = number("cpu_num_chunks"), number("cpu_blocks_per_chunk")
    blocks = chunks * per_chunk if chunks is not None and per_chunk is not None else None
    return number("cpu_kv_cache_size_bytes"), number("cpu_kv_cache_size_tokens"), blocks


def _capacity(f: PodFigures, samples: Samples, offloaded: tuple[str, ...]) -> None:
    gpu_used = total(samples, "vllm:kv_cache_usage_perc")
    if gpu_used is not None:
        f.gauges[(USED_PERCENT, "gpu")] = 100.0 * gpu_used
    if "cpu" not in offloaded:
        return
    used = total(samples, "vllm:kv_offload_cpu_cache_usage_perc")
    if used is not None:
        f.gauges[(USED_PERCENT, "cpu")] = 100.0 * used
    size, tokens, _ = cpu_capacity(samples)
    if size is not None:
        f.gauges[(CAPACITY_BYTES, "cpu")] = float(size)
    if tokens is not None:
        f.gauges[(CAPACITY_TOKENS, "cpu")] = float(tokens)
    if size is None and tokens is None:
        f.missing[(CAPACITY_BYTES, "cpu")] = (
            f"{CONFIG_INFO} with cpu_* labels is absent (vLLM 0.32 does not export the "
            "CPU tier's size; 0.33 does)")
