"""Hostile metrics endpoints (#32): a 1 GB body, a slow drip, malformed text, a million
series, NaN and infinities, a closed port. One observation round against all of them at
once ends within the per-pod deadline, keeps the event loop (where kopf's handlers and
the webhook run) responsive, reads the good pod, and names each bad one's problem."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from aiohttp import web

from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe.observer import CacheTargets, Observer, ObserveSettings, Target
from kvtier_operator.observe.reads import STARVED
from kvtier_operator.status import observed_tiers
from kvtier_operator.validation import parse_tpc
from tests.e2e.server import free_port
from tests.helpers import ROOT
from tests.operator.unit.test_reconcile import body

pytestmark = pytest.mark.slow  # a local HTTP server and a 1 s deadline
GOOD = (ROOT / "tests" / "fixtures" / "metrics" / "vllm-0.32-gpu-direct-b-loaded.txt").read_text()
TIMEOUT = 1.0


async def huge(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    chunk = b"# " + b"x" * (1 << 20) + b"\n"
    for _ in range(1024):  # 1 GB, if anyone read it all
        await resp.write(chunk)
    return resp


async def drip(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(10_000):
        await resp.write(b"#")
        await asyncio.sleep(0.1)
    return resp


async def series(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    for block in range(1000):  # 1e6 series
        await resp.write("".join(f'vllm:x{{i="{block * 1000 + i}"}} 1\n'
                                 for i in range(1000)).encode())
    return resp


def handler(text: str):
    async def serve(request: web.Request) -> web.Response:
        return web.Response(text=text)
    return serve


NAN = GOOD.replace('source="external_unspecified"} 192.0', 'source="external_unspecified"} NaN')


async def test_hostile_endpoints_cost_only_their_own_read(monkeypatch):
    # The reading process runs SCHED_IDLE in the operator (observation yields to
    # admissions); here it runs at the test's priority, so that what is timed is the
    # reads' bounds, not how the scheduler shares a busy CI runner with an idle-policy
    # process (test_worker_priority.py tests the priority).
    from kvtier_operator.observe import reading_process

    monkeypatch.setattr(reading_process, "NICENESS", 0)
    app = web.Application()
    app.router.add_get("/good", handler(GOOD))
    app.router.add_get("/nan", handler(NAN))
    app.router.add_get("/malformed", handler("vllm:prompt_tokens_total{{{ 7 7 7\n\x00"))
    app.router.add_get("/huge", huge)
    app.router.add_get("/drip", drip)
    app.router.add_get("/series", series)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    base = f"http://127.0.0.1:{port}"
    names = ("good", "nan", "malformed", "huge", "drip", "series")
    targets = [Target(pod=n, uid=n, url=f"{base}/{n}") for n in names]
    targets.append(Target(pod="closed", uid="c", url=f"http://127.0.0.1:{free_port()}/metrics"))
    tpc = parse_tpc(body({"cpu": None}))
    cache = CacheTargets("ml", "cache", adapter_for(tpc.spec), ("storage",), tuple(targets))
    observer = Observer(ObserveSettings(timeout=TIMEOUT, concurrency=4),
                        reading=reading_process.ReadingProcess(idle=False))
    lag = 0.0

    async def ticker() -> None:
        # what a reconcile needs while the round runs: the loop, and a thread of the
        # loop's default executor (handlers run reconcile there)
        nonlocal lag
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.02)
            await asyncio.to_thread(time.sleep, 0)
            lag = max(lag, time.monotonic() - before - 0.02)

    await observer.reading.start()  # the operator starts it with the loop
    tick = asyncio.create_task(ticker())
    try:
        started = time.monotonic()
        await observer.observe([cache], "2026-11-27T00:00:00Z")
        took = time.monotonic() - started
    finally:
        tick.cancel()
        observer.reading.close()
        await runner.cleanup()
    # seven pods, four at a time, each bounded by the 1 s deadline
    assert took < 2 * TIMEOUT + 1.5, took
    assert lag < 0.5, f"the event loop stalled for {lag:.2f} s"
    obs = observer.snapshot("ml", "cache")
    assert obs is not None and obs.pods_read == 2 and obs.pods_unreadable == 5
    problems = "\n".join(obs.problems)
    # the drip's deadline is the pod's fault, unless the reading thread itself waited
    # for the CPU that long meanwhile (a loaded CI runner): then it is the operator's
    drip_why = STARVED if obs.pods_starved else f"within {TIMEOUT:g} s"
    for pod, why in (("huge", "byte cap"), ("drip", drip_why),
                     ("malformed", "not Prometheus text"), ("series", "byte cap"),
                     ("closed", "port closed")):
        assert f"pod {pod}:" in problems and why in problems.split(f"pod {pod}:")[1]
    assert obs.pods_starved <= 1
    status = observed_tiers(tpc, ("storage",), obs, None, enabled=True)
    assert status.metrics.status == "False" and status.metrics.reason == "MetricsUnreadable"
    assert f"{5 - obs.pods_starved} of 7 pod(s)" in status.metrics.message
    assert "NaN" in status.tiers[1].unobserved or any(
        "NaN" in why for why in obs.window.missing.values())


def prometheus_answer(page_text: str, query: str, pod: str) -> dict:
    """What a Prometheus that scraped the page (as pod `pod` in namespace ml) answers
    to an instant query of the observer's form: the series built from the real page."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    names = re.search(r'__name__=~"([^"]+)"', query).group(1)
    asked = re.search(r',pod="([^"]+)"', query).group(1)
    assert 'namespace="ml"' in query
    result = []
    for family in text_string_to_metric_families(page_text):
        for s in family.samples:
            if asked == pod and re.fullmatch(names, s.name):
                result.append({"metric": {"__name__": s.name, **s.labels, "namespace": "ml",
                                          "pod": pod}, "value": [0, repr(s.value)]})
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


