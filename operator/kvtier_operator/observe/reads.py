"""One observation round's reads: fetch each pod's page (or its series from Prometheus),
parse it and turn it into the engine's figures, bounded.

This is the CPU-bound half of observing (HTTP, prometheus_client's parser, the engines'
readers). The operator runs it in a process of its own (reading_process.py), so that
what comes back to its event loop, where kopf's handlers and the admission webhook run,
is one small `ReadResult` per pod, packed on its own. `read_round` is that process's entry
point; `read_all` the same reads on the caller's loop.

Bounded: at most `concurrency` reads at once, each with its own deadline and body and
series caps; pages are parsed on a thread of their own, so a large page never holds up
the other pods' reads (their deadlines keep running while they wait for the loop).
"""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp

from kvtier_operator.engines.base import Launcher
from kvtier_operator.engines.figures import PodFigures
from kvtier_operator.observe.page import Page, from_prometheus, parse, prometheus_query_url
from kvtier_operator.observe.scrape import DEADLINE_MISSED, fetch

LATE = ("not read this round: the round's time was spent on other pods' pages (slow to "
        "parse); read again next round")
STARVED = ("not read in time: the operator's reading process itself waited for the CPU "
           "this round (it runs after the webhook and the handlers); read again next round")
# The reading process's loop running this late (a share of the per-pod timeout, and at
# least STARVED_MIN_SECONDS: a busy node's ordinary scheduling delays are shorter) means it
# waited for the CPU: its reads that ran out of time, or of the round's parse time, are
# then STARVED, not the pods' fault.
STARVED_SHARE = 0.2
STARVED_MIN_SECONDS = 0.5
TICK_SECONDS = 0.05


@dataclass(frozen=True)
class ReadSettings:
    """The bounds of one pod's read (ObserveSettings' part that the reads need)."""

    timeout: float  # per pod, the whole exchange
    max_bytes: int
    max_series: int
    concurrency: int
    prometheus_url: str | None = None


@dataclass(frozen=True)
class ReadJob:
    """One pod of one cache to read: its URL (None: no address, why in `problem`), the
    engine's launcher (its reader; pickled by reference) and the cache's offloaded tiers."""

    namespace: str
    pod: str
    url: str | None
    problem: str | None
    launcher: Launcher
    offloaded: tuple[str, ...]


@dataclass(frozen=True)
class ReadResult:
    """figures, or why none: a problem; both None: the engine exports nothing kvtier
    reads."""

    figures: PodFigures | None = None
    problem: str | None = None


def _figures(page: Page, where: str, job: ReadJob) -> ReadResult:
    figures = job.launcher.read_metrics(page.samples, job.offloaded)
    if figures is None:
        return ReadResult()
    if page.non_finite:
        figures.missing.setdefault(("non_finite", ""), (
            f"{page.non_finite} NaN or infinite value(s) from {where}: the figures "
            "they are part of are left out"))
    return ReadResult(figures)


async def _read(session: aiohttp.ClientSession, sem: asyncio.Semaphore,
                parser: ThreadPoolExecutor, job: ReadJob, s: ReadSettings,
                stop_at: float) -> ReadResult:
    loop = asyncio.get_running_loop()
    families = job.launcher.metric_families
    if s.prometheus_url:
        url = prometheus_query_url(s.prometheus_url, job.namespace, job.pod, families)
        async with sem:  # held through the parse: fetched pages never pile up
            text, problem = await fetch(session, url, s.timeout, s.max_bytes,
                                        accept="application/json")
            if text is None:
                return ReadResult(problem=f"Prometheus: {problem}")
            if loop.time() > stop_at:
                return ReadResult(problem=LATE)
            page = await loop.run_in_executor(parser, from_prometheus, text, s.max_series)
        if page.problem is not None:
            return ReadResult(problem=f"Prometheus, pod {job.pod}: {page.problem}")
        if not page.samples:
            return ReadResult(problem=f"Prometheus has no series of pod {job.pod} (is it "
                                      "scraped, with namespace and pod labels?)")
        return _figures(page, "Prometheus", job)
    if job.url is None:
        return ReadResult(problem=job.problem)
    async with sem:  # held through the parse: fetched pages never pile up
        text, problem = await fetch(session, job.url, s.timeout, s.max_bytes)
        if text is None:
            return ReadResult(problem=problem)
        if loop.time() > stop_at:
            return ReadResult(problem=LATE)
        page = await loop.run_in_executor(parser, parse, text, s.max_series, families or None)
    if page.problem is not None:
        return ReadResult(problem=f"{job.url}: {page.problem}")
    return _figures(page, job.url, job)


async def read_all(jobs: Sequence[ReadJob], settings: ReadSettings,
                   seconds: float = math.inf) -> list[ReadResult]:
    """Every job's result, in order; an unexpected error is that pod's problem. No page
    is parsed once `seconds` have passed (LATE): pages that are slow to parse cost their
    own pods' figures, never the round's (whose deadline would otherwise cancel it)."""
    stop_at = asyncio.get_running_loop().time() + seconds
    sem = asyncio.Semaphore(max(1, settings.concurrency))
    connector = aiohttp.TCPConnector(limit=max(1, settings.concurrency), force_close=True)
    lateness = Lateness()
    watch = asyncio.create_task(lateness.watch())
    try:
        with ThreadPoolExecutor(max_workers=1,
                                thread_name_prefix="kvtier-observe-parse") as parser:
            async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                             auto_decompress=True) as session:
                done = await asyncio.gather(*(_read(session, sem, parser, job, settings,
                                                    stop_at) for job in jobs),
                                            return_exceptions=True)
    finally:
        watch.cancel()
    starved = lateness.worst >= max(STARVED_MIN_SECONDS, STARVED_SHARE * settings.timeout)
    return [_starved(r, starved) if isinstance(r, ReadResult)
            else ReadResult(problem=f"reading failed: {r!r}") for r in done]


class Lateness:
    """How late this process's event loop ran a tick at worst: the time it waited for
    the CPU (under SCHED_IDLE, while the operator's other work had it)."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(TICK_SECONDS)
            self.worst = max(self.worst, loop.time() - start - TICK_SECONDS)


def _starved(result: ReadResult, starved: bool) -> ReadResult:
    """A read that ran out of time (its own deadline, or the round's parse time) in a
    round where this process waited for the CPU: STARVED, not the pod's fault."""
    if starved and result.problem is not None and (
            result.problem == LATE or DEADLINE_MISSED in result.problem):
        return ReadResult(problem=STARVED)
    return result


def read_round(jobs: Sequence[ReadJob], settings: ReadSettings,
               seconds: float = math.inf) -> list[bytes]:
    """read_all on a loop of its own, each result packed on its own: the reading
    process's entry point. The operator unpacks them one by one between turns of its
    event loop (`unpack`); one pickle of the whole round would be unpacked in one go,
    holding the GIL for tens of milliseconds (more on a busy node) while admissions wait."""
    return [pack(result) for result in asyncio.run(read_all(jobs, settings, seconds))]


def pack(result: ReadResult) -> bytes:
    return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(packed: bytes) -> ReadResult:
    """A result the operator's own reading process packed (never bytes from a pod)."""
    result = pickle.loads(packed)  # our worker's output, never a pod's bytes
    if not isinstance(result, ReadResult):
        raise TypeError(f"the reading process sent a {type(result).__name__}")
    return result
