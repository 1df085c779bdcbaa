"""Counters over a window: each pod's increments since its previous read (a counter that
went backwards is a restarted process: its new value is the increment, as Prometheus's
increase() takes it), kept for `window` seconds and summed over a cache's pods.

A pod's first read is its baseline and yields no increment; a series that appears on a
later read started at zero since. Gauges are the latest read's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvtier_operator.engines.figures import Key, PodFigures

Buckets = tuple[tuple[float, float], ...]


def _increase(now: float, before: float | None) -> tuple[float, bool]:
    if before is None:
        return now, False
    if now < before:
        return now, True  # reset: the process restarted
    return now - before, False


@dataclass
class PodHistory:
    last: PodFigures | None = None
    steps: deque[tuple[float, dict[Key, float], dict[Key, dict[float, float]], bool]] = field(
        default_factory=deque)
    last_read: float | None = None

    def add(self, at: float, figures: PodFigures, window: float) -> None:
        if self.last is not None:
            counters: dict[Key, float] = {}
            reset = False
            for key, value in figures.counters.items():
                counters[key], went_back = _increase(value, self.last.counters.get(key))
                reset |= went_back
            hists: dict[Key, dict[float, float]] = {}
            for key, now_buckets in figures.histograms.items():
                before = dict(self.last.histograms.get(key, ()))
                inc: dict[float, float] = {}
                for le, count in now_buckets:
                    inc[le], went_back = _increase(count, before.get(le))
                    reset |= went_back
                hists[key] = inc
            self.steps.append((at, counters, hists, reset))
        self.last, self.last_read = figures, at
        while self.steps and self.steps[0][0] < at - window:
            self.steps.popleft()

    def has_steps(self) -> bool:
        return bool(self.steps)


@dataclass
class WindowSum:
    """A cache's pods' increments over the window, and their latest gauges."""

    counters: dict[Key, float] = field(default_factory=dict)
    histograms: dict[Key, dict[float, float]] = field(default_factory=dict)
    gauges: dict[Key, list[float]] = field(default_factory=dict)
    missing: dict[Key, str] = field(default_factory=dict)
    span: float = 0.0  # seconds the increments cover (the longest pod's)
    pods_with_steps: int = 0
    resets: int = 0

    def add(self, history: PodHistory, now: float) -> None:
        if history.last is None:
            return
        for key, value in history.last.gauges.items():
            self.gauges.setdefault(key, []).append(value)
        for key, why in history.last.missing.items():
            self.missing.setdefault(key, why)
        if not history.steps:
            return
        self.pods_with_steps += 1
        first = history.steps[0][0]
        self.span = max(self.span, now - first)
        for _, counters, hists, reset in history.steps:
            self.resets += reset
            for key, inc in counters.items():
                self.counters[key] = self.counters.get(key, 0.0) + inc
            for key, per_bucket in hists.items():
                target = self.histograms.setdefault(key, {})
                for le, inc in per_bucket.items():
                    target[le] = target.get(le, 0.0) + inc

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
