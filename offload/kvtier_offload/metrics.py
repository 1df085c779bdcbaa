"""kvtier_offload_* metrics: one table of definitions, two ways out.

- Registered in the process's default prometheus registry (`Metrics()`), for a process
  that serves its own /metrics; with no prometheus-client every call is a no-op and the
  backend works the same. Without a CPU tier the stores live in vLLM's worker processes,
  whose registries no /metrics serves: there the operator sets PROMETHEUS_MULTIPROC_DIR
  (prometheus-client's multiprocess mode, which vLLM's API server reads when it is set),
  each process writes its values into that directory and the API server sums them.
  Counters and histograms sum by nature; each gauge says how (`multiprocess_mode`), and
  a process that exits cleanly removes its live gauges (`mark_process_dead`).
- Kept in a `Recorder` (`Metrics(recorder)`) for a host that exports them itself. vLLM
  runs its scheduler (where the tier lives) in another process than the API server that
  serves /metrics, so a tier's metrics reach /metrics only through vLLM's stats channel:
  the tier declares DEFINITIONS and hands over what the recorder took (vllm_tier.py).
  Nothing is registered then, so nothing can clash with the metrics vLLM creates.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

prom: ModuleType | None
try:
    import prometheus_client as prom
except ImportError:  # pragma: no cover - exercised where prometheus-client is absent
    prom = None

_LOCK = threading.Lock()
_METRICS: dict[str, Any] = {}
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


# Every kvtier_offload_* series names the tier it counts, as the operator's status names it
# (status.tiers[].name): "storage" (the shared volume, and GPU-direct mode), "localDisk"
# (a node-local directory), "objectStore". One pod may run all three under vLLM's tiering;
# without the label their figures would add up together.
TIER = "tier"
SHARED_TIER = "storage"


@dataclass(frozen=True)
class Definition:
    kind: str  # Counter | Gauge | Histogram, as prometheus-client names them
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    # Gauges: how the API server combines the processes' values in multiprocess mode.
    multiprocess_mode: str | None = None


DEFINITIONS = {d.name: d for d in (
    Definition("Counter", "kvtier_offload_bytes", "Bytes moved", (TIER, "direction")),
    Definition("Counter", "kvtier_offload_operations", "Block operations by outcome",
               (TIER, "direction", "outcome")),
    Definition("Histogram", "kvtier_offload_latency_seconds",
               "Latency of one block operation", (TIER, "direction"), LATENCY_BUCKETS),
    Definition("Counter", "kvtier_offload_lookups", "Lookups by result", (TIER, "result")),
    Definition("Counter", "kvtier_offload_corrupt_files", "Block files refused and removed",
               (TIER, "reason")),
    Definition("Counter", "kvtier_offload_dropped_writes",
               "Stores dropped, never written or reported stored", (TIER, "reason")),
    Definition("Counter", "kvtier_offload_failed_writes", "Stores that failed", (TIER, "error")),
    Definition("Gauge", "kvtier_offload_native",
               "1 where the block store runs its C extension, 0 on the Python path; reason: "
               "ok, turned-off, not-built, wrong-build, batch-io-off, or no-digest (the store "
               "refused to start)",
               (TIER, "reason"), multiprocess_mode="max"),
    Definition("Counter", "kvtier_offload_tier_skipped",
               "Requests that recomputed (the rest of) their prefix rather than wait for or "
               "load the tier, which would have cost more than recompute; reason: "
               "lookup-wait (the volume's answers come too late) or load-slower (loading "
               "takes longer than recomputing)", (TIER, "reason")),
    Definition("Gauge", "kvtier_offload_queue_depth",
               "Block operations submitted and not yet finished", (TIER, "direction"),
               multiprocess_mode="livesum"),
    # A tier bounded inside the backend (the local disk's capacity): its bound and what
    # its block files take now, so status can say how full it is.
    Definition("Gauge", "kvtier_offload_capacity_bytes",
               "The most bytes this tier's block files may take (a bounded tier)", (TIER,),
               multiprocess_mode="max"),
    Definition("Gauge", "kvtier_offload_used_bytes",
               "Bytes this tier's block files take now, with writes in flight (a bounded "
               "tier)", (TIER,), multiprocess_mode="livesum"),
)}


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, value: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass


def _registered(definition: Definition) -> Any:
    """The metric in the default registry, created once per process."""
    if prom is None:
        return _Noop()
    with _LOCK:
        _forget_at_exit()  # per process: a forked child reuses the parent's metrics
        metric = _METRICS.get(definition.name)
        if metric is None:
            extra: dict[str, Any] = {}
            if definition.buckets:
                extra["buckets"] = definition.buckets
            if definition.multiprocess_mode:
                extra["multiprocess_mode"] = definition.multiprocess_mode
            metric = getattr(prom, definition.kind)(definition.name, definition.doc,
                                                    definition.labels, **extra)
            _METRICS[definition.name] = metric
        return metric


_FORGET_REGISTERED: set[int] = set()  # the pids that registered (a fork child is another)


def _forget_at_exit() -> None:
    """In multiprocess mode, remove this process's live gauges when it exits (a worker
    that is gone has no queue); called with _LOCK held."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    pid = os.getpid()
    if pid in _FORGET_REGISTERED or not directory:
        return
    _FORGET_REGISTERED.add(pid)

    def forget() -> None:
        if os.getpid() != pid:  # a forked child inherited the hook
            return
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except OSError:
            pass

    atexit.register(forget)


Key = tuple[str, tuple[str, ...]]  # (metric name, label values)


