"""Whether block files exist, answered without making vLLM's scheduler wait on the volume.

`LookupCache` remembers answers (a hit for hit_ttl seconds, a miss for miss_ttl), least
recently answered first out past max_entries. `BackgroundLookup` answers keys the cache
does not know on a few threads of its own: the caller asks and polls the cache; a key
not answered within pending_seconds, or asked while the queue is full, is overdue and
the caller treats it as a miss (a slow or hung volume costs a recompute, never a request
held back for good), unless the caller asks patiently: then it decides itself how long to
wait (recompute_bound.py), from the round trips measured here (expected_wait).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from kvtier_offload.jobs import time_left
from kvtier_offload.recompute_bound import Rate

Entry = tuple[bool, float]  # (present, valid until: monotonic)


class LookupCache:
    def __init__(self, hit_ttl: float, miss_ttl: float, max_entries: int) -> None:
        self._ttl = {True: hit_ttl, False: miss_ttl}
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()

    def remember(self, keys: Iterable[bytes], present: bool) -> None:
        entry = (present, time.monotonic() + self._ttl[present])
        with self._lock:
            for key in keys:
                self._entries[key] = entry
                self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def get(self, key: bytes) -> bool | None:
        """The answer for key now: None where there is none or it expired."""
        with self._lock:
            entry = self._entries.get(key)
        return None if entry is None or entry[1] < time.monotonic() else entry[0]

    def get_all(self, keys: Iterable[bytes]) -> list[bool | None]:
        """get() for many keys under one lock and one clock reading."""
        with self._lock:
            entries = [self._entries.get(key) for key in keys]
        now = time.monotonic()
        return [None if entry is None or entry[1] < now else entry[0] for entry in entries]

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


class BackgroundLookup:
    """Keys waiting for stat(key), taken by `threads` threads (daemons, named
    name-0, name-1...), each a share of the queue at a time so a long scan spreads over
    all of them. stat answers the key; it records the answer where the caller will look
    (a LookupCache) and must not raise. Each stat is timed (stat_seconds: a moving
    average of the volume's round trip), and so is each key's wait from its first ask to
    its answer (answer_seconds: the queue's turns included, as a request sees it)."""

    def __init__(self, stat: Callable[[bytes], object], threads: int, queue_limit: int,
                 pending_seconds: float, name: str = "kvtier-lookup",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stat = stat
        self._clock = clock
        self._round_trip = Rate()
        self._answer = Rate()  # seconds from a key's first ask to its answer
        self._in_stat: dict[int, float] = {}  # thread number -> when its stat began
        self._queue_limit = queue_limit
        self.pending_seconds = pending_seconds
        self._cv = threading.Condition()
        self._queue: deque[bytes] = deque()
        self._pending: dict[bytes, float] = {}  # key -> when first asked (monotonic)
        self._closed = False
        self._threads = [threading.Thread(target=self._loop, args=(n,), daemon=True,
                                          name=f"{name}-{n}")
                         for n in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def ask(self, key: bytes, patient: bool = False) -> bool:
        """Queue key for a stat unless it waits already. True while its answer may still
        come in time; False where it is overdue (asked pending_seconds ago or more and
        not answered, or the queue is full): a miss for the caller. patient: the caller
        bounds the wait itself, so only a full queue makes the key overdue."""
        now = self._clock()
        with self._cv:
            asked = self._pending.get(key)
            if asked is None:
                if len(self._pending) >= self._queue_limit:
                    return False
                self._pending[key] = asked = now
                self._queue.append(key)
                self._cv.notify()
        return patient or now - asked <= self.pending_seconds

    def waiting(self) -> int:
        """Keys asked and not yet answered."""
        with self._cv:
            return len(self._pending)

    def stat_seconds(self) -> float | None:
        """The volume's round trip for one stat: the moving average of those answered, or
        longer where a stat in progress has taken longer already (a volume slowing down
        shows at once); None before any stat began."""
        with self._cv:
            average = self._round_trip.per_unit
            began = min(self._in_stat.values(), default=None)
        running = None if began is None else self._clock() - began
        if average is None:
            return running
        return average if running is None else max(average, running)

    def answer_seconds(self) -> float | None:
        """How long a key waits from its first ask to its answer: the moving average of
        those answered, or longer where a key still unanswered has waited longer already
        (the age of the oldest ask: a queue backing up, or a stat that hangs, shows at
        once); None before any key was asked."""
        with self._cv:
            average = self._answer.per_unit
            oldest = next(iter(self._pending.values()), None)
        waited = None if oldest is None else self._clock() - oldest
        if average is None:
            return waited
        return average if waited is None else max(average, waited)

    def expected_wait(self) -> float | None:
        """How long until the keys waiting now are answered: at the measured round trip,
        the threads taking them in turns, and no sooner than the last asked has waited
        what a key waits now (answer_seconds); None where nothing is measured yet."""
        per_stat = self.stat_seconds()
        if per_stat is None:
            return None
        latency = self.answer_seconds()
        with self._cv:
            waiting = len(self._pending)
            newest = next(reversed(self._pending.values()), None)
        turns = per_stat * -(-waiting // len(self._threads))
        if latency is None or newest is None:
            return turns
        return max(turns, latency - (self._clock() - newest))

    def _loop(self, number: int) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                share = -(-len(self._queue) // len(self._threads))
                batch = [self._queue.popleft() for _ in range(min(share, 64))]
            try:
                for key in batch:
                    began = self._clock()
                    with self._cv:
                        self._in_stat[number] = began
                    self._stat(key)
                    now = self._clock()
                    with self._cv:
                        self._round_trip.add(now - began, 1)
                        asked = self._pending.pop(key, None)
                        if asked is not None:
                            self._answer.add(now - asked, 1)
            finally:
                with self._cv:
                    self._in_stat.pop(number, None)
                    for key in batch:
                        self._pending.pop(key, None)

    def stop(self) -> None:
        """Make the threads end at their next turn; keys still queued are never answered."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def join(self, deadline: float | None = None) -> bool:
        """Wait for stopped threads until deadline (monotonic; None: as long as it takes).
        False where one is still in a stat then (a hung mount): it is left behind (a
        daemon, it ends with the process)."""
        for thread in self._threads:
            thread.join(time_left(deadline))
        return not any(thread.is_alive() for thread in self._threads)
