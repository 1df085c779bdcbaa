"""Whether a request waits for the shared tier or recomputes: never slower than recompute.

A tier hit is worth having only while waiting for the volume's answers and loading what
they found costs less than computing those tokens again. The engine's prefill rate
(`PrefillRate`, measured on the scheduler's side from each step's scheduled tokens and
duration) prices the recompute; the volume's own figures price the rest: its stat round
trips (lookup.BackgroundLookup.expected_wait) and its loads (`Rate`, seconds per token of
finished load jobs; before the first, LOAD_TRIPS round trips per file on each read thread).

For one request with `at_stake` tokens that the volume may hold (its keys not known to be
missing), recompute costs R = at_stake x r and a full hit at_stake x l (r, l: seconds per
token). Waiting on lookups is worth it only while

    waited + expected further wait <= at_stake x (r - l) + slack x R

(what the best outcome saves, plus a small slack so that an idle volume's first round
trip is never refused). Past that, or where loading is not faster than recomputing at
all (l >= r), the request stops waiting: the prefix the volume already confirmed is
loaded and the rest recomputed (a partial hit), or nothing is loaded where l >= r.

One decision (RequestWaits) for both modes: GPU-direct (vllm_spec.KvtierOffloadingManager,
its prefill rate fed step by step by kvtier's connector: PrefillRate) and tier mode
(vllm_tier.KvtierStorageTier and its local and object variants under vLLM's
TieringOffloadingManager, which never shows a tier the engine's steps: PromptTimes times
each prompt from the hooks vLLM does call). Everything here is arithmetic on the clock
readings it is given.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Reasons a request recomputed rather than wait for or load the tier (metric label).
LOOKUP_WAIT = "lookup-wait"  # the volume's answers would come later than recompute ends
LOAD_SLOWER = "load-slower"  # loading the hit would take longer than recomputing it
REASONS = (LOOKUP_WAIT, LOAD_SLOWER)

SLACK = 0.05  # of the recompute time: a wait no request could notice
WEIGHT = 0.25  # of each new sample in a moving average
# The engine's recompute cost is the median of this many recent prompt samples: an
# overestimate would let requests wait longer than recompute takes (the first prefill of
# an engine is several times its usual cost), an underestimate only skips the tier.
PREFILL_WINDOW = 5
# Before any load is measured, a block file's load is priced at this many of the volume's
# stat round trips (open, read, close each cost one on a network filesystem; a stat is one).
LOAD_TRIPS = 3
# A tier priced slower than recompute is still tried by one request in this many (the
# first such request, then every PROBE_EVERY-th): the price may be an estimate (no load
# measured yet) or a slow spell that has passed, and a tier that is never loaded from is
# never measured again. A probe waits within the wait budget alone, as if its load were
# free; where the tier really is slower it costs that one request its difference.
PROBE_EVERY = 16
# The engine's recompute price settles once this many samples are in (the median then
# leaves out the first prefill's one-time costs). Priced at an engine's first prefills,
# the first requests after a start waited up to a second and cost 2-4.6x tier off, so
# once one sample is in and until the price settles, a request waits on lookups at most
# FIRST_WAIT seconds (or the store's lookup_pending_seconds, where shorter). Before any
# sample, the store's lookup_pending_seconds alone decides: capped there too, a restarted
# engine's first loads from its own local disk missed on a loaded CI runner.
PREFILL_SETTLED = 3
FIRST_WAIT = 0.1


class Rate:
    """Seconds per unit (a token), a moving average of samples (seconds, units); with a
    window, the median of the last `window` samples instead (one outlier, such as an
    engine's first prefill, which pays one-time costs, moves it not at all)."""

    def __init__(self, weight: float = WEIGHT, window: int = 0) -> None:
        self._weight = weight
        self._recent: deque[float] | None = deque(maxlen=window) if window > 0 else None
        self.per_unit: float | None = None
        self.samples = 0  # taken so far

    def add(self, seconds: float, units: float) -> None:
        if units <= 0 or seconds < 0:
            return
        self.samples += 1
        sample = seconds / units
        if self._recent is not None:
            self._recent.append(sample)
            self.per_unit = statistics.median(self._recent)
            return
        self.per_unit = sample if self.per_unit is None else (
            self.per_unit + self._weight * (sample - self.per_unit))

    def seconds(self, units: float) -> float | None:
        """The time for units at the measured rate; None before any sample."""
        return None if self.per_unit is None else self.per_unit * units


class PrefillRate(Rate):
    """The engine's seconds per prefill token, from its scheduler's steps: a step starts
    when the scheduler hands it out (step_scheduled, with its tokens) and ends when its
    output comes back (step_done); steps pair up in order (a pipelined scheduler may hand
    out the next before the last returns; a step never starts before the one before it
    ends). A step with nothing scheduled is not kept: vLLM runs it only where the
    connector has work, so its output may never come back (a request whose lookups are
    deferred makes many). Steps with fewer than min_tokens prefill tokens (decodes) are
    not samples: their cost per token is the step's fixed cost, not prefill."""

    MIN_TOKENS = 16

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 min_tokens: int = MIN_TOKENS, weight: float = WEIGHT,
                 window: int = PREFILL_WINDOW) -> None:
        super().__init__(weight, window)
        self._clock = clock
        self._min_tokens = min_tokens
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=8)
        self._last_done = 0.0

    def step_scheduled(self, tokens: int, prefill_tokens: int) -> None:
        """A step of tokens in all, prefill_tokens of them prompt tokens, handed out now."""
        if tokens > 0:
            self._steps.append((self._clock(), tokens, prefill_tokens))

    def step_done(self) -> None:
        """The oldest step handed out has returned now."""
        if not self._steps:
            return
        started, tokens, prefill = self._steps.popleft()
        now = self._clock()
        began = max(started, self._last_done)
        self._last_done = now
        if prefill >= self._min_tokens:
            self.add(now - began, tokens)


