"""The kvtier_tier_* gauges follow status.tiers (#32 review): a tier that leaves the status,
a cache whose observation stops, an invalid or deleted cache leaves no stale sample."""

from __future__ import annotations

from prometheus_client import REGISTRY

from kvtier_operator import metrics
from kvtier_operator.api.v1alpha1 import TieredPrefixCacheStatus
from kvtier_operator.status import observed_tiers
from tests.operator.unit.test_observe_file_tiers import local_disk_tpc, offloaded, summed

TOGETHER = {("prompt_tokens", ""): 400.0, ("recomputed_tokens", ""): 16.0,
            ("shared_hit_tokens", "localDisk,storage"): 384.0}
SPLIT = {**TOGETHER, ("bytes_loaded", "localDisk"): 1.0, ("bytes_loaded", "storage"): 1.0}


def _status(counters) -> TieredPrefixCacheStatus:
    tpc = local_disk_tpc()
    st = observed_tiers(tpc, offloaded(tpc), summed(counters), None, enabled=True)
    return TieredPrefixCacheStatus(tiers=st.tiers, hit_percent=st.hit_percent,
                                   recompute=st.recompute)


def _hit(cache: str, tier: str) -> float | None:
    return REGISTRY.get_sample_value("kvtier_tier_hit_percent",
                                     {"namespace": "ml", "cache": cache, "tier": tier})


def test_a_tier_that_leaves_the_status_leaves_the_gauges():
    metrics.export_tiers(("ml", "leaves"), _status(TOGETHER))
    assert _hit("leaves", "offloaded") == 96.0
    metrics.export_tiers(("ml", "leaves"), _status(SPLIT))
    assert _hit("leaves", "offloaded") is None
    assert _hit("leaves", "storage") == 48.0


def test_no_tiers_in_the_status_clears_every_tier_gauge():
    metrics.export_tiers(("ml", "off"), _status(SPLIT))
    assert _hit("off", "storage") == 48.0
    metrics.export_tiers(("ml", "off"), TieredPrefixCacheStatus())  # observation off
    assert _hit("off", "storage") is None and _hit("off", "localDisk") is None
    assert REGISTRY.get_sample_value("kvtier_tier_offloaded_hit_percent",
                                     {"namespace": "ml", "cache": "off"}) is None


def test_forgetting_a_cache_clears_all_its_gauges_and_no_other():
    metrics.export_tiers(("ml", "gone"), _status(SPLIT))
    metrics.export_tiers(("ml", "kept"), _status(SPLIT))
    metrics.READY.labels("ml", "gone").set(1)
    metrics.forget_cache(("ml", "gone"))
    assert _hit("gone", "storage") is None
    assert REGISTRY.get_sample_value("kvtier_operator_ready",
                                     {"namespace": "ml", "cache": "gone"}) is None
    assert _hit("kept", "storage") == 48.0


def test_a_cache_turning_invalid_loses_its_gauges():
    from kvtier_operator.handlers import OperatorConfig, run_reconcile
    from tests.helpers import example
    from tests.operator.unit.test_reconcile import CTX, FakeGateway

    doc = example("native-local-disk.yaml")
    doc["metadata"].update(uid="u-1", generation=1, namespace="ml", name="turns-invalid")
    metrics.export_tiers(("ml", "turns-invalid"), _status(SPLIT))
    metrics.READY.labels("ml", "turns-invalid").set(1)
    doc["spec"]["cpu"] = {"size": "not a size"}
    outcome = run_reconcile(doc, FakeGateway(), OperatorConfig(render=CTX), [], [])
    assert any(c.reason == "InvalidSpec" for c in outcome.status.conditions or [])
    assert _hit("turns-invalid", "storage") is None
    assert REGISTRY.get_sample_value("kvtier_operator_ready",
                                     {"namespace": "ml", "cache": "turns-invalid"}) is None
