"""Observation (#32) of kvtier's file and object tiers side by side, on pages captured from
real vLLM API servers (tests/fixtures/metrics/, `python -m tests.e2e.capture_metrics
--only cpu-local-storage-v,cpu-storage-w`):

- `cpu-local-storage-v`: the local-disk and storage tiers behind vLLM's CPU tier
  (examples/native-local-disk.yaml), each serving one prompt's blocks. vLLM counts both as
  source "disk"; status splits the tokens by kvtier's per-tier loads and says so.
- `cpu-storage-w`: the storage tier on a slowed write path with a short write queue:
  kvtier_offload_dropped_writes_total counts the stores it dropped.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from kvtier_operator import metrics
from kvtier_operator.engines.figures import SHARED_HIT_TOKENS
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.engines.vllm.metrics import read
from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.observe.window import WindowSum
from kvtier_operator.reconcile import reconcile
from kvtier_operator.status import observed_tiers
from kvtier_operator.validation import parse_tpc
from tests.helpers import example
from tests.operator.unit.test_observe import observation, page
from tests.operator.unit.test_reconcile import CTX, NOW, FakeGateway

VERSIONS = ["0.32", "0.33"]


def local_disk_tpc():
    return parse_tpc(example("native-local-disk.yaml"))


def kvtier_tpc():
    return parse_tpc(example("native-kvtier.yaml"))


def offloaded(tpc) -> tuple[str, ...]:
    return adapter_for(tpc.spec).offloaded_tiers(tpc.spec)


def summed(counters) -> CacheObservation:
    """One pod's increments over the window, as the observer would have summed them."""
    return CacheObservation(window=WindowSum(counters=counters, pods_with_steps=1),
                            pods_read=1, pods_unreadable=0, problems=[], observed_at=NOW,
                            reads=True, pods_selected=1)


def exported(example_name: str, obs: CacheObservation, gauge: str) -> dict[str, float]:
    """The example cache's status from obs, exported: the gauge's value per tier."""
    doc = example(example_name)
    doc["metadata"].update(uid="u-1", generation=1)
    name = doc["metadata"]["name"]
    status = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=obs,
                       observing=True).status
    metrics.export_tiers(("ml", name), status)
    values = {t.name: REGISTRY.get_sample_value(gauge, {"namespace": "ml", "cache": name,
                                                        "tier": t.name})
              for t in status.tiers or []}
    return {tier: v for tier, v in values.items() if v is not None}


def loaded_bytes(samples, tier: str) -> float:
    return sum(v for labels, v in samples["kvtier_offload_bytes_total"]
               if labels.get("tier") == tier and labels.get("direction") == "load")


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_s_disk_hits_are_split_by_kvtier_s_per_tier_loads(version):
    tpc = local_disk_tpc()
    tiers = offloaded(tpc)
    assert tiers == ("cpu", "localDisk", "storage")
    idle, hit = (page(f"vllm-{version}-cpu-local-storage-v-{n}.txt") for n in ("idle", "hit"))
    disk = sum(v for labels, v in hit["vllm:prompt_tokens_cached_by_source_total"]
               if labels["source"] == "disk")
    prompt = sum(v for _, v in hit["vllm:prompt_tokens_total"])
    local, shared = loaded_bytes(hit, "localDisk"), loaded_bytes(hit, "storage")
    assert disk > 0 and local > 0 and shared > 0  # both tiers served hits
    # the reader keeps vLLM's count whole, for the tiers it covers
    f = read(hit, tiers)
    assert f.counters[(SHARED_HIT_TOKENS, "localDisk,storage")] == disk
    assert ("hit_tokens", "storage") not in f.counters
    out = observed_tiers(tpc, tiers, observation(idle, hit, offloaded=tiers), None,
                         enabled=True)
    by = {t.name: t for t in out.tiers}
    assert "offloaded" not in by and "localDisk,storage" not in by
    for name, loaded in (("localDisk", local), ("storage", shared)):
        share = disk * loaded / (local + shared)
        assert by[name].hit_tokens == round(share), name
        assert by[name].hit_percent == round(100 * share / prompt, 2)
        assert by[name].hit_source == "derived"
        assert by[name].bytes_loaded == loaded
    assert by["cpu"].hit_source == "engine" and by["gpu"].hit_source == "engine"
    # the Hit column: every offloaded tier's tokens, vLLM's disk count whole
    cpu_hits = sum(v for labels, v in hit["vllm:prompt_tokens_cached_by_source_total"]
                   if labels["source"] == "host")
    assert out.hit_percent == round(100 * (disk + cpu_hits) / prompt, 2)


def test_without_loads_to_split_by_the_disk_hits_stay_together():
    """vLLM's disk hits with no bytes loaded from either tier over the window (a backend
    whose series are absent): one `offloaded` figure, never a guess per tier."""
    tpc = local_disk_tpc()
    obs = summed({("prompt_tokens", ""): 400.0, ("recomputed_tokens", ""): 16.0,
                  (SHARED_HIT_TOKENS, "localDisk,storage"): 384.0})
    out = observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True)
    by = {t.name: t for t in out.tiers}
    assert by["offloaded"].hit_tokens == 384 and by["offloaded"].hit_source == "engine"
    assert by["localDisk"].hit_tokens is None and by["storage"].hit_tokens is None
    assert out.hit_percent == 96.0


