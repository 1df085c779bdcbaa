"""Figures a pod reports cannot stop the operator writing status (#32): the real
operator (kopf against kmock) reconciles a cache whose pods' counters sum past a
float's range, and status still updates, the overflowing figure left out with why."""

from __future__ import annotations

import pytest

from kvtier_demo import sandbox
from kvtier_operator.engines.figures import PodFigures
from kvtier_operator.handlers import OperatorConfig
from kvtier_operator.observe.observer import CacheObservation, Observer, ObserveSettings
from kvtier_operator.observe.window import OVERFLOW, PodHistory, WindowSum
from tests.helpers import tpc_doc
from tests.operator.integration.harness import CTX, TPC, condition, obj, setup, until

pytestmark = pytest.mark.timeout(120)
NS = "ml"


class FixedObserver(Observer):
    """An observer whose every round found `observation` (no pods are read)."""

    def __init__(self, observation: CacheObservation) -> None:
        super().__init__(ObserveSettings())
        self.observation = observation

    def snapshot(self, namespace: str, cache: str) -> CacheObservation | None:
        return self.observation


def huge_sums() -> CacheObservation:
    """Two pods, each with counters that grew by 1e308 in one step: their sum is inf."""
    window = WindowSum()
    for _ in range(2):
        h = PodHistory()
        for at, v in ((0.0, 0.0), (30.0, 1e308)):
            h.add(at, PodFigures(counters={("prompt_tokens", ""): v,
                                           ("bytes_loaded", "storage"): v}), 300)
        window.add(h, 30.0)
    return CacheObservation(window=window, pods_read=2, pods_unreadable=0, problems=[],
                            observed_at="2026-11-27T00:00:00Z", reads=True, pods_selected=2)


async def test_counters_past_a_float_s_range_leave_status_updating(kmock):
    setup(kmock)
    doc = tpc_doc(None, name="cache", namespace=NS)
    doc["metadata"].update(uid="uid-1", generation=1)
    kmock.objects[TPC, NS, "cache"] = doc
    config = OperatorConfig(render=CTX, drift_interval=3600.0, retry_delay=0.2,
                            observer=FixedObserver(huge_sums()))
    async with sandbox.operator(kmock, CTX, config=config):
        await until(lambda: condition(obj(kmock, TPC, NS, "cache"), "MetricsReadable"),
                           what="status with the observation's condition")
    body = obj(kmock, TPC, NS, "cache")
    assert condition(body, "Ready")["observedGeneration"] == 1
    storage = {t["name"]: t for t in body["status"]["tiers"]}["storage"]
    assert storage.get("bytesLoaded") is None and OVERFLOW in storage["unobserved"]
    assert body["status"]["recompute"].get("promptTokens") is None
