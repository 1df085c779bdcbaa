"""Observation at scale (#32): 1,000 pods across 50 TieredPrefixCaches, each serving a
page captured from a real vLLM 0.32 API server (tests/fixtures/metrics/, about 500
series), read by the operator's Observer with its default bounds.

The pages come from a server in another process (its CPU is not ours). Figures: the
Observer's CPU seconds per round, and so its share of one core at the default 30 s
interval (the target: under 20%); the process's RSS (under 250 MiB); and one
reconcile's latency with the observation's snapshot against observation off (None),
same run, as a ratio.

Admission latency with observation on vs off, as the operator runs them: one process
serves the admission webhook (HTTPS, its admission lanes) and runs the Observer over the
same 1,000 pods on its event loop; a client in another process sends admissions (500 a
round, 20 in flight, benchmarks/webhook.py's). Rounds alternate off, on, off, on...; "on"
runs observation rounds back to back while the admissions are measured (the operator
runs one every 30 s, so this is the worst case). Ratio: p50 and p99 on / off, pooled
over the rounds.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe.observer import (
    CacheObservation,
    CacheTargets,
    Observer,
    ObserveSettings,
    Target,
)
from kvtier_operator.reconcile import reconcile
from kvtier_operator.validation import parse_tpc
from tests.e2e.observe_server import free_port
from tests.helpers import ROOT
from tests.operator.unit.test_reconcile import CTX, NOW, FakeGateway, body

CACHES, PODS_PER_CACHE, ROUNDS = 50, 20, 3
INTERVAL = ObserveSettings().interval
PAGE = ROOT / "tests" / "fixtures" / "metrics" / "vllm-0.32-gpu-direct-b-loaded.txt"
SERVER = """
import sys
from aiohttp import web
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


def reconcile_ms(doc: dict, observed: CacheObservation | None, n: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(n):
        reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=observed,
                  observing=observed is not None)
    return (time.perf_counter() - start) / n * 1000


ADMISSION_ROUNDS = 3  # of each, alternating


def serve_observing(port: int, certs: str, page_port: int, ready: Any, flags: Any) -> None:
    """The operator's process, in small: the webhook and, while flags[0] is 1, the
    Observer reading every pod round after round (flags[1] counts the rounds, flags[2]
    is 1 while one runs)."""
    import yaml

    from kvtier_operator.admission_lanes import AdmissionLanes
    from kvtier_operator.context import RenderContext
    from kvtier_operator.webhook import CacheRegistry, ConflictLog, make_app, serve, tls_context
    from tests.helpers import EXAMPLES

    async def observing(observer: Observer, caches: list[CacheTargets]) -> None:
        while True:
            if flags[0]:
                flags[2] = 1
                await observer.observe(caches, NOW)
                flags[2] = 0
                with flags.get_lock():
                    flags[1] += 1
            else:
                await asyncio.sleep(0.05)

    async def run() -> None:
        registry = CacheRegistry()
        registry.observe("ADDED", yaml.safe_load((EXAMPLES / "native-kvtier.yaml").read_text()))
        lanes = AdmissionLanes()
        runner = await serve(make_app(registry, ConflictLog(), RenderContext(), lanes),
                             "127.0.0.1", port, tls_context(f"{certs}/tls.crt",
                                                            f"{certs}/tls.key"))
        await lanes.warm()
        loop = asyncio.get_running_loop()
        task = loop.create_task(observing(Observer(ObserveSettings()), targets(page_port)))
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        ready.set()
        await stop.wait()
        task.cancel()
        lanes.close()
        del runner

    asyncio.run(run())


def admission_on_off(page_port: int) -> None:
    from benchmarks.webhook import (
        CONCURRENCY,
        REQUESTS,
        Background,
        measure,
        percentile,
        review_body,
        sample_pod,
    )
    from kvtier_demo.certs import make_certs

    certs = Path(tempfile.mkdtemp()) / "certs"
    client_ssl = ssl.create_default_context(cafile=str(make_certs(certs)))
    port = free_port()
    url = f"https://127.0.0.1:{port}/mutate-pods"
    body = review_body(sample_pod("p"))
    pooled: dict[bool, list[float]] = {False: [], True: []}
    with Background(serve_observing, port, str(certs), page_port, slots=3) as server:
        measure(url, client_ssl, body)  # warm-up
        for _ in range(ADMISSION_ROUNDS):
            for on in (False, True):
                server.counts[0] = int(on)
                # on: an observation round is under way; off: the last one has ended
                while server.counts[2] != int(on) and server.process.is_alive():
                    time.sleep(0.02)
                latencies, _ = measure(url, client_ssl, body)
                pooled[on] += latencies
        server.counts[0] = 0
        rounds_seen = server.counts[1]
    p = {on: (percentile(v, 0.5) * 1e3, percentile(v, 0.99) * 1e3) for on, v in pooled.items()}
    print(f"admission ({REQUESTS} a round, {CONCURRENCY} in flight, {ADMISSION_ROUNDS} "
          f"alternating rounds each; {rounds_seen} observation rounds of "
          f"{CACHES * PODS_PER_CACHE} pods ran back to back in the webhook's process "
          f"during the 'on' rounds): p50 {p[True][0]:.1f} ms on vs {p[False][0]:.1f} ms off "
          f"(ratio {p[True][0] / p[False][0]:.2f}), p99 {p[True][1]:.1f} vs "
          f"{p[False][1]:.1f} ms (ratio {p[True][1] / p[False][1]:.2f})")


def main() -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(PAGE), str(port)])
    try:
        time.sleep(1.5)
        caches = targets(port)
        observer = Observer(ObserveSettings())
        before = rss_mib()
        cpu, wall = [], []
        for _ in range(ROUNDS):
            c0, w0 = time.process_time(), time.perf_counter()
            asyncio.run(observer.observe(caches, NOW))
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        snap = observer.snapshot("bench", "cache-0")
        assert snap is not None and snap.pods_read == PODS_PER_CACHE, snap and snap.problems
        pods = CACHES * PODS_PER_CACHE
        per_round = sum(cpu[1:]) / (ROUNDS - 1)  # the first round also warms up
        print(f"{pods} pods in {CACHES} caches, {PAGE.stat().st_size:,}-byte pages, "
              f"{ROUNDS} rounds: {per_round:.2f} CPU s per round "
              f"(wall {min(wall):.2f}-{max(wall):.2f} s), so {100 * per_round / INTERVAL:.1f}% "
              f"of one core at a {INTERVAL:g} s interval (target < 20%)")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"RSS {rss_mib():.0f} MiB after the rounds ({before:.0f} MiB before, peak "
              f"{peak:.0f} MiB; target < 250 MiB)")
        doc = body({"cpu": None})
        off, on = reconcile_ms(doc, None), reconcile_ms(doc, snap)
        print(f"one reconcile: {on:.2f} ms with the observation, {off:.2f} ms with "
              f"observation off: ratio {on / off:.2f}")
        admission_on_off(port)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
