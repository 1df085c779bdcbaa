"""The observation loop: on an interval, read the metrics of every selected, injected
pod of every valid TieredPrefixCache, off the reconcile path, into an in-memory
snapshot per cache that reconcile reads (`snapshot`).

The reads themselves (HTTP, parsing, the engines' readers: reads.py) run in a process of
their own (reading_process.py), bounded there: at most `concurrency` reads at once, each
with its own deadline and body and series caps, and the round as a whole with a deadline.
Only each pod's small figures come back to this loop, where kopf's handlers and the
admission webhook run, each packed on its own; unpacking and folding them into the
window yields to the loop every FOLD_BATCH pods or FOLD_SECONDS. A
slow or hostile pod costs its own read only: reconciles never wait for the loop, and the
other pods' reads go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvtier_operator.engines.base import Adapter
from kvtier_operator.engines.figures import CAPACITY_BYTES, CAPACITY_TOKENS, PodFigures
from kvtier_operator.observe.reading_process import ReadingProcess
from kvtier_operator.observe.reads import LATE, STARVED, ReadJob, ReadSettings, unpack
from kvtier_operator.observe.window import PodHistory, WindowSum

log = logging.getLogger("kvtier_operator.observe")
MAX_PROBLEMS = 10


@dataclass(frozen=True)
class ObserveSettings:
    interval: float = 30.0  # seconds between rounds; 0: observation off
    timeout: float = 5.0  # per pod, the whole exchange
    max_bytes: int = 4 * 1024 * 1024
    max_series: int = 20000
    concurrency: int = 16
    window: float = 300.0  # seconds of increments the status sums
    # Read the same series from this Prometheus (its HTTP API) instead of the pods; the
    # series must carry the pod's `namespace` and `pod` labels (kubernetes_sd relabelling).
    prometheus_url: str | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @property
    def reads(self) -> ReadSettings:
        return ReadSettings(timeout=self.timeout, max_bytes=self.max_bytes,
                            max_series=self.max_series, concurrency=self.concurrency,
                            prometheus_url=self.prometheus_url)


@dataclass(frozen=True)
class Target:
    """One pod to read for one cache."""

    pod: str  # name
    uid: str
    url: str | None  # None: no address yet (why in `problem`)
    problem: str | None = None
    # Whether the pod carries the cache's current config: a pod on an older one reports
    # that config's capacities, which must not size anything now (on_config).
    current_config: bool = True


@dataclass(frozen=True)
class CacheTargets:
    namespace: str
    cache: str
    adapter: Adapter
    offloaded: tuple[str, ...]
    pods: tuple[Target, ...]


def on_config(figures: PodFigures, current: bool) -> PodFigures:
    """A pod's figures, less its capacities where it runs an older config than the
    cache's current one (they size the router's LRU: only the current config's may)."""
    if current:
        return figures
    return replace(figures, gauges={key: v for key, v in figures.gauges.items()
                                    if key[0] not in (CAPACITY_BYTES, CAPACITY_TOKENS)})


@dataclass
class CacheObservation:
    """What the latest round found for one cache."""

    window: WindowSum
    pods_read: int
    pods_unreadable: int
    problems: list[str]
    observed_at: str  # RFC 3339
    reads: bool  # False: the engine exports nothing kvtier reads
    pods_selected: int = 0
    # Of pods_unreadable: pods not read because the round's parse time ran out (LATE),
    # the operator's budget, not the pod's fault.
    pods_late: int = 0
    # Of pods_unreadable: pods whose reads ran out of time while the reading process
    # itself waited for the CPU (STARVED), the operator's CPU, not the pod's fault.
    pods_starved: int = 0


# Pods folded into the window between two yields to the event loop, or less where
# folding has taken FOLD_SECONDS.
FOLD_BATCH = 25
FOLD_SECONDS = 0.005


@dataclass
class Observer:
    settings: ObserveSettings
    clock: Callable[[], float] = time.monotonic
    _histories: dict[tuple[str, str], PodHistory] = field(default_factory=dict)
    _snapshots: dict[tuple[str, str], CacheObservation] = field(default_factory=dict)
    rounds: int = 0
    reading: ReadingProcess = field(default_factory=ReadingProcess)

    def snapshot(self, namespace: str, cache: str) -> CacheObservation | None:
        return self._snapshots.get((namespace, cache))

    async def observe(self, caches: Iterable[CacheTargets], now_iso: str) -> None:
        """One round over every cache's pods."""
        caches = list(caches)
        pairs = [(cache, target) for cache in caches for target in cache.pods]
        results = await self.reading.read(
            [ReadJob(cache.namespace, target.pod, target.url, target.problem,
                     cache.adapter.launcher, cache.offloaded) for cache, target in pairs],
            self.settings.reads)
        at = self.clock()
        seen: set[tuple[str, str]] = set()
        by_cache: dict[tuple[str, str], CacheObservation] = {}
        for cache in caches:
            by_cache[(cache.namespace, cache.cache)] = CacheObservation(
                window=WindowSum(), pods_read=0, pods_unreadable=0, problems=[],
                observed_at=now_iso, reads=True, pods_selected=len(cache.pods))
        turn = time.monotonic()
        for n, ((cache, target), packed) in enumerate(zip(pairs, results, strict=True)):
            if n and (n % FOLD_BATCH == 0 or time.monotonic() - turn > FOLD_SECONDS):
                await asyncio.sleep(0)  # let admissions and handlers in
                turn = time.monotonic()
            result = unpack(packed)
            obs = by_cache[(cache.namespace, cache.cache)]
            key = (cache.namespace, f"{target.pod}/{target.uid}")
            seen.add(key)
            figures, problem = result.figures, result.problem
            if figures is None and problem is None:
                obs.reads = False
                continue
            if figures is None:
                obs.pods_unreadable += 1
                obs.pods_late += problem == LATE
                obs.pods_starved += problem == STARVED
                if len(obs.problems) < MAX_PROBLEMS:
                    obs.problems.append(f"pod {target.pod}: {problem}")
                continue
            obs.pods_read += 1
            history = self._histories.setdefault(key, PodHistory())
            history.add(at, on_config(figures, target.current_config), self.settings.window)
            obs.window.add(history, at)
        for gone in set(self._histories) - seen:
            del self._histories[gone]  # pods no longer selected
        self._snapshots = by_cache
        self.rounds += 1

    async def run(self, targets: Callable[[], list[CacheTargets]],
                  now_iso: Callable[[], str]) -> None:
        """Forever: a round, then wait out the interval (measured start to start)."""
        try:
            try:
                await self.reading.start()
            except Exception:  # the first round tries again
                log.exception("the observation's reading process did not start")
            while True:
                started = self.clock()
                try:
                    await self.observe(targets(), now_iso())
                except Exception:  # never stop observing for one bad round
                    log.exception("observation round failed")
                await asyncio.sleep(max(0.0, self.settings.interval -
                                        (self.clock() - started)))
        finally:
            self.reading.close()