class Recorder:
    """Metric values for a host to export: what counters gained and histograms saw
    since the last take(), and every gauge's current value. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Key, float] = {}
        self._gauges: dict[Key, float] = {}
        self._observed: dict[Key, list[float]] = {}

    def metric(self, definition: Definition) -> _Recorded:
        return _Recorded(self, definition.name, definition.kind)

    def add(self, key: Key, amount: float) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + amount

    def move(self, key: Key, amount: float) -> None:
        with self._lock:
            self._gauges[key] = self._gauges.get(key, 0) + amount

    def set(self, key: Key, value: float) -> None:
        with self._lock:
            self._gauges[key] = value

    def observe(self, key: Key, values: Sequence[float]) -> None:
        with self._lock:
            self._observed.setdefault(key, []).extend(values)

    def take(self) -> tuple[dict[Key, float], dict[Key, float], dict[Key, list[float]]]:
        """(counter increases, gauge values, histogram observations); the first and the
        last start again from nothing."""
        with self._lock:
            counts, self._counts = self._counts, {}
            observed, self._observed = self._observed, {}
            return counts, dict(self._gauges), observed


class _Recorded:
    """One metric (or one child of it) writing into a Recorder, with the prometheus-client
    calls the store makes."""

    def __init__(self, recorder: Recorder, name: str, kind: str,
                 labelvalues: tuple[str, ...] = ()) -> None:
        self._recorder, self._name, self._kind = recorder, name, kind
        self._key: Key = (name, labelvalues)

    def labels(self, *values: object) -> _Recorded:
        return _Recorded(self._recorder, self._name, self._kind, tuple(map(str, values)))

    def inc(self, amount: float = 1) -> None:
        if self._kind == "Gauge":
            self._recorder.move(self._key, amount)
        else:
            self._recorder.add(self._key, amount)

    def dec(self, amount: float = 1) -> None:
        self._recorder.move(self._key, -amount)

    def set(self, value: float) -> None:
        self._recorder.set(self._key, value)

    def observe(self, value: float) -> None:
        self._recorder.observe(self._key, [value])

    def observe_all(self, values: Sequence[float]) -> None:
        self._recorder.observe(self._key, values)


def observe_all(histogram: Any, values: Sequence[float] | np.ndarray) -> None:
    """Observe each of values (a batch's per-block times) at about the cost of one
    observe(), which takes 1.3 us a call: a tenth of a block's Python time. Goes through
    prometheus-client's bucket counters where they are as in 0.12-0.26, else observes
    one by one."""
    if isinstance(histogram, _Recorded):
        histogram.observe_all([float(v) for v in values])
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(float(value))
        return
    values = np.asarray(values, dtype=np.float64)
    if not len(values):
        return
    # The first bound a value is <= to: prometheus' "le" buckets (the last bound is +Inf).
    # A batch's blocks mostly share one or two buckets: count those, not all of them.
    found = np.searchsorted(_bounds_array(bounds), values, side="left").tolist()
    total.inc(float(values.sum()))
    for index in set(found):
        buckets[index].inc(found.count(index))


_BOUNDS: dict[int, tuple[list[float], np.ndarray]] = {}


def _bounds_array(bounds: list[float]) -> np.ndarray:
    """A histogram's bucket bounds as an array, made once (searchsorted would convert the
    list at every call); kept with the list itself, so a reused id cannot mislead."""
    known = _BOUNDS.get(id(bounds))
    if known is None or known[0] is not bounds:
        if len(_BOUNDS) > 256:
            _BOUNDS.clear()
        known = _BOUNDS[id(bounds)] = (bounds, np.asarray(bounds, dtype=np.float64))
    return known[1]


class _TierBound:
    """A metric whose first label, the tier, is given: labels() takes the others."""

    def __init__(self, metric: Any, tier: str) -> None:
        self._metric, self._tier = metric, tier

    def labels(self, *values: object) -> Any:
        return self._metric.labels(self._tier, *values)


class Metrics:
    """The backend's metrics for one tier (`tier`: its label value, see TIER); direction
    is 'store' or 'load'. recorder: keep them there for the host to export instead of
    registering them."""

    def __init__(self, recorder: Recorder | None = None, tier: str = SHARED_TIER) -> None:
        self.tier = tier

        def get(name: str) -> Any:
            definition = DEFINITIONS[name]
            metric = recorder.metric(definition) if recorder else _registered(definition)
            return _TierBound(metric, tier)

        self.bytes = get("kvtier_offload_bytes")
        self.operations = get("kvtier_offload_operations")
        self.latency = get("kvtier_offload_latency_seconds")
        self.lookups = get("kvtier_offload_lookups")
        self.corrupt = get("kvtier_offload_corrupt_files")
        self.dropped = get("kvtier_offload_dropped_writes")
        self.failed = get("kvtier_offload_failed_writes")
        self.queue_depth = get("kvtier_offload_queue_depth")
        self.native = get("kvtier_offload_native")
        self.tier_skipped = get("kvtier_offload_tier_skipped")
        self.capacity = get("kvtier_offload_capacity_bytes").labels()
        self.used = get("kvtier_offload_used_bytes").labels()
        # Children of the hot path, resolved once: labels() costs a lock and a dict lookup.
        self.store_ok = self.operations.labels("store", "ok")
        self.load_ok = self.operations.labels("load", "ok")
        self.store_bytes = self.bytes.labels("store")
        self.load_bytes = self.bytes.labels("load")
        self.store_latency = self.latency.labels("store")
        self.load_latency = self.latency.labels("load")
        self.in_queue = {"store": self.queue_depth.labels("store"),
                         "load": self.queue_depth.labels("load")}
