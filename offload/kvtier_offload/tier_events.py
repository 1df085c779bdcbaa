"""A kvtier tier's KV events, through vLLM's own path: OffloadingEvents the tier's manager
returns from take_events(), which vLLM's OffloadingConnectorScheduler turns into
BlockStored / BlockRemoved (OffloadingEventsTracker) on the engine's KV-events publisher,
with the hash vLLM announces for each OffloadKey and the tier's medium.

- stored: blocks whose files were written (never a write that was dropped or failed);
- removed: blocks whose files the backend removed itself, refused as corrupt on load or
  evicted by a bounded local tier (BlockStore.removals). Files the evictor deletes are
  announced by the evictor (kvtier_evictor.events).

One set-up for every kvtier tier (files, local disk, object store) and GPU-direct mode:
events need both the tier's enable_kv_events and vLLM's global KV cache events.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvtier_offload.removals import Removals

log = logging.getLogger("kvtier_offload")


class TierEvents:
    """The OffloadingEvents of one tier since vLLM last took them (scheduler thread)."""

    def __init__(self, medium: Medium, locality: Locality | None = None) -> None:
        self.medium = medium
        self.locality = locality
        self.removals = Removals()  # handed to the store, filled from its I/O threads
        self._events: list[OffloadingEvent] = []

    @classmethod
    def configured(cls, offloading_spec: Any, tier_type: str, enable_kv_events: bool,
                   medium: Medium, locality: Locality | None = None) -> TierEvents | None:
        """The tier's events where it and vLLM both have KV events on; else None."""
        if not enable_kv_events:
            return None
        if not offloading_spec.kv_events_config.enable_kv_cache_events:
            log.warning("enable_kv_events is set on tier %s but KV cache events are off "
                        "globally (--kv-events-config); no events", tier_type)
            return None
        return cls(medium, locality)

    def stored(self, keys: Iterable[bytes]) -> None:
        self._add(keys, removed=False)

    def removed(self, keys: Iterable[bytes]) -> None:
        self._add(keys, removed=True)

    def _add(self, keys: Iterable[bytes], removed: bool) -> None:
        self._take_removals()  # what the store removed so far goes first
        keys = [OffloadKey(k) for k in keys]
        if keys:
            self._events.append(OffloadingEvent(keys=keys, medium=self.medium,
                                                removed=removed, locality=self.locality))

    def _take_removals(self) -> None:
        gone = self.removals.take()
        if gone:
            self._events.append(OffloadingEvent(keys=[OffloadKey(k) for k in gone],
                                                medium=self.medium, removed=True,
                                                locality=self.locality))

    def take(self) -> list[OffloadingEvent]:
        self._take_removals()
        out, self._events = self._events, []
        return out
