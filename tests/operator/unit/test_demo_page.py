"""The demo pod's /metrics (kvtier_demo.replay, issue #32): the captured vLLM engine page
with exactly one source of kvtier_offload_* families, the live backend's; the capture's
own are left out, so the storage tier's figures are the demo's moves alone."""

from __future__ import annotations

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvtier_demo.replay import ReplayedMetrics
from kvtier_offload.metrics import DEFINITIONS
from kvtier_operator.engines.figures import BYTES_LOADED, BYTES_STORED, FAILED_LOADS
from kvtier_operator.engines.vllm.metrics import read
from kvtier_operator.observe.page import parse

MIB = 1 << 20
OFFLOADED = ("cpu", "storage")  # examples/native-kvtier.yaml's tiers behind the GPU


def live_backend() -> CollectorRegistry:
    """A registry with a backend's families as kvtier_offload.metrics defines them, after
    5 blocks stored and loaded and one file refused."""
    registry = CollectorRegistry()

    def made(name: str, kind: type) -> Counter | Histogram:
        d = DEFINITIONS[name]
        extra = {"buckets": d.buckets} if d.buckets else {}
        return kind(d.name, d.doc, d.labels, registry=registry, **extra)

    moved = made("kvtier_offload_bytes", Counter)
    moved.labels("storage", "store").inc(5 * MIB)
    moved.labels("storage", "load").inc(5 * MIB)
    made("kvtier_offload_corrupt_files", Counter).labels("storage", "bad-checksum").inc()
    latency = made("kvtier_offload_latency_seconds", Histogram)
    for seconds in (0.001, 0.002, 0.002, 0.003, 0.004):
        latency.labels("storage", "load").observe(seconds)
    return registry


def engine_families(text: str) -> list:
    return [(f.name, f.type, f.samples) for f in text_string_to_metric_families(text)
            if not f.name.startswith("kvtier_offload_")]


async def test_the_page_serves_the_live_backend_families_and_not_the_captures():
    async with ReplayedMetrics(backend=live_backend()) as replay:
        replay.show("loaded")
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{replay.port}/metrics") as resp:
            served = await resp.text()
    captured = replay.file("loaded").read_text()
    assert "kvtier_offload_bytes_total{" in captured  # the capture has its own: left out
    backend = [f.name for f in text_string_to_metric_families(served)
               if f.name.startswith("kvtier_offload_") and not f.name.endswith("_created")]
    assert sorted(backend) == ["kvtier_offload_bytes", "kvtier_offload_corrupt_files",
                               "kvtier_offload_latency_seconds"]  # each once, live only
    assert 'engine="0"' not in "".join(line for line in served.splitlines()
                                       if line.startswith("kvtier_offload_"))
    # the engine's families exactly as captured: its Hit stays the real server's
    assert engine_families(served) == engine_families(captured)
    # and what the operator reads from it: the live figures alone, not added to the capture's
    figures = read(parse(served, max_series=20_000).samples, OFFLOADED)
    assert figures.counters[(BYTES_LOADED, "storage")] == 5 * MIB
    assert figures.counters[(BYTES_STORED, "storage")] == 5 * MIB
    assert figures.counters[(FAILED_LOADS, "storage")] == 1
