"""What one pod's metrics page says about the tiers, engine-neutral: the figures an
engine's reader (engines/<engine>/metrics.py) takes from the page's samples.

A reader gets the page as `Samples` (sample name -> (labels, value) pairs, as
`prometheus_client.parser` yields them; the observe layer parses and bounds it) and
returns `PodFigures`: cumulative counters and histogram buckets per (figure, tier), the
gauges as read, and for every figure it expected and did not find, why. A figure that
is absent stays absent: never a zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

Labels = Mapping[str, str]
Samples = Mapping[str, list[tuple[Labels, float]]]

# Figure names (the key's first part; the second is the tier, "" for the whole pod).
PROMPT_TOKENS = "prompt_tokens"  # prompt tokens the engine was asked for
RECOMPUTED_TOKENS = "recomputed_tokens"  # prompt tokens computed (no tier had them)
HIT_TOKENS = "hit_tokens"  # prompt tokens served from the tier
BYTES_LOADED = "bytes_loaded"
BYTES_STORED = "bytes_stored"
FAILED_LOADS = "failed_loads"  # loads that failed and fell back to recompute
LOADS = "loads"  # load operations
LOAD_SECONDS = "load_seconds"  # a histogram: one load's latency
LOAD_TIME = "load_time_seconds"  # a counter: time spent loading from the tier
PREFILL_SECONDS = "prefill_seconds"  # a counter: time spent in prefill (computing)
REQUESTS = "requests"  # requests the engine prefilled
# Requests that recomputed (the rest of) their prefix rather than wait for or load the
# tier, which would have cost more than recompute (kvtier's recompute bound); the total,
# and by reason under f"{SKIPPED_REQUESTS}:{reason}".
SKIPPED_REQUESTS = "skipped_requests"
# Prompt tokens one engine counter gives for several tiers together (vLLM's source
# "disk": any of kvtier's file and object tiers); the key's tier names them, joined by
# SHARED_TIERS_SEPARATOR, and status splits the tokens among them by their bytes loaded.
SHARED_HIT_TOKENS = "shared_hit_tokens"
SHARED_TIERS_SEPARATOR = ","
# Bytes the engine itself says it promoted from a tier behind its CPU tier (vLLM's
# tiering read bytes): the split's basis where some tier's backend counts no bytes loaded.
PROMOTED_BYTES = "promoted_bytes"
# Blocks the backend dropped rather than write (its write queue over budget, writers
# backing off, the free-space floor) and the stores asked of the tier in all (written,
# already there, failed or dropped); by the backend's reason under
# f"{DROPPED_WRITES}:{reason}".
DROPPED_WRITES = "dropped_writes"
STORES = "stores"
# Gauges
CAPACITY_BYTES = "capacity_bytes"
CAPACITY_TOKENS = "capacity_tokens"
USED_PERCENT = "used_percent"

# The offloaded tiers together, where the engine does not say which one served.
OFFLOADED = "offloaded"

Key = tuple[str, str]  # (figure, tier)


@dataclass
class PodFigures:
    counters: dict[Key, float] = field(default_factory=dict)
    histograms: dict[Key, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    gauges: dict[Key, float] = field(default_factory=dict)
    missing: dict[Key, str] = field(default_factory=dict)  # expected, absent: why
    engine_version: str | None = None


MetricsReader = Callable[[Samples, tuple[str, ...]], PodFigures]
"""(samples, the spec's offloaded tiers in order: e.g. ("cpu", "storage")) -> figures."""


def total(samples: Samples, name: str, **match: str) -> float | None:
    """The sum of a sample's series whose labels match; None where there is none, or
    where one of them is NaN or infinite (never a partial sum)."""
    found = [v for labels, v in samples.get(name, ()) if
             all(labels.get(k) == want for k, want in match.items())]
    if not found or not all(math.isfinite(v) for v in found):
        return None
    return sum(found)


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Sums by one label's value (NaN where any summed value is not finite)."""
    out: dict[str, float] = {}
    for labels, v in samples.get(name, ()):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + v
    return out


# Distinct bucket bounds a histogram may have (engines export about 10-30): a page with
# more is left out, so a pod cannot make each round's window, history and status work
# grow with the bounds it invents.
MAX_BUCKETS = 64


def buckets(samples: Samples, name: str, **match: str) -> tuple[tuple[float, float], ...]:
    """A histogram's cumulative buckets (le, count), summed over the series that match;
    empty where a count is not finite or there are more than MAX_BUCKETS bounds."""
    out: dict[float, float] = {}
    for labels, v in samples.get(f"{name}_bucket", ()):
        if all(labels.get(k) == want for k, want in match.items()) and "le" in labels:
            try:
                le = float(labels["le"])
            except ValueError:
                continue
            out[le] = out.get(le, 0.0) + v
            if len(out) > MAX_BUCKETS:
                return ()
    if not all(math.isfinite(v) for v in out.values()):
        return ()
    return tuple(sorted(out.items()))


def put(figures: PodFigures, key: Key, value: float | None, why_absent: str) -> None:
    if value is None:
        figures.missing[key] = why_absent
    else:
        figures.counters[key] = value


def names(samples: Samples) -> Iterable[str]:
    return samples.keys()
