"""Observation at scale (#32): 1,000 pods across 50 TieredPrefixCaches, each serving a
page captured from a real vLLM 0.32 API server (tests/fixtures/metrics/, about 500
series), read by the operator's Observer with its default bounds.

The pages come from a server in another process (its CPU is not ours). Figures: the
Observer's CPU seconds per round, and so its share of one core at the default 30 s
interval (the target: under 20%); the process's RSS (under 250 MiB); and one
reconcile's latency with the observation's snapshot against observation off (None),
same run, as a ratio.
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import time

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
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
