"""Observation at scale (#32): 1,000 pods across 50 TieredPrefixCaches, each serving a
page captured from a real vLLM 0.32 API server (tests/fixtures/metrics/, about 500
series), read by the operator's Observer with its default bounds.

The pages come from a server in another process, niced (its CPU is not ours). Figures: the
Observer's CPU seconds per round, and so its share of one core at the default 30 s
interval (the target: under 20%); the process's RSS (under 250 MiB); and one
reconcile's latency with the observation's snapshot against observation off (None),
same run, as a ratio.

Admission and reconcile latency with observation on vs off, as the operator runs them:
one process serves the admission webhook (HTTPS, its admission lanes), runs reconciles
one after another through a thread (as kopf's handlers do) and runs the Observer over the
same 1,000 pods (its reads in the Observer's reading process, as in the operator); a
client in another process keeps 20 admissions in flight (benchmarks/webhook.py's). Each
cycle has four arms, each measured from the start of its work to its end (a round's
reads and then its fold into the windows on the operator's loop, whole):
- off: nothing, for as long as a round takes;
- on: one observation round, the reading process under SCHED_IDLE (the product);
- niced: one round with the reading process niced only (+10), the control (as before);
- floor: no observation; a process at the reading process's priority burns CPU for as
  long as a round: what any CPU work at that priority costs the webhook here.
Per cycle: each arm's p50 and p99 over the cycle's off arm. Over the cycles: the
geometric mean of those ratios and its 95% interval (a bootstrap over the cycles).
"Not measurably worse": the interval's upper end at or under MATERIAL; "worse": its
lower end over it; neither shown where it straddles MATERIAL. "At 30 s": the
same with the on arm's samples weighted by the share of time a round is under way at
the default interval (the off arm's the rest), as the operator runs it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import resource
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe import reading_process
from kvtier_operator.observe.observer import (
    CacheObservation,
    CacheTargets,
    Observer,
    ObserveSettings,
    Target,
)
from kvtier_operator.observe.page import parse
from kvtier_operator.observe.window import PodHistory, WindowSum
from kvtier_operator.reconcile import reconcile
from kvtier_operator.validation import parse_tpc
from tests.e2e.observe_server import free_port
from tests.helpers import ROOT
from tests.operator.unit.test_reconcile import CTX, NOW, FakeGateway, body

CACHES, PODS_PER_CACHE, ROUNDS = 50, 20, 3
INTERVAL = ObserveSettings().interval
PAGE = ROOT / "tests" / "fixtures" / "metrics" / "vllm-0.32-gpu-direct-b-loaded.txt"
# The pods' pages: a server in another process under SCHED_IDLE, as it stands for other
# machines: on a shared 2-core machine it would otherwise take the webhook's CPU, which in
# a cluster it does not (niced only, it still made each of its wake-ups a wait for the
# webhook: the cost that SCHED_IDLE takes off the reading process).
SERVER = """
import os, sys
from aiohttp import web
os.nice(10)
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
page = open(sys.argv[1]).read()
async def serve(request):
    return web.Response(text=page)
