"""Observation (#32): pages captured from real vLLM API servers (tests/fixtures/metrics/,
recaptured by `python -m tests.e2e.capture_metrics`) read into status.tiers, the window
over counters, advice, the router's observed capacity, the kvtier_tier_* gauges."""

from __future__ import annotations

import pytest

from kvtier_operator import metrics
from kvtier_operator.engines.vllm.metrics import KVTIER_UNREACHED, read
from kvtier_operator.observe import pod_view
from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.observe.page import parse
from kvtier_operator.observe.window import PodHistory, WindowSum, quantile
from kvtier_operator.reconcile import reconcile
from kvtier_operator.status import observed_tiers
from kvtier_operator.validation import parse_tpc
from tests.helpers import ROOT
from tests.operator.unit.test_reconcile import CTX, NOW, FakeGateway, body

PAGES = ROOT / "tests" / "fixtures" / "metrics"
GPU_DIRECT = ("storage",)


def page(name: str):
    parsed = parse((PAGES / name).read_text(), 20000)
    assert parsed.problem is None and parsed.samples
    return parsed.samples


def observation(*reads, offloaded=GPU_DIRECT, pods=1) -> CacheObservation:
    """One pod read in turn (one round per page), 30 s apart."""
    history = PodHistory()
    for i, samples in enumerate(reads):
        history.add(30.0 * i, read(samples, offloaded), window=300)
    window = WindowSum()
    window.add(history, 30.0 * (len(reads) - 1))
    return CacheObservation(window=window, pods_read=pods, pods_unreadable=0, problems=[],
                            observed_at=NOW, reads=True, pods_selected=pods)


def gpu_direct_tpc():
    return parse_tpc(body({"cpu": None}))


def test_the_vllm_reader_on_a_real_page_that_loaded_from_the_files():
    f = read(page("vllm-0.32-gpu-direct-b-loaded.txt"), GPU_DIRECT)
    assert f.counters[("prompt_tokens", "")] == 200
    assert f.counters[("hit_tokens", "storage")] == 192  # six 32-token blocks
    assert f.counters[("recomputed_tokens", "")] == 8
    assert f.counters[("bytes_loaded", "storage")] > 0
    # kvtier's own counters stay in the worker processes in GPU-direct mode: said, not 0
    assert ("failed_loads", "storage") not in f.counters
    assert f.missing[("failed_loads", "storage")] == KVTIER_UNREACHED


def test_a_storage_hit_share_from_two_reads_of_a_real_server():
    obs = observation(page("vllm-0.32-gpu-direct-b-idle.txt"),
                      page("vllm-0.32-gpu-direct-b-loaded.txt"))
    out = observed_tiers(gpu_direct_tpc(), GPU_DIRECT, obs, None, enabled=True)
    by = {t.name: t for t in out.tiers}
    assert list(by) == ["gpu", "storage"]
    assert by["storage"].hit_percent == 96.0 and by["storage"].hit_tokens == 192
    assert by["gpu"].hit_percent == 0.0
    assert out.hit_percent == 96.0
    assert out.recompute.percent == 4.0 and out.recompute.prompt_tokens == 200
    assert by["storage"].failed_loads is None
    assert "PROMETHEUS_MULTIPROC_DIR" in by["storage"].unobserved
    assert out.metrics.reason == "MetricsRead"
    assert out.advice.reason == "TiersEffective"  # loads beat the prefill time per token


def test_one_read_is_a_baseline_not_a_zero():
    obs = observation(page("vllm-0.32-gpu-direct-b-loaded.txt"))
    out = observed_tiers(gpu_direct_tpc(), GPU_DIRECT, obs, None, enabled=True)
    assert out.hit_percent is None and out.recompute.percent is None
    assert all(t.hit_percent is None for t in out.tiers)
    assert "one read so far" in out.tiers[1].unobserved
    assert out.advice.reason == "NotEnoughTraffic"


