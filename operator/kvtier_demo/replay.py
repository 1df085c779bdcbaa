"""The demo pod's /metrics: no engine runs in the demo, so the sample model-server pod's
metrics endpoint (on 127.0.0.1, where the pod's status.podIP points) serves the engine's
page captured from a real vLLM API server (tests/fixtures/metrics/, written by
`python -m tests.e2e.capture_metrics`), first the server's page before any request, then
its page after one. The kvtier backend's families on that page are live: the capture's
own kvtier_offload_* families are cut out and the demo process's are served instead (the
BlockStore the demo moves its blocks through, kvtier_demo.blocks), rendered by
prometheus-client. The operator reads it through its real observation path, as it reads
any pod: the address from status.podIP, the port from the kvtier.dev/metrics-port
annotation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvtier_demo.cluster import free_port

CAPTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "metrics"
# kvtier's storage tier behind vLLM's CPU tier, as examples/native-kvtier.yaml renders
# them: a server whose CPU tier is empty answers a prompt whose blocks another server
# stored on the shared volume (vLLM promotes them from the storage tier).
CAPTURE = "vllm-0.32-cpu-storage-u"
PAGES = ("idle", "loaded")
BACKEND_PREFIX = "kvtier_offload_"


def _family_of(line: str) -> str:
    """The metric name a line of the text format is about ('' for a bare comment)."""
    if line.startswith("#"):
        parts = line.split(maxsplit=3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    return line.split("{", 1)[0].split(" ", 1)[0]


def engine_only(page: str) -> str:
    """A captured page without its kvtier_offload_* lines: the engine's own families."""
    return "".join(line for line in page.splitlines(keepends=True)
                   if not _family_of(line).startswith(BACKEND_PREFIX))


class BackendFamilies(Collector):
    """The kvtier_offload_* families of a registry (by default this process's), alone."""

    def __init__(self, source: CollectorRegistry = REGISTRY) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        return (f for f in self.source.collect() if f.name.startswith(BACKEND_PREFIX))


def backend_page(source: CollectorRegistry = REGISTRY) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BackendFamilies(source))
    return generate_latest(registry).decode()


@dataclass
class ReplayedMetrics:
    """A /metrics endpoint on 127.0.0.1 serving one captured engine page at a time,
    with the live kvtier_offload_* families of `backend` (a registry) in place of the
    capture's."""

    capture: str = CAPTURE
    port: int = field(default_factory=free_port)
    shown: str = PAGES[0]
    backend: CollectorRegistry = REGISTRY
    _runner: web.AppRunner | None = None

    def file(self, page: str) -> Path:
        return CAPTURES / f"{self.capture}-{page}.txt"

    def page(self) -> str:
        return self._pages[self.shown] + backend_page(self.backend)

    async def start(self) -> None:
        self._pages = {page: engine_only(self.file(page).read_text()) for page in PAGES}

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=self.page(), content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def show(self, page: str) -> None:
        if page not in PAGES:
            raise ValueError(f"no captured page {page!r}; one of {PAGES}")
        self.shown = page

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> ReplayedMetrics:
        await self.start()
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.stop()
