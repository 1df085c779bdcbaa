"""The evictor CronJob that keeps the shared volume under its watermarks."""

from __future__ import annotations

from typing import Any

from kvtier_operator import names
from kvtier_operator.api.quantity import quantity_bytes
from kvtier_operator.api.v1alpha1 import CapacitySource, TieredPrefixCache
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.render.event_pods import publishes_events

EVICTOR_MOUNT = "/kv-cache"
EVICTOR_UID = 65532


def evictor_layout(tpc: TieredPrefixCache) -> str | None:
    """Which file layout the evictor may touch (it never touches anything else); None:
    no evictor (no shared tier kvtier manages, or the engine evicts on its own)."""
    return adapter_for(tpc.spec).evictor_layout(tpc.spec)


def evictor_args(tpc: TieredPrefixCache) -> list[str]:
    ev = tpc.spec.eviction
    storage = tpc.spec.storage
    assert storage is not None
    layout = evictor_layout(tpc)
    assert layout is not None
    args = [
        "--root", EVICTOR_MOUNT,
        "--layout", layout,
        "--high-watermark", str(ev.high_watermark),
        "--low-watermark", str(ev.low_watermark),
        "--inode-high-watermark", str(ev.inode_high_watermark),
        "--inode-low-watermark", str(ev.inode_low_watermark),
        "--min-idle-seconds", str(ev.min_idle_seconds),
        "--termination-log", "/dev/termination-log",
        # A freed run is a success for the Job; the outcome itself is in the report.
        "--ok-exit-zero",
    ]
    if ev.capacity == CapacitySource.ClaimSize:
        if storage.pvc is not None:
            args += ["--capacity-bytes", str(quantity_bytes(storage.pvc.size))]
    endpoint = tpc.spec.router.eviction_events_endpoint
    if publishes_events(tpc) and endpoint is not None:
        # The router binds this port (render/router.py); layouts without a hash mapping
        # count their names as ignored. The topic's model segment is the engines' own
        # (engines/vllm/gpu.kv_events_config); the evictor publishes once per pod listed in
        # the event-pods file, under that pod's identity (render/event_pods.py).
        args += ["--events-endpoint", endpoint,
                 "--events-topic", f"kv@{tpc.metadata.name}@{tpc.spec.model.name}",
                 "--events-pods-file", f"{names.EVENT_PODS_MOUNT}/{names.EVENT_PODS_KEY}"]
    return args


def render_cronjob(tpc: TieredPrefixCache, ctx: RenderContext) -> dict[str, Any] | None:
    storage = tpc.spec.storage
    claim = names.claim_name(tpc)
    if storage is None or claim is None or evictor_layout(tpc) is None:
        return None
    ev = tpc.spec.eviction
    pod_security = pod_security_context()
    # The model servers' group: eviction.fsGroup, else the one they write the tier as.
    group = ev.fs_group
    if group is None and storage.permissions is not None:
        group = storage.permissions.fs_group
    if group is not None:
        pod_security["fsGroup"] = group
        pod_security["fsGroupChangePolicy"] = "OnRootMismatch"
    container = {
        "name": "evictor",
        "image": ctx.evictor_image,
        "imagePullPolicy": ctx.image_pull_policy,
        "command": ["kvtier-evictor"],
        "args": evictor_args(tpc),
        "volumeMounts": [{"name": names.VOLUME_CACHE, "mountPath": EVICTOR_MOUNT}, *(
            [{"name": names.VOLUME_EVENT_PODS, "mountPath": names.EVENT_PODS_MOUNT,
              "readOnly": True}] if publishes_events(tpc) else [])],
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"cpu": "2", "memory": "512Mi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    volumes = [{"name": names.VOLUME_CACHE, "persistentVolumeClaim": {"claimName": claim}},
               # optional: without it the run publishes nothing and says why; eviction
               # never waits for it
               *([{"name": names.VOLUME_EVENT_PODS, "configMap": {
                   "name": names.event_pods_configmap_name(tpc), "optional": True}}]
                 if publishes_events(tpc) else [])]
    return job_cronjob(tpc, names.cronjob_name(tpc), "evictor", ev.schedule,
                       {"securityContext": pod_security, "containers": [container],
                        "volumes": volumes}, suspend=ev.suspend)


def pod_security_context() -> dict[str, Any]:
    """The evictors' pods: non-root as EVICTOR_UID, seccomp RuntimeDefault."""
    return {"runAsNonRoot": True, "runAsUser": EVICTOR_UID, "runAsGroup": EVICTOR_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def job_cronjob(tpc: TieredPrefixCache, name: str, component: str, schedule: str,
                pod_spec: dict[str, Any], suspend: bool | None = None) -> dict[str, Any]:
    """A CronJob the cache owns, as kvtier runs its evictors: one run at a time, no
    retries, an hour at most, no service-account token; pod_spec adds the rest."""
    labels = names.owned_labels(tpc, component)
    spec: dict[str, Any] = {
        "schedule": schedule,
        "concurrencyPolicy": "Forbid",
        "startingDeadlineSeconds": 120,
        "successfulJobsHistoryLimit": 3,
        "failedJobsHistoryLimit": 3,
    }
    if suspend is not None:
        spec["suspend"] = suspend
    spec["jobTemplate"] = {
        "metadata": {"labels": labels},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 3600,
            "template": {
                "metadata": {"labels": labels},
                "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                         **pod_spec},
            },
        },
    }
    return {"apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": names.metadata(tpc, name, component, owned=True), "spec": spec}