@dataclass
class RequestWait:
    """One request's lookups: when the manager first heard of it, the token span its keys
    cover (start: the first asked key's first token; end: the furthest key's last) and,
    once decided, the token up to which it loads."""

    started: float
    start: int
    end: int
    cut: int | None = None  # keys ending past this token are recomputed
    reason: str | None = None
    probe: bool | None = None  # decided at its first "load slower": tried anyway
    hit: bool = False  # a key was answered there (to load)
    waited: bool = False  # it waited on a lookup (answered None) at least once
    late_probe: bool | None = None  # decided at its first lookup after others came late
    answered: bool = False  # a key of it was answered (present or not)

    @property
    def at_stake(self) -> int:
        return max(0, self.end - self.start)


def stop_waiting(wait: RequestWait, now: float, prefill: Rate, loading: float | None,
                 expected_wait: float | None, slack: float = SLACK,
                 worth: float = 1.0) -> str | None:
    """Why the request should stop waiting for lookups now (a reason in REASONS), or None
    to keep waiting. loading: the expected seconds to load its tokens at stake (None:
    unknown, taken as free); worth: the chance that waiting finds them (a wait is worth
    what a hit saves times that chance). None too where the prefill rate is unknown (the
    caller then keeps its fixed deadline)."""
    recompute = prefill.seconds(wait.at_stake)
    if recompute is None or wait.at_stake == 0:
        return None
    if load_slower(wait.at_stake, prefill, loading):
        return LOAD_SLOWER
    budget = worth * (recompute - (loading or 0.0)) + slack * recompute
    waited = now - wait.started
    if waited > budget or (expected_wait is not None and waited + expected_wait > budget):
        return LOOKUP_WAIT
    return None


def load_slower(tokens: int, prefill: Rate, loading: float | None) -> bool:
    """Whether loading tokens from the tier (expected to take `loading` seconds) takes
    longer than recomputing them (False while either is unknown)."""
    recompute = prefill.seconds(tokens)
    return recompute is not None and loading is not None and tokens > 0 and \
        loading >= recompute


