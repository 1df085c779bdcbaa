"""The demo's live cluster: an in-process API server, the real operator and the real
webhook over HTTPS, started and stopped together (`make demo` and `make demo EXAMPLE=`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier_operator.context import RenderContext
from kvtier_operator.handlers import OperatorConfig
from kvtier_operator.observe.observer import ObserveSettings


def say(title: str) -> None:
    print(f"\n=== {title}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """check()'s first truthy value (KeyError/TypeError count as not yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (KeyError, TypeError):
            value = None
        if value:
            return value
        await asyncio.sleep(0.05)
    raise RuntimeError(f"demo: timed out waiting for {what}")


@dataclass
class LiveCluster:
    kmock: Any  # kmock.KubernetesEmulator
    ctx: RenderContext
    config: OperatorConfig
    ca: Path  # the webhook's CA certificate, for HTTPS clients
    port: int  # the webhook's port on 127.0.0.1


@contextlib.asynccontextmanager
async def live_cluster(out: Path) -> AsyncIterator[LiveCluster]:
    from kmock import KubernetesEmulator, Server

    from kvtier_demo import sandbox
    from kvtier_demo.certs import make_certs
    from kvtier_operator.webhook import make_app, serve, tls_context

    ctx = RenderContext(allowed_object_endpoints=sandbox.DEMO_OBJECT_ENDPOINTS)
    # Observation every half second: the demo's pods' metrics reach status.tiers quickly.
    config = OperatorConfig(render=ctx, drift_interval=0.5, retry_delay=0.2,
                            observe=ObserveSettings(interval=0.5, timeout=2, window=600),
                            reference_namespaces=sandbox.DEMO_REFERENCE_NAMESPACES)
    out.mkdir(parents=True, exist_ok=True)
    certs = out / "webhook-certs"
    ca = make_certs(certs)
    port = free_port()
    tls = tls_context(str(certs / "tls.crt"), str(certs / "tls.key"))
    async with KubernetesEmulator() as kmock, Server(kmock):
        sandbox.setup(kmock)
        runner = await serve(make_app(config.caches, config.conflicts, ctx), "127.0.0.1", port,
                             tls)
        try:
            async with sandbox.operator(kmock, ctx, config=config):
                yield LiveCluster(kmock, ctx, config, ca, port)
        finally:
            await runner.cleanup()
