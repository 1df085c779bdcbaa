"""Pods the pod webhook left alone, by cache, for the reconciler's Injected condition.

The webhook does not authenticate its clients, so whoever can reach it can make it record
conflicts for pod names that never existed. The log is therefore bounded, newest first:

- at most MAX_PODS_PER_CACHE pods per cache and MAX_ENTRIES pods in all; recording one more
  forgets the oldest (of that cache, then overall);
- a pod name is kept to MAX_POD_NAME characters (Kubernetes names are at most 253, so a
  longer one is no live pod and is forgotten at the next reconcile anyway) and a reason to
  MAX_REASON_CHARS characters.

With the defaults that is at most about 2000 x (1 KiB + 0.25 KiB) of text, under 3 MiB with
Python's overhead, whatever the clients send. Entries also leave when a reconcile of their
cache (`for_cache`) finds their pod gone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

MAX_PODS_PER_CACHE = 100
MAX_ENTRIES = 2000
MAX_POD_NAME = 253 + len("<generated>")  # a pod's generateName plus the webhook's marker
MAX_REASON_CHARS = 1000
TRUNCATED = "... (truncated)"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - len(TRUNCATED)] + TRUNCATED


class ConflictLog:
    """Why pods of each cache were not injected (pod name: reason), bounded, newest kept."""

    def __init__(self, max_pods_per_cache: int = MAX_PODS_PER_CACHE,
                 max_entries: int = MAX_ENTRIES, max_reason_chars: int = MAX_REASON_CHARS
                 ) -> None:
        self.max_pods_per_cache = max_pods_per_cache
        self.max_entries = max_entries
        self.max_reason_chars = max_reason_chars
        self._lock = threading.Lock()
        self._by_cache: dict[tuple[str, str], OrderedDict[str, str]] = {}
        self._order: OrderedDict[tuple[str, str, str], None] = OrderedDict()  # oldest first

    def record(self, namespace: str, cache: str, pod: str, reason: str) -> None:
        pod = _clip(pod, MAX_POD_NAME)
        reason = _clip(reason, self.max_reason_chars)
        key = (namespace, cache)
        with self._lock:
            entries = self._by_cache.setdefault(key, OrderedDict())
            entries[pod] = reason
            entries.move_to_end(pod)
            self._order[(namespace, cache, pod)] = None
            self._order.move_to_end((namespace, cache, pod))
            while len(entries) > self.max_pods_per_cache:
                oldest, _ = entries.popitem(last=False)
                del self._order[(namespace, cache, oldest)]
            while len(self._order) > self.max_entries:
                (ns, name, oldest), _ = self._order.popitem(last=False)
                self._forget(ns, name, oldest)

    def _forget(self, namespace: str, cache: str, pod: str) -> None:
        entries = self._by_cache.get((namespace, cache))
        if entries is None:
            return
        entries.pop(pod, None)
        if not entries:
            del self._by_cache[(namespace, cache)]

    def for_cache(self, namespace: str, cache: str, live_pods: Iterable[str]) -> dict[str, str]:
        """Conflicts (pod: reason) of pods that still exist (forgetting the rest)."""
        live = set(live_pods)
        with self._lock:
            entries = self._by_cache.get((namespace, cache), OrderedDict())
            for gone in [p for p in entries if p not in live]:
                self._order.pop((namespace, cache, gone), None)
                self._forget(namespace, cache, gone)
            return dict(sorted(entries.items()))

    def size(self) -> tuple[int, int]:
        """(entries, characters of pod names and reasons) held now."""
        with self._lock:
            pairs = [(pod, why) for entries in self._by_cache.values()
                     for pod, why in entries.items()]
        return len(pairs), sum(len(pod) + len(why) for pod, why in pairs)
