"""Figures that cannot be wrong (issue #32): counter resets, series that come and go,
pods without one part of a share, sums that overflow, the window's span, and a pod
back after a gap longer than the window. Each builds the pods' reads as the observer
would and checks what reaches status."""

from __future__ import annotations

import pytest

from kvtier_operator.engines.vllm.metrics import read
from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.observe.window import OVERFLOW, PARTIAL, PodHistory, WindowSum
from kvtier_operator.reconcile import reconcile
from kvtier_operator.status import observed_tiers
from tests.helpers import example
from tests.operator.unit.test_observe import gpu_direct_tpc, observation, page
from tests.operator.unit.test_observe_file_tiers import kvtier_tpc, offloaded, summed
from tests.operator.unit.test_reconcile import CTX, NOW, FakeGateway

WINDOW = 300.0


def samples(prompt: float, host: float) -> dict:
    """A vLLM page's token counters: prompt tokens, and those cached from the CPU (host)."""
    return {"vllm:prompt_tokens_total": [({}, prompt)],
            "vllm:prompt_tokens_by_source_total": [({"source": "local_compute"}, 0.0)],
            "vllm:prompt_tokens_cached_by_source_total": [
                ({"source": "host"}, host), ({"source": "device"}, 0.0)]}


def history(*reads: tuple[float, dict]) -> PodHistory:
    h = PodHistory()
    for at, page_samples in reads:
        h.add(at, read(page_samples, offloaded(kvtier_tpc())), WINDOW)
    return h


def status_of(*pods: PodHistory, now: float):
    w = WindowSum()
    for h in pods:
        w.add(h, now)
    obs = CacheObservation(window=w, pods_read=len(pods), pods_unreadable=0, problems=[],
                           observed_at=NOW, reads=True, pods_selected=len(pods))
    tpc = kvtier_tpc()
    return observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True)


def by_name(out) -> dict:
    return {t.name: t for t in out.tiers}


def test_window_seconds_is_the_span_from_the_baseline_read():
    obs = observation(page("vllm-0.32-gpu-direct-b-idle.txt"),
                      page("vllm-0.32-gpu-direct-b-loaded.txt"))
    out = observed_tiers(gpu_direct_tpc(), ("storage",), obs, None, enabled=True)
    assert out.observation.window_seconds == 30.0


def test_a_series_missing_from_one_read_adds_none_of_its_lifetime():
    nan = samples(1_000_100, 0)
    nan["vllm:prompt_tokens_cached_by_source_total"][0] = ({"source": "host"}, float("nan"))
    out = status_of(history((0, samples(1_000_000, 500_000)), (30, nan),
                            (60, samples(1_000_200, 500_050))), now=60)
    cpu = by_name(out)["cpu"]
    assert cpu.hit_percent is None and cpu.hit_tokens is None
    assert PARTIAL in cpu.unobserved
    assert out.hit_percent is None
    assert out.recompute.prompt_tokens == 200


def test_a_series_back_after_a_read_without_it_is_a_baseline_not_an_increase():
    gone = samples(1100, 0)
    del gone["vllm:prompt_tokens_cached_by_source_total"]
    h = history((0, samples(1000, 90_000)), (30, gone), (60, samples(1200, 90_050)))
    h.add(90, read(samples(1300, 90_100), offloaded(kvtier_tpc())), WINDOW)
    # the series vanished at 30 s and came back at 60 s: its first increase is from 60
    # to 90 s, and its share is taken over that step only (50 of 100 prompt tokens)
    cpu = by_name(status_of(h, now=90))["cpu"]
    assert cpu.hit_tokens == 50 and cpu.hit_percent == 50.0
    assert status_of(h, now=90).recompute.prompt_tokens == 300


def test_a_series_the_process_creates_between_reads_counts_from_zero():
    # engines create a counter at its first event (vLLM's kv_offload_*, a new source)
    fresh = samples(1000, 0)
    del fresh["vllm:prompt_tokens_cached_by_source_total"]
    cpu = by_name(status_of(history((0, fresh), (30, samples(1100, 50))), now=30))["cpu"]
    assert cpu.hit_tokens == 50 and cpu.hit_percent == 50.0


def test_a_pod_without_prompt_tokens_adds_nothing_to_the_shares():
    a = history((0, samples(0, 0)), (30, samples(100, 50)))
    no_prompt = [samples(0, 0), samples(1000, 1000)]
    for s in no_prompt:
        s["vllm:prompt_tokens_total"] = [({}, float("nan"))]
    b = history((0, no_prompt[0]), (30, no_prompt[1]))
    out = status_of(a, b, now=30)
    assert out.hit_percent == 50.0
    assert by_name(out)["cpu"].hit_percent == 50.0


