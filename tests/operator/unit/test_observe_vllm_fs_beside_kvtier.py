"""A kvtier local disk beside vLLM's own fs storage tier (storage.backend vllm-fs): vLLM's
fs tier exports no kvtier_offload_* series, so its figures are absent, never zeros, and
vLLM's "disk" hits are split by vLLM's own per-tier promotion bytes where every tier has
one, else kept together (#32 review). On the 0.33 page of examples/native-local-disk.yaml
(tests/fixtures/metrics/vllm-0.33-cpu-local-storage-v-*), the storage tier's kvtier series
removed, as vLLM's fs tier would leave them."""

from __future__ import annotations

from kvtier_operator.engines.vllm.metrics import read
from kvtier_operator.status import observed_tiers
from kvtier_operator.validation import parse_tpc
from tests.helpers import example
from tests.operator.unit.test_observe import observation, page
from tests.operator.unit.test_observe_file_tiers import offloaded

READ_BYTES = "vllm:kv_offload_tiering_read_bytes_total"


def _tpc():
    doc = example("native-local-disk.yaml")
    doc["spec"]["storage"]["backend"] = "vllm-fs"
    return parse_tpc(doc)


def _without(samples, name_prefix: str, tier_label: str):
    return {n: [(labels, v) for labels, v in series
                if not (n.startswith(name_prefix) and labels.get("tier") == tier_label)]
            for n, series in samples.items()}


def _pages(*strip: tuple[str, str]):
    out = []
    for n in ("idle", "hit"):
        samples = page(f"vllm-0.33-cpu-local-storage-v-{n}.txt")
        for prefix, tier in strip:
            samples = _without(samples, prefix, tier)
        out.append(samples)
    return out


def test_a_tier_without_kvtier_series_has_no_figures_not_zeros():
    tpc = _tpc()
    tiers = offloaded(tpc)
    assert tiers == ("cpu", "localDisk", "storage")
    _, hit = _pages(("kvtier_offload_", "storage"))
    f = read(hit, tiers)
    assert ("failed_loads", "storage") not in f.counters
    assert ("loads", "storage") not in f.counters
    assert ("failed_loads", "storage") in f.missing
    assert ("failed_loads", "localDisk") in f.counters  # kvtier's local disk still reads


def test_disk_hits_split_by_vllm_s_promotion_bytes_when_one_tier_lacks_kvtier_s():
    tpc = _tpc()
    tiers = offloaded(tpc)
    idle, hit = _pages(("kvtier_offload_", "storage"))
    out = observed_tiers(tpc, tiers, observation(idle, hit, offloaded=tiers), None,
                         enabled=True)
    by = {t.name: t for t in out.tiers}
    disk = sum(v for labels, v in hit["vllm:prompt_tokens_cached_by_source_total"]
               if labels["source"] == "disk")
    promoted = {t: sum(v for labels, v in hit[READ_BYTES] if labels["tier"] == t)
                for t in ("1:KvtierLocalTier", "2:KvtierStorageTier")}
    assert disk > 0 and all(promoted.values())
    share = disk * promoted["1:KvtierLocalTier"] / sum(promoted.values())
    assert by["localDisk"].hit_tokens == round(share)
    assert by["storage"].hit_tokens == round(disk - share)
    assert by["storage"].hit_source == "derived" and by["localDisk"].hit_source == "derived"
    assert by["storage"].failed_loads is None
    assert "offloaded" not in by


def test_a_tier_with_no_figure_at_all_keeps_the_disk_hits_together():
    tpc = _tpc()
    tiers = offloaded(tpc)
    idle, hit = _pages(("kvtier_offload_", "storage"),
                       ("vllm:kv_offload_tiering_", "2:KvtierStorageTier"))
    out = observed_tiers(tpc, tiers, observation(idle, hit, offloaded=tiers), None,
                         enabled=True)
    by = {t.name: t for t in out.tiers}
    disk = sum(v for labels, v in hit["vllm:prompt_tokens_cached_by_source_total"]
               if labels["source"] == "disk")
    assert by["offloaded"].hit_tokens == round(disk)
    assert by["localDisk"].hit_tokens is None and by["storage"].hit_tokens is None
