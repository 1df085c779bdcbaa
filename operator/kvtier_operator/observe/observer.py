"""The observation loop: on an interval, read the metrics of every selected, injected
pod of every valid TieredPrefixCache, off the reconcile path, into an in-memory
snapshot per cache that reconcile reads (`snapshot`).

Bounded: at most `concurrency` reads at once, each with its own deadline and body and
series caps, parsing in a thread of its own (not the default executor reconciles use).
A slow or hostile pod costs its own read only: reconciles never wait for the loop, and
the other pods' reads go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp

from kvtier_operator.engines.base import Adapter
from kvtier_operator.engines.figures import PodFigures
from kvtier_operator.observe.page import Page, from_prometheus, parse, prometheus_query_url
from kvtier_operator.observe.scrape import fetch
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


@dataclass(frozen=True)
class Target:
    """One pod to read for one cache."""

    pod: str  # name
    uid: str
    url: str | None  # None: no address yet (why in `problem`)
    problem: str | None = None


@dataclass(frozen=True)
class CacheTargets:
    namespace: str
    cache: str
    adapter: Adapter
    offloaded: tuple[str, ...]
    pods: tuple[Target, ...]


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


@dataclass
class Observer:
    settings: ObserveSettings
    clock: Callable[[], float] = time.monotonic
    _histories: dict[tuple[str, str], PodHistory] = field(default_factory=dict)
    _snapshots: dict[tuple[str, str], CacheObservation] = field(default_factory=dict)
    rounds: int = 0
    _parser: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="kvtier-observe-parse"))

    def snapshot(self, namespace: str, cache: str) -> CacheObservation | None:
        return self._snapshots.get((namespace, cache))

    async def _read(self, session: aiohttp.ClientSession, sem: asyncio.Semaphore,
                    target: Target, cache: CacheTargets) -> tuple[PodFigures | None, str | None]:
        families = cache.adapter.launcher.metric_families
        if self.settings.prometheus_url:
            return await self._read_prometheus(session, sem, target, cache, families)
        if target.url is None:
            return None, target.problem
        async with sem:
            text, problem = await fetch(session, target.url, self.settings.timeout,
                                        self.settings.max_bytes)
        if text is None:
            return None, problem
        # Its own thread, not the loop's default executor that reconciles run on: a
        # thousand pages queue here, never in front of a reconcile.
        page = await asyncio.get_running_loop().run_in_executor(
            self._parser, parse, text, self.settings.max_series,
            cache.adapter.launcher.metric_families or None)
        if page.problem is not None:
            return None, f"{target.url}: {page.problem}"
        return self._figures(page, target.url or "", cache)

    async def _read_prometheus(self, session: aiohttp.ClientSession, sem: asyncio.Semaphore,
                               target: Target, cache: CacheTargets, families: frozenset[str]
                               ) -> tuple[PodFigures | None, str | None]:
        assert self.settings.prometheus_url is not None
        url = prometheus_query_url(self.settings.prometheus_url, cache.namespace, target.pod,
                                   families)
        async with sem:
            text, problem = await fetch(session, url, self.settings.timeout,
                                        self.settings.max_bytes, accept="application/json")
        if text is None:
            return None, f"Prometheus: {problem}"
        page = await asyncio.get_running_loop().run_in_executor(
            self._parser, from_prometheus, text, self.settings.max_series)
        if page.problem is not None:
            return None, f"Prometheus, pod {target.pod}: {page.problem}"
        if not page.samples:
            return None, (f"Prometheus has no series of pod {target.pod} (is it scraped, "
                          "with namespace and pod labels?)")
        return self._figures(page, "Prometheus", cache)

    def _figures(self, page: Page, where: str, cache: CacheTargets
                 ) -> tuple[PodFigures | None, str | None]:
        figures = cache.adapter.launcher.read_metrics(page.samples, cache.offloaded)
        if figures is None:
            return None, None
        if page.non_finite:
            figures.missing.setdefault(("non_finite", ""), (
                f"{page.non_finite} NaN or infinite value(s) from {where}: the figures "
                "they are part of are left out"))
        return figures, None

    async def observe(self, caches: Iterable[CacheTargets], now_iso: str) -> None:
        """One round over every cache's pods."""
        caches = list(caches)
        sem = asyncio.Semaphore(max(1, self.settings.concurrency))
        connector = aiohttp.TCPConnector(limit=max(1, self.settings.concurrency),
                                         force_close=True)
        async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                         auto_decompress=True) as session:
            jobs = [(cache, target, asyncio.ensure_future(self._read(session, sem, target,
                                                                     cache)))
                    for cache in caches for target in cache.pods]
            if jobs:
                await asyncio.wait([job for _, _, job in jobs])
        at = self.clock()
        seen: set[tuple[str, str]] = set()
        by_cache: dict[tuple[str, str], CacheObservation] = {}
        for cache in caches:
            by_cache[(cache.namespace, cache.cache)] = CacheObservation(
                window=WindowSum(), pods_read=0, pods_unreadable=0, problems=[],
                observed_at=now_iso, reads=True, pods_selected=len(cache.pods))
        for cache, target, job in jobs:
            obs = by_cache[(cache.namespace, cache.cache)]
            key = (cache.namespace, f"{target.pod}/{target.uid}")
            seen.add(key)
            exc = job.exception()
            figures, problem = (None, f"reading failed: {exc!r}") if exc else job.result()
            if figures is None and problem is None:
                obs.reads = False
                continue
            if figures is None:
                obs.pods_unreadable += 1
                if len(obs.problems) < MAX_PROBLEMS:
                    obs.problems.append(f"pod {target.pod}: {problem}")
                continue
            obs.pods_read += 1
            history = self._histories.setdefault(key, PodHistory())
            history.add(at, figures, self.settings.window)
            obs.window.add(history, at)
        for gone in set(self._histories) - seen:
            del self._histories[gone]  # pods no longer selected
        self._snapshots = by_cache
        self.rounds += 1

    async def run(self, targets: Callable[[], list[CacheTargets]],
                  now_iso: Callable[[], str]) -> None:
        """Forever: a round, then wait out the interval (measured start to start)."""
        while True:
            started = self.clock()
            try:
                await self.observe(targets(), now_iso())
            except Exception:  # never stop observing for one bad round
                log.exception("observation round failed")
            await asyncio.sleep(max(0.0, self.settings.interval - (self.clock() - started)))
