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

LATE = ("not read this round: the round's parse time ran out (other pods' pages slow to "
        "parse, or the operator short of CPU); read again next round")
STARVED = ("not read in time: the operator's reading process itself waited for the CPU "
           "this round (it runs after the webhook and the handlers); read again next round")
# A read that ran out of time while the reading loop's thread waited for a CPU (runnable,
# not running: under SCHED_IDLE, while the operator's other work had it) for at least a
# fifth of the time it was given, and at least STARVED_MIN_SECONDS, is STARVED, not the
# pod's fault. (A round whose parse time ran out is LATE, which names both causes: the
# parse runs on another thread.)
STARVED_SHARE = 0.2
STARVED_MIN_SECONDS = 0.5
SCHEDSTAT = "/proc/thread-self/schedstat"


def cpu_wait_seconds() -> float | None:
    """How long this thread has waited for a CPU so far (the kernel's run_delay: time
    runnable but not running; not time spent blocked, on I/O or on the GIL), or None
    where the kernel does not say (no schedstats, a sandbox)."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            return int(f.read(256).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _waited(since: float | None, span: float) -> bool:
    """Whether this thread waited for a CPU, since `since` (cpu_wait_seconds), for a
    fifth of `span` seconds or more (and STARVED_MIN_SECONDS)."""
    now = cpu_wait_seconds()
    return since is not None and now is not None and \
        now - since >= max(STARVED_MIN_SECONDS, STARVED_SHARE * span)


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


def _missed(problem: str, since: float | None, timeout: float) -> str:
    """A failed fetch's reason; STARVED where it ran out of time while this thread
    waited for the CPU."""
    return STARVED if DEADLINE_MISSED in problem and _waited(since, timeout) else problem


async def _read(session: aiohttp.ClientSession, sem: asyncio.Semaphore,
                parser: ThreadPoolExecutor, job: ReadJob, s: ReadSettings,
                stop_at: float) -> ReadResult:
    loop = asyncio.get_running_loop()
    families = job.launcher.metric_families
    if s.prometheus_url:
        url = prometheus_query_url(s.prometheus_url, job.namespace, job.pod, families)
        async with sem:  # held through the parse: fetched pages never pile up
            since = cpu_wait_seconds()
            text, problem = await fetch(session, url, s.timeout, s.max_bytes,
                                        accept="application/json")
            if text is None:
                problem = _missed(problem or "", since, s.timeout)
                return ReadResult(problem=problem if problem == STARVED
                                  else f"Prometheus: {problem}")
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
        since = cpu_wait_seconds()
        text, problem = await fetch(session, job.url, s.timeout, s.max_bytes)
        if text is None:
            return ReadResult(problem=_missed(problem or "", since, s.timeout))
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
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-observe-parse") as parser:
        async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                         auto_decompress=True) as session:
            done = await asyncio.gather(*(_read(session, sem, parser, job, settings,
                                                stop_at) for job in jobs),
                                        return_exceptions=True)
    return [r if isinstance(r, ReadResult) else ReadResult(problem=f"reading failed: {r!r}")
            for r in done]


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