def test_one_file_tier_keeps_vllm_s_own_attribution():
    tpc = kvtier_tpc()
    tiers = offloaded(tpc)
    assert tiers == ("cpu", "storage")
    idle, loaded = (page(f"vllm-0.32-cpu-storage-u-{n}.txt") for n in ("idle", "loaded"))
    out = observed_tiers(tpc, tiers, observation(idle, loaded, offloaded=tiers), None,
                         enabled=True)
    storage = {t.name: t for t in out.tiers}["storage"]
    assert storage.hit_tokens == 192 and storage.hit_source == "engine"


@pytest.mark.parametrize("version", VERSIONS)
def test_dropped_writes_are_counted_per_tier_exported_and_advised(version):
    tpc = kvtier_tpc()
    tiers = offloaded(tpc)
    idle, dropped_page = (page(f"vllm-{version}-cpu-storage-w-{n}.txt")
                          for n in ("idle", "dropped"))
    said = sum(v for labels, v in dropped_page["kvtier_offload_dropped_writes_total"]
               if labels["tier"] == "storage")
    written = sum(v for labels, v in dropped_page["kvtier_offload_operations_total"]
                  if labels["tier"] == "storage" and labels["direction"] == "store")
    assert "kvtier_offload_dropped_writes_total" not in idle  # none before the first drop
    assert ("dropped_writes", "storage") not in read(idle, tiers).counters  # absent, not 0
    stores = said + written
    assert said > 0 and stores >= 20
    obs = observation(idle, dropped_page, offloaded=tiers)
    out = observed_tiers(tpc, tiers, obs, None, enabled=True)
    storage = {t.name: t for t in out.tiers}["storage"]
    assert storage.dropped_writes == said
    assert storage.dropped_writes_percent == round(100 * said / stores, 2)
    assert {t.name: t for t in out.tiers}["cpu"].dropped_writes is None
    assert out.advice.reason == "WritesDropped", out.advice
    assert (f"the storage tier dropped {int(said)} of {int(stores)} block stores"
            in out.advice.message)
    reasons = {labels["reason"]: v for labels, v in
               dropped_page["kvtier_offload_dropped_writes_total"]}
    said_reasons = ", ".join(f"{int(v)} {r}" for r, v in sorted(reasons.items()))
    assert f"its writes do not keep up ({said_reasons}): a faster volume or more write " \
           "threads (spec.storage.writeThreads)" in out.advice.message
    assert "free-space floor" not in out.advice.message  # no drop for that reason
    # the gauge carries it; a tier without the figure has no sample
    gauge = exported("native-kvtier.yaml", obs, "kvtier_tier_dropped_writes")
    assert gauge == {"storage": said}


def test_a_few_dropped_writes_are_no_advice():
    """At most 10% of the stores, or fewer than 20 stores: counted, not advice."""
    tpc = kvtier_tpc()

    def advice(dropped: float, stores: float):
        obs = summed({("prompt_tokens", ""): 5000.0, ("recomputed_tokens", ""): 5000.0,
                      ("dropped_writes", "storage"): dropped, ("stores", "storage"): stores})
        return observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True).advice

    assert advice(2.0, 20.0).reason != "WritesDropped"  # 10%: not over
    assert advice(3.0, 19.0).reason != "WritesDropped"  # too few stores to judge
    assert advice(3.0, 20.0).reason == "WritesDropped"


def test_writes_dropped_at_the_free_space_floor_advise_room_not_speed():
    tpc = kvtier_tpc()
    obs = summed({("prompt_tokens", ""): 5000.0, ("recomputed_tokens", ""): 5000.0,
                  ("dropped_writes", "storage"): 30.0, ("stores", "storage"): 40.0,
                  ("dropped_writes:free-space-floor", "storage"): 30.0})
    message = observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True).advice.message
    assert "30 at the volume's free-space floor: evict more" in message
    assert "do not keep up" not in message and "write threads" not in message


def test_kubectl_get_wide_has_a_hit_column_per_tier_and_shows_derived_figures():
    """`kubectl get tpc -o wide`: one Hit column for each tier a cache can configure,
    reading status.tiers by name (the local-disk and object-store tiers included)."""
    from kvtier_demo.table import table
    from kvtier_operator.crd import PRINTER_COLUMNS

    wide = {c["name"]: c for c in PRINTER_COLUMNS if c.get("priority") == 1}
    for tier, title in (("gpu", "GPU"), ("cpu", "CPU"), ("localDisk", "LocalDisk"),
                        ("storage", "Storage"), ("objectStore", "ObjectStore")):
        assert wide[f"{title}-Hit"]["jsonPath"] == \
            f'.status.tiers[?(@.name=="{tier}")].hitPercent'
    tpc = local_disk_tpc()
    tiers = offloaded(tpc)
    idle, hit = (page(f"vllm-0.32-cpu-local-storage-v-{n}.txt") for n in ("idle", "hit"))
    doc = example("native-local-disk.yaml")
    doc["metadata"].update(uid="u-1", generation=1)
    status = reconcile(doc, FakeGateway(), CTX, [], [], NOW,
                       observed=observation(idle, hit, offloaded=tiers),
                       observing=True).status
    doc["status"] = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    header, row = (line.split() for line in table(doc, wide=True).splitlines())
    cells = dict(zip(header, row, strict=True))
    by = {t.name: t for t in status.tiers}
    assert float(cells["LOCALDISK-HIT"]) == by["localDisk"].hit_percent > 0
    assert float(cells["STORAGE-HIT"]) == by["storage"].hit_percent > 0
    assert cells["OBJECTSTORE-HIT"] == "<none>"  # not configured
    assert float(cells["HIT"]) == status.hit_percent
