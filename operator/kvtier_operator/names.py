"""Names, labels and annotations kvtier puts on objects: one place, one spelling."""

from __future__ import annotations

from kvtier_operator.api.v1alpha1 import TieredPrefixCache

PREFIX = "kvtier.dev"
ANNOTATION_CACHE = f"{PREFIX}/cache"
ANNOTATION_CONFIG_HASH = f"{PREFIX}/config-hash"
# Where the operator reads a pod's metrics when the engine's default port is not it.
ANNOTATION_METRICS_PORT = f"{PREFIX}/metrics-port"
ANNOTATION_RESTARTED_AT = f"{PREFIX}/restartedAt"
# The field paths kvtier before server-side apply recorded on the objects it owns; the
# gateway hands them over to server-side apply once, which then removes it (gateway.py).
ANNOTATION_APPLIED_FIELDS = f"{PREFIX}/applied-fields"
# On kvtier's own objects: the cache that owns them. On a workload's pod template (and so
# its pods): the workload owner's opt-in to `rollout: Auto` restarts by that cache.
LABEL_CACHE = f"{PREFIX}/cache"
LABEL_OPT_OUT = f"{PREFIX}/inject"  # "false" on a pod skips injection
LABEL_COMPONENT = f"{PREFIX}/component"
FINALIZER = f"{PREFIX}/finalizer"

VOLUME_SHM = "kvtier-shm"
VOLUME_CACHE = "kvtier-cache"
VOLUME_SITE = "kvtier-site"
VOLUME_LOCAL_DISK = "kvtier-local-disk"
# Without a CPU tier kvtier's block stores run in vLLM's worker processes: their
# kvtier_offload_* metrics reach the API server's /metrics through prometheus-client's
# multiprocess mode, in a directory of the pod's own (an emptyDir; vLLM reads the
# variable, offload/kvtier_offload/metrics.py).
VOLUME_METRICS = "kvtier-metrics"
METRICS_MOUNT = "/var/run/kvtier-metrics"
METRICS_SIZE_LIMIT = "256Mi"
ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
INIT_CONTAINER = "kvtier-offload-install"
PREPARE_CONTAINER = "kvtier-prepare-tier"  # spec.storage.permissions.prepareDirectory
# What runs before the engine in its container where it keeps a CPU tier in /dev/shm:
# removes the regions a killed engine left behind, then execs the engine's command
# (offload/kvtier_offload/shm_sweep.py).
SHM_SWEEP_PREFIX = ("python3", "-m", "kvtier_offload", "sweep-shm", "--")
SITE_MOUNT = "/opt/kvtier/site"
SHM_MOUNT = "/dev/shm"
# The model-server env var holding the --kv-transfer-config JSON (a shell script passes
# it on as "$KVTIER_KV_TRANSFER_CONFIG", so the JSON never becomes shell text).
ENV_KV_TRANSFER_CONFIG = "KVTIER_KV_TRANSFER_CONFIG"
ENV_KV_EVENTS_CONFIG = "KVTIER_KV_EVENTS_CONFIG"  # precise router scoring (vLLM)
# The evictor's read-only view of event_pods_configmap_name(): one pod identity a line.
VOLUME_EVENT_PODS = "kvtier-event-pods"
EVENT_PODS_MOUNT = "/etc/kvtier/event-pods"
EVENT_PODS_KEY = "pods"


def claim_name(tpc: TieredPrefixCache) -> str | None:
    storage = tpc.spec.storage
    if storage is None:
        return None
    return storage.existing_claim or f"{tpc.name}-kv-cache"


def cronjob_name(tpc: TieredPrefixCache) -> str:
    return f"{tpc.name}-evictor"


def object_evictor_name(tpc: TieredPrefixCache) -> str:
    """The object store's eviction CronJob: no longer than the evictor's, so CR_NAME_MAX
    keeps it within Kubernetes' 52 characters."""
    return f"{tpc.name}-objects"


def router_configmap_name(tpc: TieredPrefixCache) -> str:
    return tpc.spec.router.config_map_name or f"{tpc.name}-router"


def event_pods_configmap_name(tpc: TieredPrefixCache) -> str:
    """The engine pods' router identities the evictor publishes its removals under."""
    return f"{tpc.name}-event-pods"


def owned_labels(tpc: TieredPrefixCache, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/managed-by": "kvtier",
        "app.kubernetes.io/part-of": "kvtier",
        LABEL_CACHE: tpc.name,
        LABEL_COMPONENT: component,
    }


def owner_reference(tpc: TieredPrefixCache) -> dict[str, object]:
    return {
        "apiVersion": tpc.api_version,
        "kind": tpc.kind,
        "name": tpc.name,
        "uid": tpc.metadata.uid or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(tpc: TieredPrefixCache, name: str, component: str, *, owned: bool) -> dict:
    meta: dict[str, object] = {
        "name": name,
        "namespace": tpc.namespace,
        "labels": owned_labels(tpc, component),
    }
    if owned and tpc.metadata.uid:  # offline renders have no uid to point at
        meta["ownerReferences"] = [owner_reference(tpc)]
    return meta