def test_a_counter_going_backwards_is_a_restart_never_a_negative_figure():
    idle, loaded = (page(f"vllm-0.32-gpu-direct-b-{n}.txt") for n in ("idle", "loaded"))
    obs = observation(idle, loaded, idle, loaded)  # the server restarted after read 2
    assert obs.window.resets == 1
    assert all(v >= 0 for v in obs.window.counters.values())
    out = observed_tiers(gpu_direct_tpc(), GPU_DIRECT, obs, None, enabled=True)
    storage = out.tiers[1]
    # the restart's read is the pod's new baseline: the window holds the step after it
    assert storage.hit_tokens == 192 and storage.hit_percent == 96.0
    assert out.observation.window_seconds == 30.0


def test_nan_and_infinite_values_make_their_figures_absent_never_zero():
    text = (PAGES / "vllm-0.32-gpu-direct-b-loaded.txt").read_text()
    text = text.replace('vllm:prompt_tokens_total{engine="0",model_name="tiny"} 200.0',
                        'vllm:prompt_tokens_total{engine="0",model_name="tiny"} NaN')
    text = text.replace('source="external_unspecified"} 192.0',
                        'source="external_unspecified"} +Inf')
    parsed = parse(text, 20000)
    assert parsed.non_finite == 2
    f = read(parsed.samples, GPU_DIRECT)
    assert ("prompt_tokens", "") not in f.counters and ("prompt_tokens", "") in f.missing
    # disk's 0 and external_unspecified's +Inf both mean storage: no partial sum
    assert ("hit_tokens", "storage") not in f.counters
    assert "NaN or infinite" in f.missing[("hit_tokens", "storage")]


def test_malformed_and_oversized_pages_read_as_nothing_with_a_reason():
    bad = parse("vllm:prompt_tokens_total{engine=0 7\n}}}", 20000)
    assert bad.problem and bad.problem.startswith("not Prometheus text") and not bad.samples
    text = (PAGES / "vllm-0.32-gpu-direct-b-loaded.txt").read_text()
    big = parse(text, 100)
    assert big.problem and "more than 100 series" in big.problem and not big.samples


def test_quantiles_follow_prometheus_histogram_quantile():
    buckets = ((0.001, 10.0), (0.01, 90.0), (0.1, 100.0), (float("inf"), 100.0))
    assert quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * (50 - 10) / 80)
    assert quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * (99 - 90) / 10)
    assert quantile(0.5, ()) is None
    assert quantile(0.99, ((0.1, 1.0), (float("inf"), 5.0))) == 0.1


def advice(counters, tpc=None, offloaded=GPU_DIRECT, gauges=None):
    window = WindowSum(counters=counters, gauges=gauges or {}, pods_with_steps=1, span=30)
    obs = CacheObservation(window=window, pods_read=1, pods_unreadable=0, problems=[],
                           observed_at=NOW, reads=True, pods_selected=1)
    return observed_tiers(tpc or gpu_direct_tpc(), offloaded, obs, None, enabled=True).advice


def test_advice_names_the_number_and_the_fix():
    failing = advice({("prompt_tokens", ""): 1000, ("loads", "storage"): 100,
                      ("failed_loads", "storage"): 12, ("hit_tokens", "storage"): 500})
    assert failing.status == "False" and failing.reason == "LoadsFailing"
    assert "12.0% of 100 loads" in failing.message
    slow = advice({("prompt_tokens", ""): 1000, ("hit_tokens", "storage"): 500,
                   ("load_time_seconds", "storage"): 5.0, ("recomputed_tokens", ""): 500,
                   ("prefill_seconds", ""): 0.5})
    assert slow.reason == "VolumeSlowerThanRecompute" and "10000.0 us per token" in slow.message
    tiered = parse_tpc(body())  # cpu and storage
    idle = advice({("prompt_tokens", ""): 50_000, ("hit_tokens", "cpu"): 10,
                   ("hit_tokens", "storage"): 0}, tiered, ("cpu", "storage"))
    assert idle.reason == "CpuTierIdle" and "of 50000 prompt tokens" in idle.message
    small = advice({("prompt_tokens", ""): 50_000, ("hit_tokens", "cpu"): 5000,
                    ("hit_tokens", "storage"): 20_000}, tiered, ("cpu", "storage"),
                   gauges={("used_percent", "cpu"): [97.0]})
    assert small.reason == "CpuTierTooSmall" and "80% of offloaded hits" in small.message
    assert "grow spec.cpu.size" in small.message


