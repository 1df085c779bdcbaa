"""The TieredPrefixCaches the operator watches, as the admission webhooks see them."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.validation import InvalidResource, parse_tpc


class CacheLookup(Protocol):
    def in_namespace(self, namespace: str) -> list[TieredPrefixCache]: ...


@dataclass(frozen=True)
class CacheView:
    """A picklable snapshot of a CacheRegistry, for admissions run in another process."""

    by_namespace: dict[str, tuple[TieredPrefixCache, ...]]

    def in_namespace(self, namespace: str) -> list[TieredPrefixCache]:
        return list(self.by_namespace.get(namespace, ()))


class CacheRegistry:
    """The TieredPrefixCaches the operator watches, by namespace (fed by watch events),
    parsed once per event rather than once per admission request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, dict[str, TieredPrefixCache]] = {}
        self._view: CacheView | None = None

    def observe(self, event_type: str, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        parsed = None
        if event_type != "DELETED" and not meta.get("deletionTimestamp"):
            try:
                parsed = parse_tpc(body)
            except InvalidResource:
                pass  # an invalid resource injects nothing; its status says why
        with self._lock:
            if parsed is None:
                self._caches.get(ns, {}).pop(name, None)
            else:
                self._caches.setdefault(ns, {})[name] = parsed
            self._view = None

    def names(self) -> list[tuple[str, str]]:
        """(namespace, name) of every valid resource watched."""
        with self._lock:
            return sorted((ns, name) for ns, caches in self._caches.items() for name in caches)

    def in_namespace(self, namespace: str) -> list[TieredPrefixCache]:
        with self._lock:
            found = list(self._caches.get(namespace, {}).values())
        return sorted(found, key=lambda t: t.name)

    def view(self) -> CacheView:
        """A snapshot, rebuilt only after a watch event changed something."""
        with self._lock:
            if self._view is None:
                self._view = CacheView({
                    ns: tuple(sorted(caches.values(), key=lambda t: t.name))
                    for ns, caches in self._caches.items() if caches})
            return self._view