def test_a_negative_counter_is_left_out_never_a_negative_figure():
    out = status_of(history((0, samples(1000, 500)), (30, samples(2000, -5e9))), now=30)
    cpu = by_name(out)["cpu"]
    assert cpu.hit_percent is None and cpu.hit_tokens is None
    assert out.hit_percent is None
    assert out.recompute.prompt_tokens == 1000


def test_a_restart_makes_every_counter_of_the_pod_a_new_baseline():
    # restarted between 0 and 30 s: prompt tokens grew past the old value, hits did not
    h = history((0, samples(1000, 900)), (30, samples(1100, 800)))
    out = status_of(h, now=30)
    assert out.hit_percent is None and out.recompute.prompt_tokens is None
    h.add(60, read(samples(1200, 850), offloaded(kvtier_tpc())), WINDOW)
    out = status_of(h, now=60)
    assert out.hit_percent == 50.0
    assert out.recompute.prompt_tokens == 100
    assert out.observation.window_seconds == 30.0


def test_a_pod_back_after_longer_than_the_window_starts_a_new_baseline():
    h = history((0, samples(0, 0)), (3600, samples(360_000, 180_000)))
    out = status_of(h, now=3600)
    assert out.recompute.prompt_tokens is None
    assert out.observation.window_seconds is None
    h.add(3630, read(samples(360_100, 180_050), offloaded(kvtier_tpc())), WINDOW)
    out = status_of(h, now=3630)
    assert out.recompute.prompt_tokens == 100 and out.observation.window_seconds == 30.0


def test_sums_that_overflow_are_missing_with_why_never_an_error():
    def huge(v: float) -> dict:
        s = samples(1000, 0)
        s["vllm:kv_offload_load_bytes_total"] = [({}, v)]
        return s

    pods = [history((0, huge(0.0)), (30, huge(1e308))) for _ in range(2)]
    out = status_of(*pods, now=30)
    cpu = by_name(out)["cpu"]
    assert cpu.bytes_loaded is None and OVERFLOW in cpu.unobserved
    assert out.recompute.prompt_tokens == 0


def test_shares_stay_within_0_and_100():
    out = observed_tiers(kvtier_tpc(), offloaded(kvtier_tpc()),
                         summed({("prompt_tokens", ""): 400.0, ("hit_tokens", "cpu"): 500.0}),
                         None, enabled=True)
    assert by_name(out)["cpu"].hit_percent == 100.0 and out.hit_percent == 100.0


def test_reconcile_writes_status_from_figures_that_are_not_finite():
    doc = example("native-kvtier.yaml")
    doc["metadata"].update(uid="u-1", generation=1)
    obs = summed({("prompt_tokens", ""): 400.0, ("bytes_loaded", "cpu"): float("inf")})
    status = reconcile(doc, FakeGateway(), CTX, [], [], NOW, observed=obs,
                       observing=True).status
    cpu = {t.name: t for t in status.tiers}["cpu"]
    assert cpu.bytes_loaded is None and OVERFLOW in cpu.unobserved


def test_reconcile_goes_on_when_the_figures_cannot_be_made_into_status(monkeypatch):
    from kvtier_operator import status as status_module

    def overflow(*_args: object) -> None:
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(status_module, "_observed_tiers", overflow)
    doc = example("native-kvtier.yaml")
    doc["metadata"].update(uid="u-1", generation=1)
    outcome = reconcile(doc, FakeGateway(), CTX, [], [], NOW,
                        observed=summed({("prompt_tokens", ""): 400.0}), observing=True)
    readable = {c.type: c for c in outcome.status.conditions}["MetricsReadable"]
    assert readable.status == "Unknown" and readable.reason == "FiguresUnusable"


@pytest.mark.parametrize("part,whole", [(1.0, 0.0), (-1.0, 10.0), (float("nan"), 1.0),
                                        (1.0, float("inf"))])
def test_no_share_without_a_positive_finite_whole_and_part(part: float, whole: float):
    from kvtier_operator.status import _pct
    assert _pct(part, whole) is None


def test_tiers_counted_together_are_derived_even_with_no_tokens():
    from tests.operator.unit.test_observe_file_tiers import local_disk_tpc
    tpc = local_disk_tpc()
    obs = summed({("prompt_tokens", ""): 400.0, ("recomputed_tokens", ""): 400.0,
                  ("shared_hit_tokens", "localDisk,storage"): 0.0})
    tiers = by_name(observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True))
    assert tiers["localDisk"].hit_percent == 0.0
    assert tiers["localDisk"].hit_source == tiers["storage"].hit_source == "derived"