def test_observation_off_and_not_yet_read_say_so():
    off = observed_tiers(gpu_direct_tpc(), GPU_DIRECT, None, None, enabled=False)
    assert off.metrics.reason == "ObservationOff" and off.tiers is None
    waiting = observed_tiers(gpu_direct_tpc(), GPU_DIRECT, None, None, enabled=True)
    assert waiting.metrics.reason == "NotReadYet"


def test_reconcile_writes_the_observed_tiers_and_posts_advice_on_change():
    obs = observation(page("vllm-0.32-gpu-direct-b-idle.txt"),
                      page("vllm-0.32-gpu-direct-b-loaded.txt"))
    doc = body({"cpu": None})
    out = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=obs, observing=True)
    st = out.status_doc
    assert st["hitPercent"] == 96.0 and st["recompute"]["percent"] == 4.0
    assert [t["name"] for t in st["tiers"]] == ["gpu", "storage"]
    by = {c["type"]: c for c in st["conditions"]}
    assert by["MetricsReadable"]["reason"] == "MetricsRead"
    assert by["Ready"]["status"] == "True" or by["Ready"]["reason"] != "TiersEffective"
    assert {r for _, r, _ in out.advice_events} == {"MetricsRead", "TiersEffective"}
    doc["status"] = st  # the same advice again: no new Event
    again = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=obs, observing=True)
    assert again.advice_events == []


# vLLM 0.33 under TieringOffloadingSpec (its CPU-tier worker moving no data) with kvtier's
# storage tier as rendered: vllm:kv_offload_config_info has one series per tier.
TIERED_033 = "vllm-0.33-cpu-storage-t-hit.txt"
CPU_BYTES_033, CPU_TOKENS_033 = 1 << 30, 524288  # tests/e2e/observe_server.CPU_TIER_BYTES


def test_a_cache_whose_pods_export_their_cpu_capacity_gives_it_to_the_renderers():
    samples = page(TIERED_033)
    obs = observation(samples, samples, offloaded=("cpu", "storage"))
    doc = body({"router": {"enabled": True}})
    out = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=obs, observing=True)
    tpc = parse_tpc(doc)
    from kvtier_operator.engines.registry import adapter_for

    block = adapter_for(tpc.spec).router_block_size(tpc.spec)
    assert out.render_context is not None
    assert out.render_context.observed_cpu_blocks == CPU_TOKENS_033 // block
    cpu = next(t for t in out.status.tiers if t.name == "cpu")
    assert cpu.capacity_bytes == CPU_BYTES_033 and cpu.capacity_tokens == CPU_TOKENS_033
    capacity = out.status.router_capacity
    assert capacity is not None
    # the router's CPU LRU is the engine's own number, and status says so
    assert capacity.source == "engine"
    assert capacity.cpu_blocks == out.render_context.observed_cpu_blocks
    # without the export: no observed figure, the computed capacity
    plain = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=None, observing=True)
    assert plain.render_context.observed_cpu_blocks is None
    assert plain.status.router_capacity.source == "computed"
    assert plain.status.config_hash == out.status.config_hash  # pods are not restarted


def test_the_tier_gauges_carry_the_figures_and_drop_absent_ones():
    obs = observation(page("vllm-0.32-gpu-direct-b-idle.txt"),
                      page("vllm-0.32-gpu-direct-b-loaded.txt"))
    out = reconcile(body({"cpu": None}), FakeGateway(), CTX, [], [], NOW, observed=obs,
                    observing=True)
    metrics.export_tiers(("ml", "gauge-test"), out.status)
    assert metrics.TIER_HIT.labels("ml", "gauge-test", "storage")._value.get() == 96.0
    assert metrics.HIT.labels("ml", "gauge-test")._value.get() == 96.0
    assert ("ml", "gauge-test", "storage") not in metrics.TIER_FAILED_LOADS._metrics