async def test_a_prometheus_url_reads_the_same_figures_as_the_pods():
    pages = [(ROOT / "tests" / "fixtures" / "metrics" / f"vllm-0.32-gpu-direct-b-{n}.txt")
             .read_text() for n in ("idle", "loaded")]
    served = {"page": pages[0]}

    async def query(request: web.Request) -> web.Response:
        return web.json_response(prometheus_answer(served["page"], request.query["query"],
                                                   "server-b"))

    app = web.Application()
    app.router.add_get("/prom/api/v1/query", query)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tpc = parse_tpc(body({"cpu": None}))
    cache = CacheTargets("ml", "cache", adapter_for(tpc.spec), ("storage",), (
        Target("server-b", "b", None), Target("gone", "g", None)))
    observer = Observer(ObserveSettings(timeout=TIMEOUT,
                                        prometheus_url=f"http://127.0.0.1:{port}/prom"))
    try:
        await observer.observe([cache], "2026-11-27T00:00:00Z")
        served["page"] = pages[1]
        await observer.observe([cache], "2026-11-27T00:00:30Z")
    finally:
        observer.reading.close()
        await runner.cleanup()
    obs = observer.snapshot("ml", "cache")
    assert obs.pods_read == 1 and obs.pods_unreadable == 1
    assert "Prometheus has no series of pod gone" in obs.problems[0]
    status = observed_tiers(tpc, ("storage",), obs, None, enabled=True)
    assert status.tiers[1].hit_percent == 96.0 and status.recompute.percent == 4.0


async def _drip_server() -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/drip", drip)
    app.router.add_get("/good", handler(GOOD))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


async def test_a_reading_process_that_dies_mid_round_is_replaced():
    """The reads run in a process of their own; if it dies (killed for memory, a crash),
    the round's pods say so and the next round starts a new one."""
    runner, base = await _drip_server()
    tpc = parse_tpc(body({"cpu": None}))
    cache = CacheTargets("ml", "cache", adapter_for(tpc.spec), ("storage",), (
        Target("good", "g", f"{base}/good"), Target("drip", "d", f"{base}/drip")))
    observer = Observer(ObserveSettings(timeout=5.0))
    try:
        first = (await observer.reading.start(), observer.reading.pid)[1]
        assert first is not None and first != os.getpid()
        round_ = asyncio.create_task(observer.observe([cache], "2026-11-27T00:00:00Z"))
        await asyncio.sleep(1.0)  # the drip holds the round open
        os.kill(first, signal.SIGKILL)
        await asyncio.wait_for(round_, 10)
        obs = observer.snapshot("ml", "cache")
        assert obs.pods_read == 0 and obs.pods_unreadable == 2
        assert "reading process failed" in obs.problems[0] and "restarted" in obs.problems[0]
        cache = CacheTargets("ml", "cache", cache.adapter, ("storage",), cache.pods[:1])
        await observer.observe([cache], "2026-11-27T00:00:30Z")
        assert observer.reading.pid not in (None, first)
        assert observer.snapshot("ml", "cache").pods_read == 1
    finally:
        observer.reading.close()
        await runner.cleanup()