app = web.Application()
app.router.add_get("/{tail:.*}", serve)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None)
"""


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def targets(port: int) -> list[CacheTargets]:
    tpc = parse_tpc(body({"cpu": None}))
    adapter = adapter_for(tpc.spec)
    return [CacheTargets("bench", f"cache-{c}", adapter, ("storage",), tuple(
        Target(f"pod-{c}-{p}", f"u-{c}-{p}", f"http://127.0.0.1:{port}/c{c}/p{p}/metrics")
        for p in range(PODS_PER_CACHE))) for c in range(CACHES)]


WINDOW_STEPS = int(ObserveSettings().window // INTERVAL)


def full_window(page: str, pods: int) -> CacheObservation:
    """A cache's observation as the status sums it at the defaults: each pod read
    WINDOW_STEPS + 1 times, INTERVAL apart, its counters and histogram buckets growing
    at every read (by different amounts per pod), all of it within the window."""
    launcher = adapter_for(parse_tpc(body({"cpu": None})).spec).launcher
    figures = launcher.read_metrics(parse(page, 20_000, launcher.metric_families).samples,
                                    ("storage",))
    assert figures is not None
    window, settings = WindowSum(), ObserveSettings()
    for p in range(pods):
        history = PodHistory()
        for k in range(WINDOW_STEPS + 1):
            grow = k * (1 + p)
            history.add(k * INTERVAL, replace(
                figures,
                counters={key: v + grow * 1000.0 for key, v in figures.counters.items()},
                histograms={key: tuple((le, n + grow * 10.0) for le, n in buckets)
                            for key, buckets in figures.histograms.items()}),
                settings.window)
        window.add(history, WINDOW_STEPS * INTERVAL)
    return CacheObservation(window=window, pods_read=pods, pods_unreadable=0, problems=[],
                            observed_at=NOW, reads=True, pods_selected=pods)


def reconcile_ms(doc: dict, observed: CacheObservation | None, n: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(n):
        reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=observed,
                  observing=observed is not None)
    return (time.perf_counter() - start) / n * 1000


CYCLES = 8
RECONCILE_PAUSE = 0.02  # seconds between two measured reconciles
# The largest on/off ratio (p50, p99) that counts as "not measurably worse": the upper
# end of its 95% interval over the cycles must be at or under it. Fixed before measuring.
MATERIAL = 1.10
BOOTSTRAP = 2000
# The arms, in flags[0] (the work the server is asked to start) and flags[2] (the work
# under way; OFF when none).
OFF, OBSERVING, NICED, BURNING = 0, 1, 2, 3
ARMS = {OFF: "off", OBSERVING: "on", NICED: "niced", BURNING: "floor"}


def burn(seconds: float) -> None:
    """The floor arm's work: CPU and nothing else (no reads, no pages, no results), for
    `seconds`."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for _ in range(10_000):
            x += 1


def serve_observing(port: int, certs: str, page_port: int, burn_seconds: float,
                    results: Any, ready: Any, flags: Any) -> None:
    """The operator's process, in small: the webhook; asked for one (flags[0]), one
    observation round (OBSERVING: the reading process under SCHED_IDLE; NICED: niced
    only) or `burn` in a process at the reading process's priority for burn_seconds
    (BURNING), flags[2] saying which is under way until it has ended; while flags[3] is
    1, reconciles run one after another through a thread as kopf's handlers run them,
    their latencies put on `results` when flags[3] drops."""
    from concurrent.futures import ProcessPoolExecutor

    import yaml

    from kvtier_operator.admission_lanes import AdmissionLanes
    from kvtier_operator.context import RenderContext
    from kvtier_operator.webhook import CacheRegistry, ConflictLog, make_app, serve, tls_context
    from kvtier_operator.worker_process import init_worker
    from tests.helpers import EXAMPLES

    burner = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=init_worker,
                                 initargs=(reading_process.NICENESS, reading_process.IDLE))
    burner.submit(burn, 0.0).result()

    async def working(observers: dict[int, Observer], caches: list[CacheTargets]) -> None:
        while True:
            arm = flags[0]
            if arm == OFF:
                await asyncio.sleep(0.01)
                continue
            flags[0] = OFF  # one at a time: the client asks for each
            flags[2] = arm
            if arm in observers:
                await observers[arm].observe(caches, NOW)
            else:
                await asyncio.wrap_future(burner.submit(burn, burn_seconds))
            flags[2] = OFF

    async def reconciling(observer: Observer) -> None:
        doc = body({"cpu": None})
        while True:
            if not flags[3]:
                await asyncio.sleep(0.02)
                continue
            # the same input on and off (the snapshot of a finished round): the ratio
            # is what observing does to a reconcile's latency, not the status's own cost
            snap = observer.snapshot("bench", "cache-0")
            latencies = []
            while flags[3]:
                start = time.perf_counter()
                await asyncio.to_thread(reconcile, doc, FakeGateway(), CTX, [], [], NOW,
                                        observed=snap, observing=True)
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(RECONCILE_PAUSE)
            results.put(latencies)

    async def run() -> None:
        registry = CacheRegistry()
        registry.observe("ADDED", yaml.safe_load((EXAMPLES / "native-kvtier.yaml").read_text()))
        lanes = AdmissionLanes()
        runner = await serve(make_app(registry, ConflictLog(), RenderContext(), lanes),
                             "127.0.0.1", port, tls_context(f"{certs}/tls.crt",
                                                            f"{certs}/tls.key"))
        await lanes.warm()
        loop = asyncio.get_running_loop()
        observer = Observer(ObserveSettings())
        niced = Observer(ObserveSettings(),
                         reading=reading_process.ReadingProcess(idle=False))
        caches = targets(page_port)
        for warm in (observer, niced):  # the workers started, a snapshot to reconcile
            await warm.observe(caches, NOW)
        tasks = [loop.create_task(working({OBSERVING: observer, NICED: niced}, caches)),
                 loop.create_task(reconciling(observer))]
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        ready.set()
        await stop.wait()
        for task in tasks:
            task.cancel()
        observer.reading.close()
        niced.reading.close()
        burner.shutdown(cancel_futures=True)
        lanes.close()
        del runner

    asyncio.run(run())