def test_pod_view_finds_the_address_and_metrics_port():
    view = pod_view({"metadata": {"name": "p", "namespace": "ml",
                                  "annotations": {"kvtier.dev/metrics-port": "9100"}},
                     "spec": {"containers": [{"ports": [{"name": "http",
                                                         "containerPort": 8000}]}]},
                     "status": {"podIP": "10.0.0.7", "phase": "Running"}})
    assert view.metrics_url(8000) == "http://10.0.0.7:9100/metrics"
    named = pod_view({"metadata": {"name": "p"},
                      "spec": {"containers": [{"ports": [{"name": "http",
                                                          "containerPort": 8080}]}]},
                      "status": {"podIP": "fd00::1"}})
    assert named.metrics_url(8000) == "http://[fd00::1]:8080/metrics"
    assert pod_view({"metadata": {"name": "p"}}).metrics_url(8000) is None


def test_the_helm_values_reach_the_settings_and_zero_turns_it_off():
    from kvtier_operator.app import config_from_env

    on = config_from_env({"KVTIER_OBSERVE_INTERVAL_SECONDS": "45",
                          "KVTIER_OBSERVE_MAX_SERIES": "500"}).observe
    assert on.enabled and on.interval == 45 and on.max_series == 500 and on.timeout == 5
    assert not config_from_env({"KVTIER_OBSERVE_INTERVAL_SECONDS": "0"}).observe.enabled
    assert config_from_env({}).observe.interval == 30
    assert config_from_env({}).observe.prometheus_url is None
    assert config_from_env({"KVTIER_OBSERVE_PROMETHEUS_URL": "http://prom:9090"}
                           ).observe.prometheus_url == "http://prom:9090"


@pytest.mark.parametrize("name", sorted(p.name for p in PAGES.glob("vllm-*.txt")))
def test_parsing_only_the_families_read_gives_the_same_figures(name):
    """The observer hands the parser only the families the reader reads (a page is
    mostly histograms nobody reads here); the figures must not change."""
    from kvtier_operator.engines.vllm.metrics import FAMILIES

    text = (PAGES / name).read_text()
    for offloaded in (GPU_DIRECT, ("cpu", "storage")):
        every, only = (read(parse(text, 20000, families).samples, offloaded)
                       for families in (None, FAMILIES))
        assert (only.counters, only.gauges, only.histograms) == \
            (every.counters, every.gauges, every.histograms)
    capped = parse(text, 0, FAMILIES)  # the cap counts the whole page's series
    assert capped.problem and "more than 0 series" in capped.problem


def test_the_observer_reads_each_cache_s_injected_serving_pods():
    from kvtier_operator.handlers import OperatorConfig, observe_targets

    config = OperatorConfig(render=CTX)
    config.caches.observe("ADDED", body({"cpu": None}))

    def pod(name, cache="cache", ip="10.0.0.1", phase="Running", annotations=None):
        return pod_view({"metadata": {"name": name, "namespace": "ml", "uid": name,
                                      "annotations": {"kvtier.dev/cache": cache,
                                                      **(annotations or {})}},
                         "status": {"phase": phase, "podIP": ip}})

    pods = [pod("a"), pod("b", annotations={"kvtier.dev/metrics-port": "9400"}),
            pod("other", cache="elsewhere"), pod("pending", ip=""),
            pod("done", phase="Succeeded")]
    (cache,) = observe_targets(config, lambda ns: pods if ns == "ml" else [])
    assert (cache.namespace, cache.cache, cache.offloaded) == ("ml", "cache", ("storage",))
    assert [(t.pod, t.url) for t in cache.pods] == [
        ("a", "http://10.0.0.1:8000/metrics"), ("b", "http://10.0.0.1:9400/metrics")]


