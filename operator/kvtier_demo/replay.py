"""The demo pod's /metrics: no engine runs in the demo, so the sample model-server pod's
metrics endpoint (on 127.0.0.1, where the pod's status.podIP points) serves pages captured
from a real vLLM API server (tests/fixtures/metrics/, written by
`python -m tests.e2e.capture_metrics`), first the server's page before any request, then
its page after one. The operator reads it through its real observation path, as it reads
any pod: the address from status.podIP, the port from the kvtier.dev/metrics-port
annotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvtier_demo.cluster import free_port

CAPTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "metrics"
# kvtier's storage tier behind vLLM's CPU tier, as examples/native-kvtier.yaml renders
# them: a server whose CPU tier is empty answers a prompt whose blocks another server
# stored on the shared volume (vLLM promotes them from the storage tier).
CAPTURE = "vllm-0.32-cpu-storage-u"
PAGES = ("idle", "loaded")


@dataclass
class ReplayedMetrics:
    """A /metrics endpoint on 127.0.0.1 serving one captured page at a time."""

    capture: str = CAPTURE
    port: int = field(default_factory=free_port)
    shown: str = PAGES[0]
    _runner: web.AppRunner | None = None

    def file(self, page: str) -> Path:
        return CAPTURES / f"{self.capture}-{page}.txt"

    async def start(self) -> None:
        pages = {page: self.file(page).read_text() for page in PAGES}

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=pages[self.shown],
                                content_type="text/plain", charset="utf-8")

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