def weighted_percentile(groups: list[tuple[list[float], float]], q: float) -> float:
    """The q-th percentile of samples drawn from each group with its weight."""
    pairs = sorted((x, w / len(xs)) for xs, w in groups if xs for x in xs)
    total, seen = sum(w for _, w in pairs), 0.0
    for x, w in pairs:
        seen += w
        if seen >= q * total:
            return x
    return pairs[-1][0]


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """The geometric mean of ratios and its 95% interval (a bootstrap over them)."""
    import numpy as np

    logs = np.log(np.asarray(ratios))
    rng = np.random.default_rng(0)
    means = rng.choice(logs, size=(BOOTSTRAP, len(logs))).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def _verdict(mean: float, low: float, high: float) -> str:
    """Within MATERIAL where the whole interval is; worse where all of it is over
    MATERIAL; neither shown otherwise (an interval that straddles it)."""
    text = f"{mean:.2f} (95% {low:.2f}-{high:.2f})"
    if high <= MATERIAL:
        return text + f": not measurably worse (all under {MATERIAL:.2f})"
    if low > MATERIAL:
        return text + f": WORSE (all over {MATERIAL:.2f})"
    return text + f": not shown either way (straddles {MATERIAL:.2f})"


def report(name: str, cycles: list[dict[int, list[float]]], share: float) -> None:
    """Per arm and percentile: the cycles' ratios over their off arm, summed up."""
    print(f"  {name}:")
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        off = [weighted_percentile([(c[OFF], 1.0)], q) for c in cycles]
        print(f"    {label}: off {min(off) * 1e3:.1f}-{max(off) * 1e3:.1f} ms per cycle")
        for arm in (OBSERVING, NICED, BURNING):
            ratios = [weighted_percentile([(c[arm], 1.0)], q) / o
                      for c, o in zip(cycles, off, strict=True)]
            print(f"      {ARMS[arm]:>5} / off: {_verdict(*interval(ratios))}; per cycle "
                  + " ".join(f"{r:.2f}" for r in ratios))
        at_30 = [weighted_percentile([(c[OBSERVING], share), (c[OFF], 1 - share)], q) / o
                 for c, o in zip(cycles, off, strict=True)]
        print(f"      at 30 s (on {share:.0%} of the time): {_verdict(*interval(at_30))}")