def test_advice_events_are_rate_limited_per_cache_and_reason():
    from kvtier_operator.handlers import OperatorConfig

    config = OperatorConfig(render=CTX, advice_event_gap=600)
    assert config.advice_due("ml", "cache", "LoadsFailing")
    assert not config.advice_due("ml", "cache", "LoadsFailing")  # within 10 minutes
    assert config.advice_due("ml", "cache", "CpuTierIdle")
    assert config.advice_due("ml", "other", "LoadsFailing")
    config.advice_event_gap = 0
    assert config.advice_due("ml", "cache", "LoadsFailing")


def test_the_cpu_tier_s_figures_on_pages_of_vllm_s_own_cpu_tier():
    """vLLM's CPU tier, its worker a no-op (tests/e2e/noop_cpu_spec.py): the prompt, the
    HBM prefix cache reset, the prompt again; the scheduler's figures are real."""
    tpc = parse_tpc(body({"storage": None}))
    obs = observation(page("vllm-0.32-cpu-tier-c-idle.txt"),
                      page("vllm-0.32-cpu-tier-c-hit.txt"), offloaded=("cpu",))
    out = observed_tiers(tpc, ("cpu",), obs, None, enabled=True)
    by = {t.name: t for t in out.tiers}
    assert list(by) == ["gpu", "cpu"]
    assert by["cpu"].hit_tokens == 192 and by["cpu"].hit_percent == 48.0
    assert by["gpu"].hit_percent == 0.0 and out.hit_percent == 48.0
    assert out.recompute.percent == 52.0
    assert by["cpu"].used_percent is not None  # vllm:kv_offload_cpu_cache_usage_perc
    assert by["cpu"].capacity_bytes is None and "0.33 does" in by["cpu"].unobserved
    assert out.cpu_capacity_tokens is None  # 0.32: the router keeps its computed figure


def test_the_cpu_tier_s_capacity_on_pages_of_vllm_0_33_s_own_cpu_tier():
    """0.33's CPU tier alone (CPUOffloadingSpec, no tier label) and under
    TieringOffloadingSpec (a series per tier, the storage tier's cpu_* empty, in either
    order): the capacity is the CPU tier's series."""
    from kvtier_operator.engines.vllm.metrics import CONFIG_INFO, cpu_capacity

    alone = page("vllm-0.33-cpu-tier-c-hit.txt")
    (labels, _), = alone[CONFIG_INFO]
    assert "tier" not in labels
    assert cpu_capacity(alone) == (CPU_BYTES_033, CPU_TOKENS_033, 16384)  # 1 block a chunk
    tiered = page(TIERED_033)
    assert {labels["tier"] for labels, _ in tiered[CONFIG_INFO]} == {
        "0:primary", "1:KvtierStorageTier"}
    assert cpu_capacity(tiered) == (CPU_BYTES_033, CPU_TOKENS_033, 8192 * 2)  # 64-token chunks
    flipped = {**tiered, CONFIG_INFO: list(reversed(tiered[CONFIG_INFO]))}
    assert cpu_capacity(flipped) == cpu_capacity(tiered)
    tpc = parse_tpc(body({"storage": None}))
    obs = observation(page("vllm-0.33-cpu-tier-c-idle.txt"), alone, offloaded=("cpu",))
    out = observed_tiers(tpc, ("cpu",), obs, None, enabled=True)
    by = {t.name: t for t in out.tiers}
    assert by["cpu"].hit_tokens == 192 and by["cpu"].hit_percent == 48.0
    assert by["cpu"].capacity_bytes == CPU_BYTES_033 and by["cpu"].used_percent is not None
    assert out.cpu_capacity_tokens == CPU_TOKENS_033


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_kvtier_s_tier_under_vllm_s_tiering_reports_through_vllm_s_stats(version):
    """kvtier's storage tier behind vLLM's CPU tier: its kvtier_offload_* counters come
    through vLLM's stats channel to /metrics; the CPU tier served the repeat."""
    tpc = parse_tpc(body())
    obs = observation(page(f"vllm-{version}-cpu-storage-t-idle.txt"),
                      page(f"vllm-{version}-cpu-storage-t-hit.txt"),
                      offloaded=("cpu", "storage"))
    out = observed_tiers(tpc, ("cpu", "storage"), obs, None, enabled=True)
    by = {t.name: t for t in out.tiers}
    assert list(by) == ["gpu", "cpu", "storage"]
    assert by["cpu"].hit_tokens == 192 and out.recompute.percent == 52.0
    assert by["storage"].bytes_stored == 3 * 64 * 2048  # three 64-token chunks stored
    assert by["storage"].failed_loads == 0  # observed: kvtier's counters are on the page
    # the CPU tier's size: 0.33 exports it, 0.32 does not (and says so)
    assert (by["cpu"].capacity_bytes == CPU_BYTES_033) == (version == "0.33")
    assert (out.cpu_capacity_tokens is None) == (version == "0.32")