def load_estimate(tokens: int, load_rate: Rate, round_trip: float | None,
                  tokens_per_key: int, read_threads: int) -> float | None:
    """The expected seconds to load tokens: at the measured load rate; before any load,
    LOAD_TRIPS round trips of the volume per file on each read thread; None while
    neither is known. (Rounded up to whole rounds of threads. A request's first lookup
    is priced over every key vLLM recorded for it, recorded_end, not its first key
    alone; the probe, PROBE_EVERY, re-measures a tier so priced slower.)"""
    measured = load_rate.seconds(tokens)
    if measured is not None or round_trip is None:
        return measured
    files = -(-tokens // max(1, tokens_per_key))
    return LOAD_TRIPS * round_trip * -(-files // max(1, read_threads))


class RequestWaits:
    """The recompute bound's decision for each request's lookups, as both of kvtier's
    vLLM managers take it: GPU-direct mode (vllm_spec.KvtierOffloadingManager) and tier
    mode (vllm_tier.KvtierStorageTier under vLLM's TieringOffloadingManager). A request's
    wait starts at its first lookup; every answer still pending is priced with
    stop_waiting, every hit with load_slower; once either says stop, keys ending past
    the cut are misses for that request from then on (the confirmed prefix before it
    loads, the rest is recomputed) and the skip is reported once (skipped(reason)).
    Before the prefill rate is measured, lookups are asked impatiently (the store's fixed
    lookup_pending_seconds decides)."""

    def __init__(self, prefill: Rate, tokens_per_key: int, skipped: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, requests: int = 4096) -> None:
        self.prefill = prefill
        self.tokens_per_key = max(1, tokens_per_key)
        self._skipped = skipped
        self._clock = clock
        self._requests = requests
        self._waits: OrderedDict[str, RequestWait] = OrderedDict()
        self.skips: Counter[str] = Counter()  # requests skipped so far, by reason
        self._slower_requests = 0  # requests priced slower than recompute (PROBE_EVERY)
        self._probe_owed = True  # the next request priced slower tries the tier
        # The volume's answers came too late for the last request that waited on them:
        # the next requests do not wait (LATE, PROBE_EVERY), until one is answered in time.
        self.late = False
        self._late_requests = 0
        # The share of requests whose first answered key was there to load (moving
        # average): until a request's own first hit, its wait is worth a hit's saving
        # times this (a cache whose prompts are new pays no more than the slack to learn
        # it; a miss answered within a whole-prefix budget cost 1.75x tier off).
        self.hit_share = 1.0

    def get(self, req_id: str) -> RequestWait | None:
        return self._waits.get(req_id)

    def end_token(self, req_id: str, position: int | None) -> int:
        """The prompt token a key's chunk ends at: vLLM's recorded position, or where it
        records none, the keys' order of first sight."""
        if position is not None:
            return int(position)
        wait = self._waits.get(req_id)
        return (wait.end if wait is not None else 0) + self.tokens_per_key

    def answer(self, req_id: str, end: int, ask: Callable[[bool], bool | None],
               loading: Callable[[int], float | None],
               expected_wait: Callable[[], float | None],
               furthest: Callable[[], int | None] | None = None) -> bool | None:
        """Whether the key ending at token `end` is to be loaded (True), recomputed
        (False) or waited for (None). ask(patient) asks the store(s) (True, False, or
        None while pending); loading(tokens) and expected_wait() price the tier;
        furthest(), asked at the request's first lookup, the end of its furthest key
        where the engine already knows it (recorded_end)."""
        wait = self._wait_of(req_id, end, furthest)
        if wait.cut is not None and end > wait.cut:
            return False  # decided: recompute from here
        present = ask(self.prefill.per_unit is not None)
        priced = loading(wait.at_stake)
        slower = load_slower(wait.at_stake, self.prefill, priced)
        if slower and self._probes(wait):
            priced, slower = None, False  # bounded by the wait budget alone
        if present is None:
            now = self._clock()
            worth = 1.0 if wait.hit else self.hit_share
            reason = stop_waiting(wait, now, self.prefill, priced, expected_wait(),
                                  worth=worth)
            late = reason is not None and wait.waited  # it spent a wait to learn it
            if reason is None and self.late and not self._probes_late(wait):
                reason = LOOKUP_WAIT  # the last requests' answers came too late
            if reason is None and 0 < self.prefill.samples < PREFILL_SETTLED and \
                    now - wait.started > FIRST_WAIT:
                reason = LOOKUP_WAIT  # recompute not yet priced: a short wait at most
            if reason is None:
                wait.waited = True
                return None
            self._recompute_from(wait, end - self.tokens_per_key, reason, late)
            return False
        if wait.waited and wait.reason is None:
            self.late = False  # a request that waited was answered within its budget
        if not wait.answered:
            wait.answered = True
            self.hit_share += WEIGHT * (float(bool(present)) - self.hit_share)
        if present:
            wait.hit = True
        else:
            self._refund_probe(wait)
        if present and slower:
            self._recompute_from(wait, wait.start, LOAD_SLOWER)
            return False
        return present

    def _probes(self, wait: RequestWait) -> bool:
        """Whether this request, priced slower than recompute, tries the tier anyway
        (PROBE_EVERY); decided once per request."""
        if wait.probe is None:
            if self._slower_requests and self._slower_requests % PROBE_EVERY == 0:
                self._probe_owed = True
            wait.probe, self._probe_owed = self._probe_owed, False
            self._slower_requests += 1
        return wait.probe

    def _refund_probe(self, wait: RequestWait) -> None:
        """A probe whose scan ended before any key was there to load (its prefix was
        never stored, or its lookups came too late) measured nothing: the next request
        priced slower probes instead. (Else an engine's first requests, which find
        nothing, spend the probe: on GlusterFS with a writer no load was ever measured
        and every request was priced on the round-trip estimate.)"""
        if wait.probe and not wait.hit:
            wait.probe = False
            self._probe_owed = True

    def _probes_late(self, wait: RequestWait) -> bool:
        """Whether this request waits on lookups although the last ones came too late
        (one in PROBE_EVERY: a volume that recovered is seen again); decided once per
        request."""
        if wait.late_probe is None:
            self._late_requests += 1
            wait.late_probe = self._late_requests % PROBE_EVERY == 0
        return wait.late_probe

    def finished(self, req_id: str) -> None:
        self._waits.pop(req_id, None)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Requests the scheduler preempted (vLLM's ScheduleEndContext): scheduled again,
        each starts a wait of its own. (Kept, its first lookup's start made the wait look
        longer than any budget at once, and the next requests stopped early, `late`, on a
        healthy volume.)"""
        for req_id in req_ids:
            self._waits.pop(req_id, None)

    def _wait_of(self, req_id: str, end: int,
                 furthest: Callable[[], int | None] | None = None) -> RequestWait:
        """The request's wait, started at its first lookup, spanning from its first key
        to its furthest known one; its span grown to key's."""
        wait = self._waits.get(req_id)
        if wait is None:
            last = furthest() if furthest is not None else None
            wait = self._waits[req_id] = RequestWait(
                self._clock(), end - self.tokens_per_key, max(end, last or 0))
            while len(self._waits) > self._requests:
                self._waits.popitem(last=False)  # the least recently asked
        else:
            self._waits.move_to_end(req_id)
        wait.start = min(wait.start, end - self.tokens_per_key)
        wait.end = max(wait.end, end)
        return wait

    def _recompute_from(self, wait: RequestWait, token: int, reason: str,
                        late: bool = False) -> None:
        """Keys ending past token are recomputed; counted once per request. late: the
        priced bound found the volume's answers too late (the next requests then stop
        at their first unanswered key, `late`)."""
        wait.cut = token if wait.cut is None else min(wait.cut, token)
        self._refund_probe(wait)
        if wait.reason is None:
            wait.reason = reason
            self.skips[reason] += 1
            self._skipped(reason)
        if late and reason == LOOKUP_WAIT:
            self.late = True


def recorded_end(req_context: object) -> int | None:
    """The end token of a request's furthest key as vLLM's offloading scheduler recorded
    it (ReqContext's key positions, 0.32 and 0.33: every key of the prompt is recorded
    before the first lookup); None where none is recorded. Without it a request's first
    key alone is at stake when its first lookup is priced, and one key's recompute is
    cheaper than any round trip: on a network volume every request was decided against
    the tier at its first key."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or not positions:
        return None
    try:  # a private field: a vLLM that reshapes it costs the whole-prefix price only
        return max(int(end) for end in positions.values())
    except (TypeError, ValueError, OverflowError):
        return None


class PromptTimes(Rate):
    """The engine's seconds per prompt token as a secondary tier of vLLM's tiering sees
    it, which is never shown the engine's steps: a request's prompt is timed from the step
    that first schedules it (on_schedule_end's new_req_ids) to the last of its prompt's
    chunks reaching the tier (vLLM cascades a chunk to every tier once its GPU-to-CPU copy
    completes; prompt chunks only, vLLM's default offload_prompt_only), over the tokens
    those chunks span; one sample when the request finishes (vLLM tells the tiers only
    after its last cascade). An upper bound: it includes the copy's lag (a step or two)
    and any other request sharing the steps, so the bound it feeds errs towards waiting
    a little longer, by less than a step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 min_tokens: int = PrefillRate.MIN_TOKENS, weight: float = WEIGHT,
                 requests: int = 4096, window: int = PREFILL_WINDOW) -> None:
        super().__init__(weight, window)
        self._clock = clock
        self._min_tokens = min_tokens
        self._requests = requests
        self._begun: OrderedDict[str, float] = OrderedDict()  # req id -> first scheduled
        self._stored: dict[str, tuple[int, int, float]] = {}  # req id -> (start, end, when)

    def scheduled(self, req_ids: Iterable[str]) -> None:
        """These requests were scheduled for the first time in the step handed out now."""
        now = self._clock()
        for req_id in req_ids:
            self._begun.setdefault(req_id, now)
            while len(self._begun) > self._requests:
                gone, _ = self._begun.popitem(last=False)
                self._stored.pop(gone, None)

    def stored(self, req_id: str, start: int, end: int) -> None:
        """A request's prompt tokens start..end reached the tier now."""
        if req_id not in self._begun or end <= start:
            return
        known = self._stored.get(req_id)
        if known is not None:
            start, end = min(start, known[0]), max(end, known[1])
        self._stored[req_id] = (start, end, self._clock())

    def finished(self, req_id: str) -> None:
        began = self._begun.pop(req_id, None)
        stored = self._stored.pop(req_id, None)
        if began is None or stored is None:
            return
        start, end, when = stored
        if end - start >= self._min_tokens:
            self.add(when - began, end - start)
