"""Counters over a window: each pod's increments between consecutive reads, kept for
`window` seconds and summed over a cache's pods.

A figure is only ever an increase both reads saw, so no figure can be wrong:
- A pod's first read is its baseline and yields no increment. So is a read after the pod
  was unreadable for longer than the window (one step would carry the whole gap).
- A pod any of whose counters (or histogram buckets) went backwards restarted: every
  counter takes that read as its baseline (none of its counters' old values is an
  increase; a counter that grew past its old value did not grow by the difference).
- A series absent from the previous read that an earlier read of the same process had
  (it vanished, or the reader left out a NaN, negative or infinite value) is a new
  baseline: no increase this step. One no read of the process had before was created
  since the previous read (engines create counters at their first event: vLLM's
  kv_offload_*, kvtier's dropped writes, SGLang's token counters) and counts from zero.
- A share (hits of prompt tokens, drops of stores) is taken over the steps of each pod
  that have both its parts, so part and whole cover the same span.
- A sum over the pods that is not finite is missing, with why, never a zero.
Gauges are the latest read's.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvtier_operator.engines.figures import Key, PodFigures

Buckets = tuple[tuple[float, float], ...]

PARTIAL = ("not on two reads in a row over the window (the series vanished, or a NaN or "
           "negative value was left out): no increase to count yet")
OVERFLOW = "the pods' sum over the window is not a finite number"


@dataclass
class Step:
    """A pod's increments between two reads: from `start` (the earlier read) to `end`."""

    start: float
    end: float
    counters: dict[Key, float]
    histograms: dict[Key, dict[float, float]]
    unpaired: frozenset[Key]  # seen before, on one of the two reads only: no increment


def _counters(figures: PodFigures) -> dict[Key, float]:
    """The counters that can be counters: finite and not negative."""
    return {k: v for k, v in figures.counters.items() if math.isfinite(v) and v >= 0}


def _went_back(now: PodFigures, before: PodFigures) -> bool:
    """Whether any counter or bucket both reads have is lower now: a restart."""
    old = _counters(before)
    if any(v < old[k] for k, v in _counters(now).items() if k in old):
        return True
    for key, now_buckets in now.histograms.items():
        earlier = dict(before.histograms.get(key, ()))
        if any(le in earlier and count < earlier[le] for le, count in now_buckets):
            return True
    return False


@dataclass
class PodHistory:
    last: PodFigures | None = None
    steps: deque[Step] = field(default_factory=deque)
    last_read: float | None = None
    restarts: int = 0
    seen: set[Key] = field(default_factory=set)  # series this process's reads have had

    def add(self, at: float, figures: PodFigures, window: float) -> None:
        last, last_read = self.last, self.last_read
        self.last, self.last_read = figures, at
        new = _counters(figures)
        if last is None or last_read is None or at - last_read > window or \
                _went_back(figures, last):
            if last is not None and last_read is not None and at - last_read <= window:
                self.restarts += 1
            self.steps.clear()  # a (new) baseline
            self.seen = set(new) | set(figures.histograms)
            return
        old = _counters(last)
        counters = {k: v - old.get(k, 0.0) for k, v in new.items()
                    if k in old or k not in self.seen}
        hists: dict[Key, dict[float, float]] = {}
        for key, now_buckets in figures.histograms.items():
            if key in last.histograms:
                earlier = dict(last.histograms[key])
                hists[key] = {le: count - earlier[le] for le, count in now_buckets
                              if le in earlier}
            elif key not in self.seen:
                hists[key] = dict(now_buckets)
        unpaired = frozenset((old.keys() ^ new.keys()) & self.seen) | \
            frozenset((last.histograms.keys() ^ figures.histograms.keys()) & self.seen)
        self.seen |= set(new) | set(figures.histograms)
        self.steps.append(Step(last_read, at, counters, hists, unpaired))
        while self.steps and self.steps[0].start < at - window:
            self.steps.popleft()

    def has_steps(self) -> bool:
        return bool(self.steps)

    def sums(self) -> tuple[dict[Key, float], dict[Key, dict[float, float]], set[Key]]:
        """The pod's increments over its window (each figure over the steps that have
        it), and the figures some step had on one of its reads only."""
        counters: dict[Key, float] = {}
        hists: dict[Key, dict[float, float]] = {}
        for step in self.steps:
            for key, inc in step.counters.items():
                counters[key] = counters.get(key, 0.0) + inc
            for key, per_bucket in step.histograms.items():
                target = hists.setdefault(key, {})
                for le, inc in per_bucket.items():
                    target[le] = target.get(le, 0.0) + inc
        return counters, hists, set().union(*(s.unpaired for s in self.steps))


@dataclass
class PodSums:
    """One pod's increments over its window, and each step's: a share is taken over
    the steps that have both its parts, so both cover the same span."""

    counters: dict[Key, float]
    steps: list[dict[Key, float]]


@dataclass
class WindowSum:
    """A cache's pods' increments over the window, and their latest gauges.

    `pods` holds each pod's own sums and steps, so a share can be taken over the steps
    that have both its parts; empty, `counters` are one pod's."""

    counters: dict[Key, float] = field(default_factory=dict)
    histograms: dict[Key, dict[float, float]] = field(default_factory=dict)
    gauges: dict[Key, list[float]] = field(default_factory=dict)
    missing: dict[Key, str] = field(default_factory=dict)
    span: float = 0.0  # seconds the increments cover (the longest pod's)
    pods_with_steps: int = 0
    resets: int = 0
    pods: list[PodSums] = field(default_factory=list)
    _overflowed: set[Key] = field(default_factory=set)

    def add(self, history: PodHistory, now: float) -> None:
        if history.last is None:
            return
        for key, value in history.last.gauges.items():
            self.gauges.setdefault(key, []).append(value)
        for key, why in history.last.missing.items():
            self.missing.setdefault(key, why)
        self.resets += history.restarts
        if not history.steps:
            return
        self.pods_with_steps += 1
        self.span = max(self.span, now - history.steps[0].start)
        counters, hists, partial = history.sums()
        for key in partial:
            self.missing.setdefault(key, PARTIAL)
        self.pods.append(PodSums(counters, [step.counters for step in history.steps]))
        for key, inc in counters.items():
            self._sum(key, inc)
        for key, per_bucket in hists.items():
            if key in self._overflowed:
                continue
            target = self.histograms.setdefault(key, {})
            for le, inc in per_bucket.items():
                target[le] = target.get(le, 0.0) + inc
            if not all(math.isfinite(v) for v in target.values()):
                self._overflowed.add(key)
                del self.histograms[key]
                self.missing[key] = OVERFLOW

    def _sum(self, key: Key, inc: float) -> None:
        if key in self._overflowed:
            return
        total = self.counters.get(key, 0.0) + inc
        if math.isfinite(total):
            self.counters[key] = total
            return
        self._overflowed.add(key)
        self.counters.pop(key, None)
        self.missing[key] = OVERFLOW

    def per_pod(self) -> list[PodSums]:
        """Each pod's sums (without them, the counters as one pod's)."""
        if self.pods or not self.pods_with_steps:
            return self.pods
        return [PodSums(self.counters, [self.counters])]

    def buckets(self, key: Key) -> Buckets:
        return tuple(sorted(self.histograms.get(key, {}).items()))


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's histogram_quantile over cumulative buckets: linear within the bucket
    that holds the q-th observation; the highest finite bound where it is +Inf's; None
    without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le
