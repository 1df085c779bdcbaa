"""Reconcile 100 TieredPrefixCaches from scratch against the in-process API server.

Anchor, same run: applying the same rendered objects (claim, CronJob, router ConfigMap
per resource) straight through the gateway, with no kopf, no watches and no status. The
ratio is what the operator machinery costs on top of the bare API calls. Peak RSS is the
whole process, API server included; the RSS before the operator starts is printed too.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import resource
import time

from kmock import KubernetesEmulator, Server

from kvtier_operator.render.objects import render_objects
from kvtier_operator.validation import parse_tpc
from tests.helpers import tpc_doc
from tests.operator.integration.harness import CTX, TPC, gateway_for, operator, setup

COUNT = int(os.environ.get("KVTIER_BENCH_CACHES", "100"))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def docs(prefix: str) -> list[dict]:
    out = []
    for i in range(COUNT):
        doc = tpc_doc({"router": {"enabled": True}}, name=f"{prefix}{i}", namespace="bench")
        doc["metadata"].update(uid=f"{prefix}-{i}", generation=1)
        out.append(doc)
    return out


async def direct(kmock: KubernetesEmulator) -> float:
    gw = gateway_for(kmock)
    objs = [o for d in docs("direct") for o in render_objects(parse_tpc(d), CTX)]
    start = time.perf_counter()
    await asyncio.to_thread(lambda: [gw.ensure(o) for o in objs])
    return time.perf_counter() - start


async def with_operator(kmock: KubernetesEmulator) -> tuple[float, float]:
    seeded = docs("op")
    for d in seeded:
        kmock.objects[TPC, "bench", d["metadata"]["name"]] = copy.deepcopy(d)
    before = rss_mib()
    start = time.perf_counter()
    async with operator(kmock):
        while True:
            done = sum(1 for d in seeded
                       if (kmock.objects[TPC, "bench", d["metadata"]["name"]].raw.get("status")
                           or {}).get("configHash"))
            if done == COUNT:
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - start
    return elapsed, before


async def run() -> None:
    for noisy in ("aiohttp.access", "kopf", "kvtier_operator"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    async with KubernetesEmulator() as kmock, Server(kmock):
        setup(kmock)
        anchor = await direct(kmock)
        elapsed, before = await with_operator(kmock)
    print(f"direct apply of {COUNT} x 3 objects through the gateway: {anchor:.2f}s")
    print(f"operator, {COUNT} resources from scratch to status: {elapsed:.2f}s "
          f"({elapsed / COUNT * 1000:.0f} ms each); ratio to direct apply {elapsed / anchor:.2f}x")
    print(f"peak RSS {rss_mib():.0f} MiB (before the operator started: {before:.0f} MiB; "
          "both include the in-process API server)")


def main() -> None:
    asyncio.run(run())
