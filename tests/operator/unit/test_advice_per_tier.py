"""Advice that holds up (#32 review): the CPU tier's two pieces of advice never together,
dropping spec.cpu only where the spec allows it, every offloaded tier in the CPU tier's
denominator, failing and slow loads per tier (on split tokens), and dropped writes fixed
by their reason."""

from __future__ import annotations

from kvtier_operator.status import observed_tiers
from tests.operator.unit.test_observe_file_tiers import (
    kvtier_tpc,
    local_disk_tpc,
    offloaded,
    summed,
)


def _advice(tpc, counters, cpu_used=None):
    obs = summed(counters)
    if cpu_used is not None:
        obs.window.gauges[("used_percent", "cpu")] = [cpu_used]
    return observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True).advice


def test_a_full_cpu_tier_is_too_small_not_idle_and_never_dropped_before_local_disk():
    adv = _advice(local_disk_tpc(), {
        ("prompt_tokens", ""): 100000.0, ("recomputed_tokens", ""): 49500.0,
        ("hit_tokens", "cpu"): 500.0, ("shared_hit_tokens", "localDisk,storage"): 50000.0,
        ("bytes_loaded", "localDisk"): 0.0, ("bytes_loaded", "storage"): 1e9}, cpu_used=95.0)
    assert adv.reason == "CpuTierTooSmall"
    assert "grow spec.cpu.size" in adv.message and "drop spec.cpu" not in adv.message


def test_an_idle_cpu_tier_may_be_dropped_only_where_no_tier_needs_it():
    idle = {("prompt_tokens", ""): 100000.0, ("recomputed_tokens", ""): 99900.0,
            ("hit_tokens", "cpu"): 100.0}
    assert "drop spec.cpu" in _advice(kvtier_tpc(), idle, cpu_used=5.0).message
    behind = _advice(local_disk_tpc(), idle, cpu_used=5.0)
    assert behind.reason == "CpuTierIdle" and "drop spec.cpu" not in behind.message
    assert "spec.localDisk" in behind.message


def test_the_cpu_tier_s_share_counts_the_local_disk_s_hits():
    """The volume's share of every offloaded tier's hits: here the local disk served
    nearly all of them, so the volume's 2% says nothing about the CPU tier's size."""
    counters = {("prompt_tokens", ""): 20000.0, ("recomputed_tokens", ""): 9700.0,
                ("hit_tokens", "cpu"): 100.0,
                ("shared_hit_tokens", "localDisk,storage"): 10200.0,
                ("bytes_loaded", "localDisk"): 100e6, ("bytes_loaded", "storage"): 2e6}
    assert _advice(local_disk_tpc(), counters, cpu_used=95.0).reason != "CpuTierTooSmall"
    counters[("bytes_loaded", "localDisk")] = 2e6
    counters[("bytes_loaded", "storage")] = 100e6
    assert _advice(local_disk_tpc(), counters, cpu_used=95.0).reason == "CpuTierTooSmall"


def test_the_local_disk_s_slow_loads_are_advised_on_its_split_tokens():
    adv = _advice(local_disk_tpc(), {
        ("prompt_tokens", ""): 20000.0, ("recomputed_tokens", ""): 10000.0,
        ("prefill_seconds", ""): 1.0,  # 100 us per computed token
        ("shared_hit_tokens", "localDisk,storage"): 10000.0,
        ("bytes_loaded", "localDisk"): 1e9, ("bytes_loaded", "storage"): 0.0,
        ("load_time_seconds", "localDisk"): 100.0})  # 10 ms per loaded token
    assert adv.reason == "VolumeSlowerThanRecompute"
    assert "localDisk" in adv.message


def test_failing_loads_are_advised_for_the_tier_that_fails():
    adv = _advice(local_disk_tpc(), {
        ("prompt_tokens", ""): 400.0, ("recomputed_tokens", ""): 400.0,
        ("loads", "localDisk"): 100.0, ("failed_loads", "localDisk"): 50.0,
        ("loads", "storage"): 100.0, ("failed_loads", "storage"): 0.0})
    assert adv.reason == "LoadsFailing"
    assert "localDisk" in adv.message and "storage" not in adv.message.split(";")[0]


def _dropped(tpc, tier, reason):
    return _advice(tpc, {("prompt_tokens", ""): 400.0, ("recomputed_tokens", ""): 400.0,
                         ("dropped_writes", tier): 50.0, ("stores", tier): 100.0,
                         (f"dropped_writes:{reason}", tier): 50.0}).message


def test_partial_file_drops_are_the_model_s_not_threads():
    message = _dropped(kvtier_tpc(), "storage", "partial-file")
    assert "write threads" not in message and "sliding-window" in message


def test_staging_full_drops_name_the_staging_size():
    message = _dropped(kvtier_tpc(), "storage", "staging-full")
    assert "spec.storage.hostStagingSize" in message and "write threads" not in message


def test_the_local_disk_s_floor_names_its_capacity_not_the_shared_evictor():
    message = _dropped(local_disk_tpc(), "localDisk", "free-space-floor")
    assert "spec.localDisk.capacity" in message and "eviction.schedule" not in message
    assert "eviction.schedule" in _dropped(kvtier_tpc(), "storage", "free-space-floor")
