"""The lookup cache and the background lookup threads on their own."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier_offload import lookup
from kvtier_offload.lookup import BackgroundLookup, LookupCache

A, B, C = b"a" * 8, b"b" * 8, b"c" * 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(lookup, "time", fake)
    return fake


def test_hits_and_misses_expire_after_their_own_ttl(clock):
    cache = LookupCache(hit_ttl=10.0, miss_ttl=1.0, max_entries=10)
    cache.remember([A], True)
    cache.remember([B], False)
    assert (cache.get(A), cache.get(B), cache.get(C)) == (True, False, None)
    clock.now += 1.5
    assert (cache.get(A), cache.get(B)) == (True, None)
    assert cache.get_all([A, B, C]) == [True, None, None]
    clock.now += 9.0
    assert cache.get(A) is None


def test_the_least_recently_answered_key_goes_first():
    cache = LookupCache(hit_ttl=10.0, miss_ttl=10.0, max_entries=2)
    cache.remember([A, B], True)
    cache.remember([A], True)  # answered again: now the newest
    cache.remember([C], False)
    assert cache.get_all([A, B, C]) == [True, None, False] and len(cache) == 2


def test_a_forgotten_key_is_unknown():
    cache = LookupCache(hit_ttl=10.0, miss_ttl=10.0, max_entries=10)
    cache.remember([A], True)
    cache.forget(A)
    cache.forget(B)  # never known: nothing happens
    assert cache.get(A) is None


def test_asked_keys_are_stat_ed_on_the_lookup_threads():
    seen: list[tuple[bytes, str]] = []
    done = threading.Event()

    def stat(key: bytes) -> None:
        seen.append((key, threading.current_thread().name))
        done.set()

    background = BackgroundLookup(stat, threads=2, queue_limit=10, pending_seconds=5.0,
                                  name="test-lookup")
    try:
        assert background.ask(A) is True
        assert done.wait(5)
        deadline = time.monotonic() + 5
        while background.waiting() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert background.waiting() == 0
        (key, thread), = seen
        assert key == A and thread.startswith("test-lookup-")
    finally:
        background.stop()
        assert background.join(time.monotonic() + 5)


def test_a_key_not_answered_in_time_is_overdue_and_asked_once():
    release = threading.Event()
    stats: list[bytes] = []

    def hung(key: bytes) -> None:
        stats.append(key)
        release.wait(10)

    background = BackgroundLookup(hung, threads=1, queue_limit=10, pending_seconds=0.05)
    try:
        assert background.ask(A) is True
        time.sleep(0.1)
        assert background.ask(A) is False  # overdue: a miss for the caller
        assert background.waiting() == 1 and stats == [A]  # still asked only once
    finally:
        release.set()
        background.stop()
        background.join(time.monotonic() + 5)


def test_a_full_queue_makes_new_keys_overdue_at_once():
    release = threading.Event()
    background = BackgroundLookup(lambda key: release.wait(10), threads=1, queue_limit=1,
                                  pending_seconds=60.0)
    try:
        assert background.ask(A) is True
        assert background.ask(B) is False
        assert background.ask(A) is True  # the one waiting still may come in time
    finally:
        release.set()
        background.stop()
        background.join(time.monotonic() + 5)


def test_a_long_queue_is_shared_by_every_thread():
    names: set[str] = set()
    lock = threading.Lock()

    def slow(key: bytes) -> None:
        with lock:
            names.add(threading.current_thread().name)
        time.sleep(0.01)

    background = BackgroundLookup(slow, threads=3, queue_limit=100, pending_seconds=60.0)
    try:
        for i in range(30):
            background.ask(bytes([i]) * 8)
        deadline = time.monotonic() + 10
        while background.waiting() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(names) == 3
    finally:
        background.stop()
        background.join(time.monotonic() + 5)


def test_join_is_bounded_by_a_stat_that_never_returns():
    release, entered = threading.Event(), threading.Event()

    def hung(key: bytes) -> None:
        entered.set()
        release.wait(10)

    background = BackgroundLookup(hung, threads=1, queue_limit=10, pending_seconds=1.0)
    background.ask(A)
    assert entered.wait(5)
    background.stop()
    started = time.monotonic()
    assert background.join(time.monotonic() + 0.1) is False
    assert time.monotonic() - started < 5
    release.set()
    assert background.join(time.monotonic() + 5) is True


class ManualClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_patient_key_is_never_overdue_by_age():
    """The manager's recompute bound decides how long a request waits: a key asked
    patiently stays pending however long its stat takes (a full queue still refuses)."""
    release = threading.Event()
    clock = ManualClock()
    background = BackgroundLookup(lambda key: release.wait(10), threads=1, queue_limit=1,
                                  pending_seconds=0.5, clock=clock)
    try:
        assert background.ask(A, patient=True) is True
        clock.now += 60
        assert background.ask(A, patient=True) is True
        assert background.ask(A) is False  # the fixed deadline, for a caller without one
        assert background.ask(B, patient=True) is False  # the queue is full
    finally:
        release.set()
        background.stop()
        background.join(time.monotonic() + 5)


def test_the_expected_wait_is_the_measured_round_trip_per_turn_of_the_threads():
    """One thread, a stat of 0.3 s (on the fake clock) measured: three keys waiting take
    three turns; a stat in progress longer than the average raises the estimate at once."""
    clock = ManualClock()
    gate = threading.Semaphore(0)
    done = threading.Semaphore(0)

    def stat(key: bytes) -> None:
        gate.acquire()
        clock.now += 0.3
        done.release()

    background = BackgroundLookup(stat, threads=1, queue_limit=100, pending_seconds=60.0,
                                  clock=clock)
    try:
        assert background.expected_wait() is None  # nothing measured, nothing running
        background.ask(A)
        gate.release()
        assert done.acquire(timeout=5)
        deadline = time.monotonic() + 5
        while background.waiting() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert background.stat_seconds() == pytest.approx(0.3)
        for key in (B, C, b"d" * 8):
            background.ask(key)
        deadline = time.monotonic() + 5
        while background.stat_seconds() == pytest.approx(0.3) and \
                time.monotonic() < deadline:
            clock.now += 0.1  # the stat of B hangs: its age passes the average
            time.sleep(0.01)
        assert background.stat_seconds() > 0.3
        assert background.expected_wait() == pytest.approx(
            background.stat_seconds() * 3, rel=0.01)
    finally:
        for _ in range(4):
            gate.release()
        background.stop()
        background.join(time.monotonic() + 5)


def test_a_key_waits_as_long_as_the_queue_makes_it_not_just_one_stat():
    """answer_seconds: from a key's first ask to its answer, its turn in the queue
    included. One thread, each stat 0.1 s on the fake clock, three keys asked together:
    answered after 0.1, 0.2 and 0.3 s, while a stat alone still costs 0.1 s."""
    clock = ManualClock()

    def stat(key: bytes) -> None:
        clock.now += 0.1

    background = BackgroundLookup(stat, threads=1, queue_limit=100, pending_seconds=60.0,
                                  clock=clock)
    try:
        assert background.answer_seconds() is None
        with background._cv:  # all three queued before the thread takes any
            for key in (A, B, C):
                background._pending[key] = clock.now
                background._queue.append(key)
            background._cv.notify()
        deadline = time.monotonic() + 5
        while background.waiting() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert background.stat_seconds() == pytest.approx(0.1)
        # moving average (weight 1/4) of 0.1, 0.2, 0.3: above one stat's time
        assert background.answer_seconds() == pytest.approx(0.1 + 0.25 * 0.1 + 0.25 * (
            0.3 - (0.1 + 0.25 * 0.1)))
    finally:
        background.stop()
        background.join(time.monotonic() + 5)


def test_a_key_left_unanswered_prices_the_next_ones_wait_at_its_age():
    """Lookup threads starved of the CPU (a loaded machine): each stat still takes 0.1 s
    once it runs, but a key waits 2 s before a thread takes it. The oldest key pending
    prices a key asked now at its age, before any answer says so (the wait is priced
    before it is spent); once answered, the measured ask-to-answer time does."""
    clock = ManualClock()

    def stat(key: bytes) -> None:
        clock.now += 0.1

    background = BackgroundLookup(stat, threads=1, queue_limit=100, pending_seconds=60.0,
                                  clock=clock)

    def queue(key: bytes) -> None:  # asked, not yet taken: the caller holds the lock
        background._pending[key] = clock.now
        background._queue.append(key)

    def answered() -> None:
        deadline = time.monotonic() + 5
        while background.waiting() and time.monotonic() < deadline:
            time.sleep(0.001)

    try:
        background.ask(A)
        answered()
        assert background.answer_seconds() == pytest.approx(0.1)
        with background._cv:  # no thread runs while the test holds the lock
            queue(B)
            clock.now += 2.0
            queue(C)  # asked now, behind B
            assert background.stat_seconds() == pytest.approx(0.1)
            assert background.answer_seconds() == pytest.approx(2.0)
            assert background.expected_wait() == pytest.approx(2.0)  # not 2 x 0.1 s
            clock.now += 0.5  # C has waited 0.5 s of the 2.5 s a key waits now
            assert background.expected_wait() == pytest.approx(2.0)
            background._cv.notify()
        answered()
        assert background.answer_seconds() > 0.5  # B: 2.6 s, C: 0.7 s, after 0.1 s
        with background._cv:
            queue(A)
            assert background.expected_wait() == pytest.approx(
                background.answer_seconds())
    finally:
        background.stop()
        background.join(time.monotonic() + 5)
