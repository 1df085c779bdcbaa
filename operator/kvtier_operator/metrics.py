"""The operator's Prometheus metrics (kvtier_operator_*)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("kvtier_operator_reconciles", "Reconciles by result",
                     ["result"])  # ok | degraded | invalid | retry | error
RECONCILE_SECONDS = Histogram("kvtier_operator_reconcile_duration_seconds",
                              "Time to reconcile one TieredPrefixCache")
MANAGED_CACHES = Gauge("kvtier_operator_managed_caches", "TieredPrefixCaches watched")
INJECTED_PODS = Gauge("kvtier_operator_injected_pods",
                      "Selected pods carrying the current config", ["namespace", "cache"])
PENDING_PODS = Gauge("kvtier_operator_pending_pods",
                     "Selected pods running without the current config", ["namespace", "cache"])
ERRORS = Counter("kvtier_operator_errors", "Errors by kind",
                 ["kind"])  # rejected | retryable | unexpected
VOLUME_USAGE = Gauge("kvtier_operator_volume_usage_percent",
                     "Shared volume bytes used, %, from the latest evictor report",
                     ["namespace", "cache"])
EVICTED_FILES = Gauge("kvtier_operator_last_eviction_files_deleted",
                      "Files the latest evictor run deleted", ["namespace", "cache"])
EVICTED_BYTES = Gauge("kvtier_operator_last_eviction_bytes_freed",
                      "Bytes the latest evictor run freed", ["namespace", "cache"])
READY = Gauge("kvtier_operator_ready", "1 when the TieredPrefixCache is Ready",
              ["namespace", "cache"])