def admission_on_off(page_port: int, burn_seconds: float) -> None:
    from benchmarks.webhook import (
        CONCURRENCY,
        Background,
        hammer,
        measure,
        review_body,
        sample_pod,
    )
    from kvtier_demo.certs import make_certs

    certs = Path(tempfile.mkdtemp()) / "certs"
    client_ssl = ssl.create_default_context(cafile=str(make_certs(certs)))
    port = free_port()
    url = f"https://127.0.0.1:{port}/mutate-pods"
    review = review_body(sample_pod("p"))
    admissions: list[dict[int, list[float]]] = []
    reconciles: list[dict[int, list[float]]] = []
    results = multiprocessing.get_context("spawn").Queue()
    spans: list[float] = []
    load_before = os.getloadavg()
    with Background(serve_observing, port, str(certs), page_port, burn_seconds, results,
                    slots=4) as server:
        flags = server.counts
        measure(url, client_ssl, review)  # warm-up
        for _ in range(CYCLES):
            admitted, reconciled = {}, {}
            for arm in ARMS:
                if arm == OFF:
                    end = time.perf_counter() + burn_seconds

                    def going(end: float = end) -> bool:
                        return time.perf_counter() < end
                else:
                    flags[0] = arm
                    while flags[2] != arm and server.process.is_alive():
                        time.sleep(0.002)

                    def going(arm: int = arm) -> bool:
                        return bool(flags[2] == arm)
                start = time.perf_counter()
                flags[3] = 1
                admitted[arm] = asyncio.run(hammer(url, client_ssl, review, going))
                flags[3] = 0
                if arm == OBSERVING:
                    spans.append(time.perf_counter() - start)
                reconciled[arm] = results.get(timeout=60)
                while flags[2] != OFF and server.process.is_alive():
                    time.sleep(0.002)
            admissions.append(admitted)
            reconciles.append(reconciled)
    load_after = os.getloadavg()
    span = sorted(spans)[len(spans) // 2]
    share = min(1.0, span / INTERVAL)
    print(f"same run, {CYCLES} cycles of four arms (off; on: one round of "
          f"{CACHES * PODS_PER_CACHE} pods, reading process SCHED_IDLE; niced: one round, "
          f"reading process nice +{reading_process.NICENESS} only; floor: CPU burnt at the "
          f"reading process's priority for {burn_seconds:.1f} s), each measured from its "
          f"work's start to its end (a round {span:.1f} s, median); {CONCURRENCY} admissions "
          f"in flight; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, "
          f"on {os.cpu_count()} cores")
    counted = {arm: sum(len(c[arm]) for c in admissions) for arm in ARMS}
    report("admission (" + ", ".join(f"{counted[a]} {ARMS[a]}" for a in ARMS) + ")",
           admissions, share)
    counted = {arm: sum(len(c[arm]) for c in reconciles) for arm in ARMS}
    report("reconcile through a thread (" + ", ".join(f"{counted[a]} {ARMS[a]}" for a in ARMS)
           + ")", reconciles, share)


def worker_cpu_seconds(pid: int | None) -> float:
    """The reading process's CPU time so far (user + system)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_rss_mib(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def main() -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(PAGE), str(port)])
    try:
        time.sleep(1.5)
        caches = targets(port)
        observer = Observer(ObserveSettings())
        before = rss_mib()
        asyncio.run(observer.reading.start())
        pid = observer.reading.pid
        cpu, wall = [], []
        for _ in range(ROUNDS):
            c0, w0 = time.process_time() + worker_cpu_seconds(pid), time.perf_counter()
            asyncio.run(observer.observe(caches, NOW))
            cpu.append(time.process_time() + worker_cpu_seconds(pid) - c0)
            wall.append(time.perf_counter() - w0)
        snap = observer.snapshot("bench", "cache-0")
        assert snap is not None and snap.pods_read == PODS_PER_CACHE, snap and snap.problems
        pods = CACHES * PODS_PER_CACHE
        per_round = sum(cpu[1:]) / (ROUNDS - 1)  # the first round also warms up
        print(f"{pods} pods in {CACHES} caches, {PAGE.stat().st_size:,}-byte pages, "
              f"{ROUNDS} rounds: {per_round:.2f} CPU s per round, the operator's process "
              "and its reading process together "
              f"(wall {min(wall):.2f}-{max(wall):.2f} s), so {100 * per_round / INTERVAL:.1f}% "
              f"of one core at a {INTERVAL:g} s interval (target < 20%)")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        worker = worker_rss_mib(pid)
        print(f"RSS {rss_mib() + worker:.0f} MiB after the rounds: the operator's process "
              f"{rss_mib():.0f} MiB ({before:.0f} MiB before, peak {peak:.0f} MiB), its "
              f"reading process {worker:.0f} MiB; target < 250 MiB)")
        observer.reading.close()
        doc = body({"cpu": None})
        full = full_window(PAGE.read_text(), PODS_PER_CACHE)
        timed = {"off": [], "on": []}
        for _ in range(5):  # alternating, the median of each
            timed["off"].append(reconcile_ms(doc, None))
            timed["on"].append(reconcile_ms(doc, full))
        off, on = (sorted(timed[k])[2] for k in ("off", "on"))
        print(f"one reconcile: {on:.2f} ms with the status's figures from a full window "
              f"({PODS_PER_CACHE} pods x {WINDOW_STEPS} steps of growing counters), "
              f"{off:.2f} ms with observation off (medians of 5 x 200): ratio {on / off:.2f}, "
              f"+{on - off:.2f} ms")
        admission_on_off(port, sorted(wall)[len(wall) // 2])
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
