"""The CronJob that holds the object store's tier to its byte budget (spec.objectStore):
`python -m kvtier_offload evict-objects` from the offload image (boto3 lives there),
deleting the oldest block objects under the prefix until the rest fit the budget.

One job per cache lists the bucket once; the replicas never evict (each would list the
same bucket and race the others' deletes). The credentials reach the job as the pods'
do: env from the Secret, by reference. It mounts nothing and needs no API access.
"""

from __future__ import annotations

from typing import Any

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.chained_tiers import credential_env
from kvtier_operator.render.cronjob import job_cronjob, pod_security_context
from kvtier_operator.validation.object_endpoints import object_endpoint_refusal

OBJECT_EVICTOR = "object-evictor"  # its container and component label


def object_evictor_args(tpc: TieredPrefixCache) -> list[str]:
    store = tpc.spec.object_store
    assert store is not None
    args = ["evict-objects", "--bucket", store.bucket, "--prefix", store.prefix,
            "--budget-bytes", str(store.budget_bytes),
            "--min-age-seconds", str(store.min_age_seconds),
            "--addressing-style", str(store.addressing_style)]
    if store.endpoint is not None:
        args += ["--endpoint-url", store.endpoint]
    if store.region is not None:
        args += ["--region", store.region]
    return args


def render_object_evictor(tpc: TieredPrefixCache, ctx: RenderContext) -> dict[str, Any] | None:
    """The CronJob, or None where the cache has no object store."""
    if tpc.spec.object_store is None:
        return None
    if object_endpoint_refusal(tpc.spec, ctx.allowed_object_endpoints):
        return None  # its endpoint is not one the admin allows: no job gets the Secret
    container = {
        "name": OBJECT_EVICTOR,
        "image": ctx.offload_image,
        "imagePullPolicy": ctx.image_pull_policy,
        "command": ["python3", "-m", "kvtier_offload"],
        "args": object_evictor_args(tpc),
        "env": [e.entry() for e in credential_env(tpc.spec)],
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            # The listing is held in memory, about 150 bytes an object: 1Gi holds ~7M.
            "limits": {"cpu": "1", "memory": "1Gi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return job_cronjob(tpc, names.object_evictor_name(tpc), OBJECT_EVICTOR,
                       tpc.spec.object_store.eviction_schedule,
                       {"securityContext": pod_security_context(), "containers": [container]})
