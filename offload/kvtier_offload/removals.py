"""The block files the backend itself removed (refused as corrupt on load, or evicted by a
bounded local tier), kept for vLLM's KV events (BlockRemoved) until the tier takes them.

Filled from the store's I/O threads, taken on vLLM's scheduler thread. Bounded: past
MAX_KEYS the oldest keys are let go and counted (`lost`), so a tier whose events are never
taken never grows; a key let go costs a stale router entry, never a wrong byte.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

MAX_KEYS = 1 << 16


class Removals:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._keys: deque[bytes] = deque()
        self._max = max_keys
        self._lock = threading.Lock()
        self.lost = 0

    def add(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._keys.extend(keys)
            over = len(self._keys) - self._max
            for _ in range(max(over, 0)):
                self._keys.popleft()
            self.lost += max(over, 0)

    def take(self) -> list[bytes]:
        with self._lock:
            out = list(self._keys)
            self._keys.clear()
            return out