async def test_a_round_past_its_deadline_kills_the_reading_process(monkeypatch):
    """The round as a whole is bounded here, whatever happens inside the worker."""
    from kvtier_operator.observe import reading_process

    runner, base = await _drip_server()
    monkeypatch.setattr(reading_process, "round_deadline", lambda jobs, settings: 1.0)
    tpc = parse_tpc(body({"cpu": None}))
    cache = CacheTargets("ml", "cache", adapter_for(tpc.spec), ("storage",), (
        Target("drip", "d", f"{base}/drip"),))
    observer = Observer(ObserveSettings(timeout=30.0))
    try:
        await observer.reading.start()
        pid = observer.reading.pid
        started = time.monotonic()
        await observer.observe([cache], "2026-11-27T00:00:00Z")
        assert time.monotonic() - started < 5
        obs = observer.snapshot("ml", "cache")
        assert obs.pods_unreadable == 1 and "within 1 s" in obs.problems[0]
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not _alive(pid)
    finally:
        observer.reading.close()
        await runner.cleanup()


READING_PARENT = """
import asyncio, os, sys
from kvtier_operator.observe.reading_process import ReadingProcess
reading = ReadingProcess()
asyncio.run(reading.start())
print(reading.pid, flush=True)
sys.stdin.read()  # until killed
"""
ADMISSION_PARENT = """
import os, sys
from kvtier_operator.admission_lanes import spawn_pool
pool = spawn_pool(1)
print(pool.submit(os.getpid).result(60), flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("parent_code", [READING_PARENT, ADMISSION_PARENT],
                         ids=["reading-process", "admission-lane"])
def test_worker_processes_end_when_the_operator_is_killed(parent_code):
    """An operator killed without closing its worker pools (OOM, SIGKILL) leaves no
    worker behind: the observation's reading process and the admission lanes' workers
    see their parent gone and exit (worker_process.init_worker)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    worker = None
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "a worker process outlived the operator"
    finally:
        parent.kill()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


async def test_pages_past_the_rounds_parse_time_cost_their_own_figures_only():
    """Pages that are slow to parse must not make the round miss its deadline (which
    throws every cache's results away): past its share of the deadline the reading
    process parses no more pages, and those pods say why (reads.LATE)."""
    from kvtier_operator.observe.reads import LATE, ReadJob, ReadSettings, read_all

    app = web.Application()
    app.router.add_get("/good", handler(GOOD))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tpc = parse_tpc(body({"cpu": None}))
    launcher = adapter_for(tpc.spec).launcher
    jobs = [ReadJob("ml", f"p{i}", f"http://127.0.0.1:{port}/good", None, launcher,
                    ("storage",)) for i in range(3)]
    settings = ReadSettings(timeout=TIMEOUT, max_bytes=4 << 20, max_series=20_000,
                            concurrency=2)
    try:
        in_time = await read_all(jobs, settings)
        late = await read_all(jobs, settings, seconds=0.0)
    finally:
        await runner.cleanup()
    assert all(r.figures is not None for r in in_time)
    assert [r.problem for r in late] == [LATE] * 3


def test_a_histogram_with_invented_bucket_bounds_is_left_out():
    """A pod's page may invent any number of `le` bounds (up to the series cap); each
    would be carried through the window, the history and the status every round on the
    operator's loop. More than MAX_BUCKETS bounds: the histogram is left out."""
    from kvtier_operator.engines.figures import MAX_BUCKETS, buckets

    def page(bounds: int):
        return {"h_bucket": [({"le": str(float(i))}, float(i)) for i in range(bounds)]}

    assert len(buckets(page(MAX_BUCKETS), "h")) == MAX_BUCKETS
    assert buckets(page(MAX_BUCKETS + 1), "h") == ()
