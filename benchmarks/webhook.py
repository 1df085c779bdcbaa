"""Admission latency of the pod webhook, 50 requests in flight, over HTTPS.

Anchor, same run and load: GET /healthz on the same server (TLS, HTTP and aiohttp cost
with no admission work). Each request injects the sample llm-d Deployment's pod for the
native-kvtier example.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import ssl
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from kvtier_operator.certs import make_certs
from kvtier_operator.render.context import RenderContext
from kvtier_operator.webhook import (
    MUTATE_PATH,
    CacheRegistry,
    ConflictLog,
    make_app,
    serve,
    tls_context,
)
from tests.helpers import EXAMPLES

REQUESTS, CONCURRENCY = 2000, 50


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def hammer(url: str, client_ssl: ssl.SSLContext, body: bytes | None) -> list[float]:
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as s:
        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                start = time.perf_counter()
                if body is None:
                    async with s.get(url, ssl=client_ssl) as r:
                        await r.read()
                else:
                    async with s.post(url, data=body, ssl=client_ssl,
                                      headers={"Content-Type": "application/json"}) as r:
                        payload = await r.json()
                        assert "patch" in payload["response"]
                latencies.append(time.perf_counter() - start)
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return latencies


async def run() -> None:
    certs = Path(tempfile.mkdtemp()) / "certs"
    ca = make_certs(certs)
    caches = CacheRegistry()
    caches.observe("ADDED", yaml.safe_load((EXAMPLES / "native-kvtier.yaml").read_text()))
    dep = yaml.safe_load((EXAMPLES / "vllm-deployment.yaml").read_text())
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {**copy.deepcopy(dep["spec"]["template"]["metadata"]), "name": "p",
                        "namespace": "llm-d"}, "spec": dep["spec"]["template"]["spec"]}
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u", "operation": "CREATE", "namespace": "llm-d",
                                   "object": pod}}).encode()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    runner = await serve(make_app(caches, ConflictLog(), RenderContext()), "127.0.0.1", port,
                         tls_context(str(certs / "tls.crt"), str(certs / "tls.key")))
    client_ssl = ssl.create_default_context(cafile=str(ca))
    try:
        base = f"https://127.0.0.1:{port}"
        anchor = await hammer(base + "/healthz", client_ssl, None)
        admit = await hammer(base + MUTATE_PATH, client_ssl, body)
    finally:
        await runner.cleanup()
    a50, a99 = percentile(anchor, 0.5) * 1e3, percentile(anchor, 0.99) * 1e3
    m50, m99 = percentile(admit, 0.5) * 1e3, percentile(admit, 0.99) * 1e3
    print(f"{REQUESTS} requests, {CONCURRENCY} in flight, client and server on one machine")
    print(f"anchor GET /healthz: p50 {a50:.1f} ms, p99 {a99:.1f} ms")
    print(f"pod admission (inject + JSONPatch): p50 {m50:.1f} ms, p99 {m99:.1f} ms "
          f"({m50 / a50:.1f}x / {m99 / a99:.1f}x the anchor)")


def main() -> None:
    asyncio.run(run())
