"""Admission latency of the pod webhook over HTTPS, alone and under hostile load.

The server runs in its own process, as in the operator, and so does each hostile load;
this process only sends the measured requests: 20 in flight, each injecting the sample
llm-d Deployment's pod for the native-kvtier example. Scenarios, all in the same run:

- anchor: GET /healthz (TLS, HTTP and aiohttp cost with no admission work);
- alone: valid admissions with nothing else running;
- large bodies: while 4 senders post 2.4 MB pods whose script is `vllm` and 2.4 MB of
  whitespace, as fast as they are answered (the case that stalled the server: p99 2.3 s);
- trickling clients: while 100 TLS connections trickle request headers and 100 a request
  body, one byte a second (closed by the server after its read timeout; they reconnect).
"""

from __future__ import annotations

import asyncio
import copy
import json
import multiprocessing
import os
import signal
import socket
import ssl
import tempfile
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvtier_demo.certs import make_certs
from tests.helpers import EXAMPLES

REQUESTS, CONCURRENCY = 500, 20
LARGE_SENDERS, LARGE_SCRIPT = 4, 2_400_000
TRICKLERS = 100  # of each kind: headers, body


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sample_pod(name: str) -> dict[str, Any]:
    dep = yaml.safe_load((EXAMPLES / "vllm-deployment.yaml").read_text())
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**copy.deepcopy(dep["spec"]["template"]["metadata"]), "name": name,
                         "namespace": "llm-d"},
            "spec": copy.deepcopy(dep["spec"]["template"]["spec"])}


def review_body(pod: dict[str, Any]) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u", "operation": "CREATE", "namespace": "llm-d",
                                   "object": pod}}).encode()


def large_body() -> bytes:
    pod = sample_pod("large")
    container = pod["spec"]["containers"][0]
    container["command"], container["args"] = ["/bin/sh", "-c"], ["vllm" + " " * LARGE_SCRIPT]
    return review_body(pod)


# ------------------------------------------------------------------ processes


def serve_forever(port: int, certs: str, ready: Event, _counts: Any) -> None:
    from kvtier_operator.admission_lanes import AdmissionLanes
    from kvtier_operator.context import RenderContext
    from kvtier_operator.webhook import (
        CacheRegistry,
        ConflictLog,
        make_app,
        serve,
        tls_context,
    )

    async def run() -> None:
        caches = CacheRegistry()
        caches.observe("ADDED", yaml.safe_load((EXAMPLES / "native-kvtier.yaml").read_text()))
        lanes = AdmissionLanes()
        tls = tls_context(f"{certs}/tls.crt", f"{certs}/tls.key")
        runner = await serve(make_app(caches, ConflictLog(), RenderContext(), lanes),
                             "127.0.0.1", port, tls)
        await lanes.warm()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        ready.set()
        await stop.wait()
        lanes.close()  # the worker process; connections die with this process
        del runner

    asyncio.run(run())


