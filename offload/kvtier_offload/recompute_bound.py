"""Whether a request waits for the shared tier or recomputes: never slower than recompute.

A tier hit is worth having only while waiting for the volume's answers and loading what
they found costs less than computing those tokens again. The engine's prefill rate
(`PrefillRate`, measured on the scheduler's side from each step's scheduled tokens and
duration) prices the recompute; the volume's own figures price the rest: its stat round
trips (lookup.BackgroundLookup.expected_wait) and its loads (`Rate`, seconds per token of
finished load jobs; before the first, a round trip per file on each read thread).

For one request with `at_stake` tokens that the volume may hold (its keys not known to be
missing), recompute costs R = at_stake x r and a full hit at_stake x l (r, l: seconds per
token). Waiting on lookups is worth it only while

    waited + expected further wait <= at_stake x (r - l) + slack x R

(what the best outcome saves, plus a small slack so that an idle volume's first round
trip is never refused). Past that, or where loading is not faster than recomputing at
all (l >= r), the request stops waiting: the prefix the volume already confirmed is
loaded and the rest recomputed (a partial hit), or nothing is loaded where l >= r. The
decision is the manager's (vllm_spec.KvtierOffloadingManager); this module only prices.
Everything here is arithmetic on the clock readings it is given.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# Reasons a request recomputed rather than wait for or load the tier (metric label).
LOOKUP_WAIT = "lookup-wait"  # the volume's answers would come later than recompute ends
LOAD_SLOWER = "load-slower"  # loading the hit would take longer than recomputing it
REASONS = (LOOKUP_WAIT, LOAD_SLOWER)

SLACK = 0.05  # of the recompute time: a wait no request could notice
WEIGHT = 0.25  # of each new sample in a moving average


class Rate:
    """Seconds per unit (a token), a moving average of samples (seconds, units)."""

    def __init__(self, weight: float = WEIGHT) -> None:
        self._weight = weight
        self.per_unit: float | None = None

    def add(self, seconds: float, units: float) -> None:
        if units <= 0 or seconds < 0:
            return
        sample = seconds / units
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
                 min_tokens: int = MIN_TOKENS, weight: float = WEIGHT) -> None:
        super().__init__(weight)
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

    @property
    def at_stake(self) -> int:
        return max(0, self.end - self.start)


def stop_waiting(wait: RequestWait, now: float, prefill: Rate, loading: float | None,
                 expected_wait: float | None, slack: float = SLACK) -> str | None:
    """Why the request should stop waiting for lookups now (a reason in REASONS), or None
    to keep waiting. loading: the expected seconds to load its tokens at stake (None:
    unknown, taken as free). None too where the prefill rate is unknown (the caller then
    keeps its fixed deadline)."""
    recompute = prefill.seconds(wait.at_stake)
    if recompute is None or wait.at_stake == 0:
        return None
    if load_slower(wait.at_stake, prefill, loading):
        return LOAD_SLOWER
    budget = recompute - (loading or 0.0) + slack * recompute
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
