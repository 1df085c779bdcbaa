"""The recompute bound's pricing on fake clocks: the engine's prefill rate from its steps,
and when a request stops waiting for the tier (recompute_bound.py)."""

from __future__ import annotations

import pytest

from kvtier_offload.recompute_bound import (
    LOAD_SLOWER,
    LOOKUP_WAIT,
    SLACK,
    PrefillRate,
    Rate,
    RequestWait,
    load_slower,
    stop_waiting,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prefill_at(seconds_per_token: float) -> Rate:
    rate = Rate()
    rate.add(seconds_per_token, 1)
    return rate


def test_a_prefill_step_is_timed_from_its_scheduling_to_its_output():
    clock = Clock()
    rate = PrefillRate(clock)
    rate.step_scheduled(1000, 1000)
    clock.now += 0.5
    rate.step_done()
    assert rate.seconds(1000) == pytest.approx(0.5)


def test_empty_steps_are_not_paired_with_a_later_steps_output():
    """vLLM hands out an empty step whenever a request's lookups are deferred, and its
    output comes back only where the connector had work: the next real step is still
    timed by its own output."""
    clock = Clock()
    rate = PrefillRate(clock)
    for _ in range(3):
        rate.step_scheduled(0, 0)
        clock.now += 0.01
    rate.step_scheduled(200, 200)
    clock.now += 0.2
    rate.step_done()
    assert rate.seconds(200) == pytest.approx(0.2)


def test_decode_steps_are_not_prefill_samples():
    clock = Clock()
    rate = PrefillRate(clock)
    rate.step_scheduled(8, 0)  # eight decodes: the step's fixed cost, not prefill
    clock.now += 0.2
    rate.step_done()
    assert rate.seconds(100) is None


def test_pipelined_steps_pair_in_order_and_never_overlap():
    """A scheduler that hands out the next step before the last returns: the second is
    timed from the first one's end, not from when it was handed out."""
    clock = Clock()
    rate = PrefillRate(clock, weight=1.0)
    rate.step_scheduled(100, 100)
    rate.step_scheduled(400, 400)
    clock.now += 0.1
    rate.step_done()  # the first: 0.1 s for 100 tokens
    assert rate.seconds(1) == pytest.approx(0.001)
    clock.now += 0.4
    rate.step_done()  # the second ran from 100.1 to 100.5: 0.4 s for 400 tokens
    assert rate.seconds(1) == pytest.approx(0.001)
    rate.step_done()  # nothing outstanding: no sample, no error
    assert rate.seconds(1) == pytest.approx(0.001)


def test_without_a_prefill_rate_nothing_is_decided():
    wait = RequestWait(started=0.0, start=0, end=4000)
    assert stop_waiting(wait, 99.0, Rate(), None, None) is None


def test_lookups_wait_while_the_hit_can_still_pay_for_the_wait():
    """4000 tokens at 1 ms each: recompute costs 4 s, a load 1 s, so waiting up to
    3 s (plus the slack) can still pay off; past that, recompute."""
    prefill, load = prefill_at(0.001), 1.0  # seconds to load the 4000 tokens
    wait = RequestWait(started=10.0, start=0, end=4000)
    budget = 4.0 - 1.0 + SLACK * 4.0
    assert stop_waiting(wait, 10.0 + budget - 0.01, prefill, load, None) is None
    assert stop_waiting(wait, 10.0 + budget + 0.01, prefill, load, None) == LOOKUP_WAIT


def test_a_volume_slower_than_the_budget_is_given_up_at_once():
    """The volume's measured round trips say the answers come after recompute would
    be done: stop now rather than wait for the budget to run out."""
    prefill, load = prefill_at(0.001), None
    wait = RequestWait(started=10.0, start=0, end=200)  # recompute: 0.2 s
    assert stop_waiting(wait, 10.0, prefill, load, expected_wait=0.5) == LOOKUP_WAIT
    assert stop_waiting(wait, 10.0, prefill, load, expected_wait=0.05) is None


def test_a_load_slower_than_recompute_is_skipped_even_when_every_key_is_there():
    prefill = prefill_at(0.001)
    assert load_slower(1000, prefill, 2.0)
    wait = RequestWait(started=10.0, start=0, end=1000)
    assert stop_waiting(wait, 10.0, prefill, 2.0, expected_wait=0.0) == LOAD_SLOWER
    assert not load_slower(1000, prefill, 0.5)
    assert not load_slower(1000, prefill, None)  # loads unmeasured: no verdict


def test_the_budget_grows_with_the_tokens_at_stake():
    """The same wait that is too long for a short prompt is worth it for a long one."""
    prefill, load = prefill_at(0.001), None
    short = RequestWait(started=0.0, start=0, end=100)
    long = RequestWait(started=0.0, start=0, end=10_000)
    assert stop_waiting(short, 0.5, prefill, load, None) == LOOKUP_WAIT
    assert stop_waiting(long, 0.5, prefill, load, None) is None
    partly_computed = RequestWait(started=0.0, start=9_900, end=10_000)
    assert partly_computed.at_stake == 100
    assert stop_waiting(partly_computed, 0.5, prefill, load, None) == LOOKUP_WAIT


def test_a_tier_times_a_prompt_from_its_first_step_to_its_last_chunk():
    """Tier mode (PromptTimes): scheduled, then its chunks cascaded in two jobs, then
    finished: one sample over the span the chunks cover."""
    from kvtier_offload.recompute_bound import PromptTimes

    clock = Clock()
    times = PromptTimes(clock)
    times.scheduled(["a"])
    clock.now += 0.2
    times.stored("a", 0, 256)
    clock.now += 0.2
    times.stored("a", 256, 512)
    assert times.seconds(512) is None  # not before the request finished
    times.finished("a")
    assert times.seconds(512) == pytest.approx(0.4)


def test_a_tier_keeps_no_sample_of_a_request_it_never_saw_scheduled_or_store():
    from kvtier_offload.recompute_bound import PromptTimes

    clock = Clock()
    times = PromptTimes(clock)
    times.stored("unseen", 0, 512)  # its scheduling step was never seen
    times.finished("unseen")
    times.scheduled(["hit"])  # a full hit: nothing computed, nothing cascaded
    clock.now += 1.0
    times.finished("hit")
    times.scheduled(["short"])
    times.stored("short", 0, 8)  # under min_tokens
    times.finished("short")
    assert times.per_unit is None


def test_the_decision_is_the_requests_until_it_finishes():
    """RequestWaits: a request that stopped waiting misses past its cut; another request,
    or the same id after it finished, starts over."""
    from kvtier_offload.recompute_bound import RequestWaits

    clock = Clock()
    skipped: list[str] = []
    waits = RequestWaits(prefill_at(0.001), 32, skipped.append, clock)

    def pending(patient: bool) -> bool | None:
        assert patient  # the prefill rate is measured: the bound decides
        return None

    assert waits.answer("r", 64, pending, lambda t: None, lambda: None) is None
    clock.now += 1.0  # 64 tokens cost 64 ms to recompute
    assert waits.answer("r", 64, pending, lambda t: None, lambda: None) is False
    assert waits.answer("r", 96, lambda p: True, lambda t: None, lambda: None) is False
    assert skipped == [LOOKUP_WAIT]
    assert waits.answer("other", 64, lambda p: True, lambda t: None, lambda: None) is True
    waits.finished("r")
    assert waits.answer("r", 64, lambda p: True, lambda t: None, lambda: None) is True


def test_a_tier_priced_slower_than_recompute_is_still_tried_now_and_then():
    """A tier priced slower than recompute (here by the round-trip estimate, before any
    load was measured) is tried by the first such request and then one in PROBE_EVERY:
    otherwise it is never loaded from, its real load rate never measured, and a price
    that was wrong shuts it out for good (GlusterFS with a writer: estimated slower,
    measured 0.46x recompute end to end)."""
    from kvtier_offload.recompute_bound import PROBE_EVERY, RequestWaits

    clock = Clock()
    skipped: list[str] = []
    waits = RequestWaits(prefill_at(0.001), 32, skipped.append, clock)
    slower = lambda tokens: 1.0  # noqa: E731 (1 s for 64 tokens recomputed in 64 ms)
    answers = [waits.answer(f"r{i}", 64, lambda p: True, slower, lambda: None)
               for i in range(2 * PROBE_EVERY + 1)]
    tried = [i for i, a in enumerate(answers) if a]
    assert tried == [0, PROBE_EVERY, 2 * PROBE_EVERY]
    assert skipped == [LOAD_SLOWER] * (len(answers) - 3)
    # the decision is the request's: a probe keeps loading its later keys
    assert waits.answer("r0", 96, lambda p: True, slower, lambda: None) is True
    assert waits.answer("r1", 96, lambda p: True, slower, lambda: None) is False


def test_an_engines_costly_first_prefill_does_not_inflate_the_recompute_price():
    """The first prefill pays one-time costs (here 10x); priced at the median of recent
    prompts, recompute looks no dearer than it is, so no request waits on that account."""
    from kvtier_offload.recompute_bound import PromptTimes

    clock = Clock()
    times = PromptTimes(clock)
    for n, seconds in enumerate((10.0, 1.0, 1.0)):
        times.scheduled([f"r{n}"])
        clock.now += seconds
        times.stored(f"r{n}", 0, 1000)
        times.finished(f"r{n}")
    assert times.seconds(1000) == pytest.approx(1.0)


def test_before_any_load_a_file_is_priced_at_a_few_round_trips():
    from kvtier_offload.recompute_bound import LOAD_TRIPS, load_estimate

    # 8 files of 32 tokens on 2 threads, 10 ms a stat: 4 files each, LOAD_TRIPS trips each
    assert load_estimate(256, Rate(), 0.01, 32, 2) == pytest.approx(LOAD_TRIPS * 0.04)
    assert load_estimate(256, prefill_at(0.001), 0.01, 32, 2) == pytest.approx(0.256)
    assert load_estimate(256, Rate(), None, 32, 2) is None


def test_after_a_request_found_the_answers_too_late_the_next_ones_do_not_wait():
    """A volume whose answers came after recompute would have ended for one request:
    the next requests stop at their first unanswered key, at once, rather than spend
    their own budget to learn the same (a loaded runner: each request waited, then
    recomputed, 1.25x tier off). Keys already answered before it still load."""
    from kvtier_offload.recompute_bound import RequestWaits

    clock = Clock()
    skipped: list[str] = []
    waits = RequestWaits(prefill_at(0.001), 32, skipped.append, clock)
    pending = lambda patient: None  # noqa: E731
    free = lambda tokens: None  # noqa: E731
    assert waits.answer("r0", 64, pending, free, lambda: None) is None  # waits
    clock.now += 1.0  # far past 64 ms of recompute
    assert waits.answer("r0", 64, pending, free, lambda: None) is False
    assert waits.late
    # the next request: its first key answered from the cache loads, its second
    # (unanswered) is recomputed without a wait, though nothing prices it as late
    assert waits.answer("r1", 32, lambda p: True, free, lambda: None) is True
    assert waits.answer("r1", 64, pending, free, lambda: 0.0) is False
    assert waits.answer("r1", 96, lambda p: True, free, lambda: 0.0) is False
    assert skipped == [LOOKUP_WAIT, LOOKUP_WAIT]
    assert waits.get("r1").cut == 32


def test_requests_wait_again_once_one_of_them_is_answered_in_time():
    """While the answers came too late, one request in PROBE_EVERY waits all the same;
    answered within its budget, it shows the volume recovered: the next ones wait."""
    from kvtier_offload.recompute_bound import PROBE_EVERY, RequestWaits

    clock = Clock()
    skipped: list[str] = []
    waits = RequestWaits(prefill_at(0.001), 32, skipped.append, clock)
    pending = lambda patient: None  # noqa: E731
    free = lambda tokens: None  # noqa: E731
    waits.answer("late", 64, pending, free, lambda: None)
    clock.now += 1.0
    assert waits.answer("late", 64, pending, free, lambda: None) is False
    answers = [waits.answer(f"r{i}", 64, pending, free, lambda: 0.0)
               for i in range(1, PROBE_EVERY + 1)]
    assert answers == [False] * (PROBE_EVERY - 1) + [None]  # the last one probes
    probe = f"r{PROBE_EVERY}"
    clock.now += 0.01  # answered within its 67 ms
    assert waits.answer(probe, 64, lambda p: True, free, lambda: 0.0) is True
    assert not waits.late
    assert waits.answer("next", 64, pending, free, lambda: 0.0) is None  # waits again
    assert skipped == [LOOKUP_WAIT] * PROBE_EVERY


def test_before_the_recompute_price_settles_a_request_waits_a_short_while_at_most():
    """One prompt timed (an engine's first, dear with one-time costs) prices recompute
    at 10 s here; until PREFILL_SETTLED samples are in, a request waits on lookups
    FIRST_WAIT at most, and that unpriced give-up says nothing of the volume (the next
    request waits as usual). Settled, the priced budget decides."""
    from kvtier_offload.recompute_bound import FIRST_WAIT, PREFILL_SETTLED, RequestWaits

    clock = Clock()
    prefill = Rate(window=5)
    prefill.add(10.0, 1000)  # 10 ms a token: 64 tokens 0.64 s
    skipped: list[str] = []
    waits = RequestWaits(prefill, 32, skipped.append, clock)
    pending = lambda patient: None  # noqa: E731
    free = lambda tokens: None  # noqa: E731
    assert waits.answer("first", 64, pending, free, lambda: 0.0) is None
    clock.now += FIRST_WAIT / 2
    assert waits.answer("first", 64, pending, free, lambda: 0.0) is None
    clock.now += FIRST_WAIT
    assert waits.answer("first", 64, pending, free, lambda: 0.0) is False
    assert skipped == [LOOKUP_WAIT] and not waits.late
    assert waits.answer("second", 64, pending, free, lambda: 0.0) is None
    for _ in range(PREFILL_SETTLED - 1):
        prefill.add(10.0, 1000)
    clock.now += 2 * FIRST_WAIT  # settled: within the 0.67 s budget
    assert waits.answer("second", 64, pending, free, lambda: 0.0) is None


def test_a_probe_that_finds_nothing_to_load_leaves_the_probe_to_the_next_request():
    """An engine's first requests (its warm-ups) find nothing on the volume: a probe
    spent on them measures no load, and every later request would be priced on the
    round-trip estimate alone (GlusterFS with a writer: skipped in every round, the
    load never measured). The probe passes to the next request priced slower, until
    one has a key there to load; then the next probe is PROBE_EVERY requests on."""
    from kvtier_offload.recompute_bound import PROBE_EVERY, RequestWaits

    clock = Clock()
    skipped: list[str] = []
    waits = RequestWaits(prefill_at(0.001), 32, skipped.append, clock)
    slower = lambda tokens: 1.0  # noqa: E731 (1 s for 64 tokens recomputed in 64 ms)
    missing = lambda patient: False  # noqa: E731
    assert [waits.answer(f"w{i}", 64, missing, slower, lambda: None)
            for i in range(3)] == [False] * 3  # misses, not skips
    assert skipped == []
    assert waits.answer("r0", 64, lambda p: True, slower, lambda: None) is True  # probes
    answers = [waits.answer(f"r{i}", 64, lambda p: True, slower, lambda: None)
               for i in range(1, PROBE_EVERY + 1)]
    assert [i + 1 for i, a in enumerate(answers) if a] == [PROBE_EVERY - 3]
    # a probe cut before any answer (its lookups too late) passes it on as well
    waits2 = RequestWaits(prefill_at(0.001), 32, skipped.append, clock)
    assert waits2.answer("p", 64, lambda p: None, slower, lambda: None) is None
    clock.now += 1.0
    assert waits2.answer("p", 64, lambda p: None, slower, lambda: None) is False
    assert waits2.answer("q", 64, lambda p: True, slower, lambda: None) is True


def test_a_requests_first_lookup_is_priced_with_its_whole_prefix_at_stake():
    """vLLM asks a prefix key by key, but records every key's position first: priced at
    the first key alone, one chunk's recompute (64 ms) is cheaper than three round
    trips (90 ms), and every request on a network volume was decided against the tier
    there; priced over the 16 keys the engine recorded, the load (8 rounds of 2
    threads, 0.72 s) beats recompute (1.02 s)."""
    from kvtier_offload.recompute_bound import RequestWaits, load_estimate

    clock = Clock()
    skipped: list[str] = []
    waits = RequestWaits(prefill_at(0.001), 64, skipped.append, clock)
    price = lambda tokens: load_estimate(tokens, Rate(), 0.03, 64, 2)  # noqa: E731
    there = lambda patient: True  # noqa: E731
    assert waits.answer("probe", 64, there, price, lambda: None) is True  # spends it
    assert waits.answer("alone", 64, there, price, lambda: None) is False
    assert waits.answer("whole", 64, there, price, lambda: None, lambda: 1024) is True
    assert waits.get("whole").at_stake == 1024
    assert skipped == [LOAD_SLOWER]


def test_a_request_priced_late_before_it_waited_leaves_the_next_ones_to_their_price():
    """Stopped at its first lookup by the price alone (the expected wait past its
    budget), a request learned nothing a later one's price would not: only a request
    that spent a wait and still came too late makes the next ones stop unpriced."""
    from kvtier_offload.recompute_bound import RequestWaits

    clock = Clock()
    waits = RequestWaits(prefill_at(0.001), 32, lambda reason: None, clock)
    pending = lambda patient: None  # noqa: E731
    free = lambda tokens: None  # noqa: E731
    assert waits.answer("r0", 64, pending, free, lambda: 1.0) is False
    assert not waits.late
    assert waits.answer("r1", 64, pending, free, lambda: 0.0) is None


def settled(seconds_per_token: float) -> Rate:
    """A prefill price past PREFILL_SETTLED samples (no first-wait cap)."""
    rate = Rate(window=5)
    for _ in range(5):
        rate.add(seconds_per_token, 1)
    return rate


def test_a_wait_is_worth_only_what_hits_have_been_finding():
    """Prompts never stored, each miss answered after 3 s, recompute 4 s (4,000 tokens
    at 1 ms): priced as a sure hit, every request waited 3 s to learn it was a miss,
    then recomputed (1.75x tier off). A wait is worth a hit's saving times the share of
    requests whose first answer was a hit: after one miss, the next requests do not
    wait a 3 s answer; once hits come back, they wait again."""
    from kvtier_offload.recompute_bound import RequestWaits

    clock = Clock()
    skipped: list[str] = []
    waits = RequestWaits(settled(0.001), 64, skipped.append, clock)
    load = lambda tokens: 0.0001 * tokens  # noqa: E731
    whole = lambda: 4000  # noqa: E731
    pending = lambda patient: None  # noqa: E731
    assert waits.answer("r0", 64, pending, load, lambda: 3.0, whole) is None  # waits
    clock.now += 3.0
    assert waits.answer("r0", 64, lambda p: False, load, lambda: 3.0, whole) is False
    waits.finished("r0")
    for r in range(1, 5):  # decided at once: the wait is no longer worth 3 s
        assert waits.answer(f"r{r}", 64, pending, load, lambda: 3.0, whole) is False
        waits.finished(f"r{r}")
    assert skipped == [LOOKUP_WAIT] * 4
    # hits answered at once bring the share back: a 1 s answer is worth waiting again
    for r in range(5, 15):
        assert waits.answer(f"r{r}", 64, lambda p: True, load, lambda: 0.0, whole) is True
        waits.finished(f"r{r}")
    assert waits.answer("r15", 64, pending, load, lambda: 1.0, whole) is None


def test_a_preempted_request_starts_a_wait_of_its_own():
    """A request that waited and was answered in time, preempted, scheduled again 30 s
    later with a key pending: kept, its first lookup's start made the wait look longer
    than any budget at once and set `late` for the next requests on a healthy volume.
    vLLM names preempted requests at each step's end (ScheduleEndContext)."""
    from kvtier_offload.recompute_bound import PROBE_EVERY, RequestWaits

    clock = Clock()
    waits = RequestWaits(settled(0.001), 64, lambda reason: None, clock)
    free = lambda tokens: None  # noqa: E731
    fast = lambda: 0.01  # noqa: E731
    whole = lambda: 4000  # noqa: E731
    assert waits.answer("a", 64, lambda p: None, free, fast, whole) is None
    clock.now += 0.01
    assert waits.answer("a", 64, lambda p: True, free, fast, whole) is True
    waits.preempted(["a"])
    clock.now += 30.0
    assert waits.answer("a", 128, lambda p: None, free, fast, whole) is None  # waits
    assert not waits.late
    assert [waits.answer(f"b{i}", 64, lambda p: None, free, fast, whole)
            for i in range(PROBE_EVERY - 1)] == [None] * (PROBE_EVERY - 1)


def test_recorded_end_of_an_unknown_shape_is_unknown():
    """vLLM's key positions are private: reshaped, the whole-prefix price is lost, never
    the scheduler's call (int() of a tuple raised inside lookup())."""
    from kvtier_offload.recompute_bound import recorded_end

    class Reshaped:
        _offload_key_positions = {b"k": (0, 64)}

    class Floats:
        _offload_key_positions = {b"k": 64.9}

    assert recorded_end(Reshaped()) is None
    assert recorded_end(Floats()) == 64


def test_before_any_prompt_is_timed_the_store_deadline_decides():
    """No recompute price at all (an engine's first request after a restart, or a tier
    that is never shown a prompt): the cap for unsettled prices does not apply, the
    store's own lookup deadline does (ask(patient=False)); capped at FIRST_WAIT, a
    restarted engine's first loads from its local disk missed on a loaded runner."""
    from kvtier_offload.recompute_bound import FIRST_WAIT, RequestWaits

    clock = Clock()
    waits = RequestWaits(Rate(window=5), 32, lambda reason: None, clock)
    asked: list[bool] = []

    def pending(patient: bool) -> None:
        asked.append(patient)

    free = lambda tokens: None  # noqa: E731
    assert waits.answer("first", 64, pending, free, lambda: 0.0) is None
    clock.now += 5 * FIRST_WAIT
    assert waits.answer("first", 64, pending, free, lambda: 0.0) is None  # still waits
    assert asked == [False, False]  # impatient: the store's deadline decides