def send_large_bodies(url: str, cafile: str, ready: Event, counts: Any) -> None:
    body = large_body()
    client_ssl = ssl.create_default_context(cafile=cafile)

    async def sender(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                async with session.post(url, data=body, ssl=client_ssl,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    key = str(r.status)
            except aiohttp.ClientError:
                key = "error"
            with counts.get_lock():
                counts[{"200": 0, "503": 1}.get(key, 2)] += 1
            ready.set()

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(sender(session) for _ in range(LARGE_SENDERS)))

    asyncio.run(run())


def trickle(host: str, port: int, path: str, cafile: str, ready: Event, counts: Any) -> None:
    client_ssl = ssl.create_default_context(cafile=cafile)
    heads = {"headers": (f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"),
             "body": (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Content-Length: 100000\r\n\r\n{", b" ")}

    connected = 0

    async def trickler(kind: str) -> None:
        nonlocal connected
        head, drip = heads[kind]
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port, ssl=client_ssl)
                writer.write(head.encode())
                connected += 1
                if connected == len(heads) * TRICKLERS:
                    ready.set()  # all of them connected and trickling
                while True:
                    await asyncio.sleep(1.0)
                    if reader.at_eof():
                        break
                    writer.write(drip)
                    await writer.drain()
                writer.close()
            except (OSError, ssl.SSLError):
                pass
            with counts.get_lock():
                counts[0] += 1  # closed by the server (or refused): reconnect

    async def run() -> None:
        await asyncio.gather(*(trickler(kind) for kind in heads for _ in range(TRICKLERS)))

    asyncio.run(run())


class Background:
    """A load in its own process, stopped by terminating it."""

    def __init__(self, target: Callable[..., None], *args: Any, slots: int = 3) -> None:
        context = multiprocessing.get_context("spawn")
        self.ready, self.counts = context.Event(), context.Array("i", slots)
        self.process = context.Process(target=target, args=(*args, self.ready, self.counts),
                                       name=target.__name__)

    def __enter__(self) -> Background:
        self.process.start()
        while not self.ready.wait(0.2):
            if not self.process.is_alive():
                raise RuntimeError(f"{self.process.name} exited before it was ready")
        return self

    def __exit__(self, *_: object) -> None:
        self.process.terminate()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


# ------------------------------------------------------------------ measuring


async def hammer(url: str, client_ssl: ssl.SSLContext, body: bytes | None,
                 going: Callable[[], bool] | None = None) -> list[float]:
    """Latencies of REQUESTS requests, CONCURRENCY in flight; with `going`, of as many as
    start while going() is true."""
    latencies: list[float] = []
    left = REQUESTS
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as s:
        async def worker() -> None:
            nonlocal left
            while going() if going is not None else left > 0:
                left -= 1
                start = time.perf_counter()
                if body is None:
                    async with s.get(url, ssl=client_ssl) as r:
                        await r.read()
                else:
                    async with s.post(url, data=body, ssl=client_ssl,
                                      headers={"Content-Type": "application/json"}) as r:
                        payload = await r.json()
                        assert "patch" in payload["response"], payload
                latencies.append(time.perf_counter() - start)
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return latencies


def line(name: str, latencies: list[float], wall: float, extra: str = "") -> str:
    p50, p99 = percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3
    return (f"{name:<34} p50 {p50:6.1f} ms  p99 {p99:7.1f} ms  max "
            f"{max(latencies) * 1e3:7.1f} ms  {len(latencies) / wall:5.0f}/s{extra}")


def measure(url: str, client_ssl: ssl.SSLContext, body: bytes | None) -> tuple[list[float], float]:
    start = time.perf_counter()
    latencies = asyncio.run(hammer(url, client_ssl, body))
    return latencies, time.perf_counter() - start


def main() -> None:
    certs = Path(tempfile.mkdtemp()) / "certs"
    ca = str(make_certs(certs))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"https://127.0.0.1:{port}"
    client_ssl = ssl.create_default_context(cafile=ca)
    body = review_body(sample_pod("p"))
    print(f"{REQUESTS} requests per line, {CONCURRENCY} in flight; server, hostile load and "
          f"this client in separate processes on one machine ({os.cpu_count()} cores)")
    with Background(serve_forever, port, str(certs), slots=1):
        print(line("anchor GET /healthz", *measure(base + "/healthz", client_ssl, None)))
        print(line("valid admissions, alone", *measure(base + "/mutate-pods", client_ssl, body)))
        with Background(send_large_bodies, base + "/mutate-pods", ca) as large:
            before = list(large.counts)
            result = measure(base + "/mutate-pods", client_ssl, body)
            done, busy, failed = (a - b for a, b in zip(large.counts, before, strict=True))
            # The floor under the same load: a request the server does no work for.
            floor = measure(base + "/healthz", client_ssl, None)
        print(line(f"  with {LARGE_SENDERS} senders of 2.4 MB pods", *result,
                   f"  (their answers meanwhile: {done} admitted, {busy} busy 503, "
                   f"{failed} failed)"))
        print(line("  anchor GET /healthz, same load", *floor))
        with Background(trickle, "127.0.0.1", port, "/mutate-pods", ca, slots=1) as slow:
            result = measure(base + "/mutate-pods", client_ssl, body)
            deadline = time.monotonic() + 20  # the server's read timeout is 10 s
            while slow.counts[0] < 2 * TRICKLERS and time.monotonic() < deadline:
                time.sleep(0.2)
            closed, after = slow.counts[0], time.monotonic() - deadline + 20
        print(line(f"  with {2 * TRICKLERS} trickling clients", *result,
                   f"  ({closed} of them closed by the server within {after:.0f} s)"))