def test_a_block_file_refused_on_load_is_a_failed_load():
    """kvtier counts a damaged or foreign block file in kvtier_offload_corrupt_files by
    reason, not as a load outcome; it failed all the same (vLLM recomputed it)."""
    text = (PAGES / TIERED_033).read_text() + (
        'kvtier_offload_operations_total{direction="load",engine="0",model_name="tiny",'
        'outcome="ok"} 5.0\n'
        'kvtier_offload_corrupt_files_total{engine="0",model_name="tiny",'
        'reason="bad-checksum"} 1.0\n')
    f = read(parse(text, 20000).samples, ("cpu", "storage"))
    assert f.counters[("failed_loads", "storage")] == 1
    assert f.counters[("loads", "storage")] == 6


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_the_volume_s_load_time_behind_a_cpu_tier_is_its_promotions(version):
    """A second server on the same volume, its CPU tier empty: vLLM promotes the prompt's
    blocks from kvtier's storage tier into the CPU tier. The storage tier's load time is
    vLLM's tiering read time for tier 1 (the first behind the CPU tier), and the advice
    "volume slower than recompute" weighs it against the engine's prefill time."""
    tpc = parse_tpc(body())  # cpu and storage
    tiers = ("cpu", "storage")
    idle, loaded = (page(f"vllm-{version}-cpu-storage-u-{n}.txt") for n in ("idle", "loaded"))
    f = read(loaded, tiers)
    promoted = sum(v for labels, v in loaded["vllm:kv_offload_tiering_read_time_total"]
                   if labels["tier"].startswith("1:"))
    assert f.counters[("load_time_seconds", "storage")] == promoted > 0
    assert f.counters[("hit_tokens", "storage")] == 192  # source "disk": the volume's
    obs = observation(idle, loaded, offloaded=tiers)
    out = observed_tiers(tpc, tiers, obs, None, enabled=True)
    by = {t.name: t for t in out.tiers}
    assert by["storage"].hit_tokens == 192 and by["cpu"].hit_tokens == 0
    # this tiny model's prefill (a few ms a token) is slower than the volume: no advice
    assert out.advice.reason != "VolumeSlowerThanRecompute"
    # an engine that computes a token in a microsecond: the same volume is slower
    computed = obs.window.counters[("recomputed_tokens", "")]
    obs.window.counters[("prefill_seconds", "")] = computed * 1e-6
    out = observed_tiers(tpc, tiers, obs, None, enabled=True)
    per_token = promoted / 192 * 1e6
    assert out.advice.reason == "VolumeSlowerThanRecompute", out.advice
    assert f"loading from the volume into the CPU tier takes {per_token:.1f} us per token, " \
           "computing 1.0 us" in out.advice.message


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_requests_that_skipped_a_slow_volume_are_counted_and_advised(version):
    """A GPU-direct server on a slow volume (every stat and open of a block file 1.5 s)
    that holds 24 prompts' blocks: after four warm-up prompts, each of the 24 recomputes
    rather than wait (lookup-wait) or load (load-slower), as kvtier's recompute bound
    decides; status.tiers[storage].skipped counts them, and the advice names the counts
    and the fix."""
    idle, skipped = (page(f"vllm-{version}-gpu-direct-s-{n}.txt") for n in ("idle", "skipped"))
    said = {labels["reason"]: v for labels, v in skipped["kvtier_offload_tier_skipped_total"]}
    requests = sum(v for _, v in skipped["vllm:request_prefill_time_seconds_count"])
    assert "kvtier_offload_tier_skipped_total" not in idle  # none before the first skip
    f = read(idle, GPU_DIRECT)
    assert ("skipped_requests", "storage") not in f.counters  # absent, not a zero
    obs = observation(idle, skipped)
    out = observed_tiers(gpu_direct_tpc(), GPU_DIRECT, obs, None, enabled=True)
    storage = {t.name: t for t in out.tiers}["storage"]
    total = int(sum(said.values()))
    assert storage.skipped is not None and storage.skipped.requests == total >= 20
    assert storage.skipped.lookup_wait == said.get("lookup-wait", 0)
    assert storage.skipped.load_slower == said.get("load-slower", 0)
    assert storage.skipped.percent == round(100 * total / requests, 2)
    assert out.advice.reason == "TierSkipped", out.advice
    assert f"{total} of {int(requests)} requests" in out.advice.message
    assert "recomputed rather than use the storage tier" in out.advice.message
    if said.get("load-slower"):
        assert "a faster volume" in out.advice.message
    if said.get("lookup-wait"):
        assert "faster lookups" in out.advice.message
    # the gauge carries it; a tier without the figure has no sample
    metrics.export_tiers(("ml", "skips"), reconcile(
        body({"cpu": None}), FakeGateway(), CTX, [], [], NOW, observed=obs,
        observing=True).status)
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("kvtier_tier_skipped_requests", {
        "namespace": "ml", "cache": "skips", "tier": "storage"}) == total
    assert REGISTRY.get_sample_value("kvtier_tier_skipped_requests", {
        "namespace": "ml", "cache": "skips", "tier": "gpu"}) is None


