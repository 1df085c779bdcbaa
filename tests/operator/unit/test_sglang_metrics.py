"""The SGLang reader (#32) on pages that SGLang 0.5.23's own metrics collectors wrote
(tests/fixtures/metrics/sglang-*.txt, by scripts/capture_sglang_metrics.py: two TP ranks
with HiCache's host tier and file tier; a 200-token prompt answered cold, from the host
tier, then from the file tier; 256 KV bytes per token per rank)."""

from __future__ import annotations

import pytest

from kvtier_operator.engines.sglang.metrics import FAMILIES, NOT_ENABLED, read
from kvtier_operator.observe.page import parse
from kvtier_operator.observe.window import PodHistory, WindowSum
from tests.helpers import ROOT

PAGES = ROOT / "tests" / "fixtures" / "metrics"
HIT, IDLE = "sglang-0.5.23-hicache-hit.txt", "sglang-0.5.23-hicache-idle.txt"
TIERS = ("cpu", "storage")


def samples(name: str, families: frozenset[str] | None = None):
    parsed = parse((PAGES / name).read_text(), 20000, families)
    assert parsed.problem is None and parsed.samples
    return parsed.samples


def test_every_family_the_reader_reads_is_on_sglang_s_own_page():
    names = set(samples(HIT))
    for family in FAMILIES:
        assert {family, f"{family}_total", f"{family}_bucket"} & names, family


def test_hit_shares_bytes_and_capacity_from_sglang_s_own_page():
    f = read(samples(HIT), TIERS)
    assert f.counters[("prompt_tokens", "")] == 600
    assert f.counters[("hit_tokens", "gpu")] == 0
    assert f.counters[("hit_tokens", "cpu")] == 192
    assert f.counters[("hit_tokens", "storage")] == 192
    assert f.counters[("recomputed_tokens", "")] == 600 - 2 * 192
    # bytes are per rank's shard: summed over both ranks (2 loads of 192 tokens each)
    assert f.counters[("bytes_loaded", "cpu")] == 2 * 2 * 192 * 256
    assert f.counters[("bytes_stored", "cpu")] == 2 * 192 * 256
    # the host tier's capacity is on the scheduler's series of rank 0 only
    assert f.gauges[("capacity_tokens", "cpu")] == 4096
    assert f.gauges[("used_percent", "cpu")] == pytest.approx(100 * 192 / 4096)
    hist = dict(f.histograms[("load_seconds", "cpu")])
    assert hist[0.001] == 0 and hist[0.002] == hist[float("inf")] == 4
    assert f.missing[("bytes_loaded", "storage")].startswith("SGLang exports tokens")


def test_a_page_before_the_first_request_says_why_the_tokens_are_missing():
    f = read(samples(IDLE), TIERS)
    assert ("prompt_tokens", "") not in f.counters
    assert f.missing[("prompt_tokens", "")] == NOT_ENABLED
    assert "no request finished yet" in NOT_ENABLED
    assert f.gauges[("capacity_tokens", "cpu")] == 4096
    assert f.gauges[("used_percent", "cpu")] == 0


@pytest.mark.parametrize("name", [HIT, IDLE])
def test_parsing_only_the_families_read_gives_the_same_figures(name):
    every, only = (read(samples(name, families), TIERS) for families in (None, FAMILIES))
    assert (only.counters, only.gauges, only.histograms, only.missing) == \
        (every.counters, every.gauges, every.histograms, every.missing)


def test_a_window_from_before_the_first_request_counts_every_token_since():
    """SGLang creates its token series at the first request: a pod read before it and
    after counts the whole of them over the window (the pod had a baseline read)."""
    history = PodHistory()
    for i, name in enumerate((IDLE, HIT)):
        history.add(30.0 * i, read(samples(name), TIERS), window=300)
    window = WindowSum()
    window.add(history, 30.0)
    assert window.counters[("prompt_tokens", "")] == 600
    assert window.counters[("hit_tokens", "cpu")] == window.counters[("hit_tokens", "storage")] == 192
    assert window.counters[("bytes_loaded", "cpu")] == 2 * 2 * 192 * 256
    assert window.gauges[("capacity_tokens", "cpu")] == [4096]