def test_a_tier_skipped_by_few_requests_is_no_advice():
    """Under 20% of the requests, or fewer than 20 requests: counted, not advice."""
    tpc = gpu_direct_tpc()

    def advice(skipped, requests):
        w = WindowSum(counters={("prompt_tokens", ""): 5000.0,
                                ("recomputed_tokens", ""): 5000.0,
                                ("requests", ""): requests,
                                ("skipped_requests", "storage"): skipped,
                                ("skipped_requests:load-slower", "storage"): skipped},
                      pods_with_steps=1)
        obs = CacheObservation(window=w, pods_read=1, pods_unreadable=0, problems=[],
                               observed_at=NOW, reads=True, pods_selected=1)
        return observed_tiers(tpc, GPU_DIRECT, obs, None, enabled=True).advice

    assert advice(4.0, 20.0).reason != "TierSkipped"  # 20%: not over
    assert advice(5.0, 19.0).reason != "TierSkipped"  # too few requests to judge
    assert advice(5.0, 20.0).reason == "TierSkipped"


def test_a_pod_s_figures_come_back_from_the_reading_process_whole():
    """The reading process packs each pod's result on its own (the operator unpacks them
    between turns of its loop); anything else it might send is refused."""
    import pickle

    from kvtier_operator.observe.reads import ReadResult, pack, unpack

    figures = read(page("vllm-0.32-gpu-direct-b-loaded.txt"), GPU_DIRECT)
    back = unpack(pack(ReadResult(figures)))
    assert back.figures == figures and back.problem is None
    assert unpack(pack(ReadResult(problem="port closed"))).problem == "port closed"
    with pytest.raises(TypeError, match="sent a dict"):
        unpack(pickle.dumps({"figures": figures}))
