"""The engine pods' router identities, for the evictor's per-pod BlockRemoved.

The llm-d router (ebab687) keys each index entry by the pod that announced it and has no
pool identity for a shared tier (llm-d-router #2586, open). On its bound socket the pod
is the middle segment of the topic `kv@<pod>@<model>`. So the evictor publishes each
removal batch once per pod, under `kv@<identity>@<model>`, and needs the identities: this
ConfigMap, one a line, owned by the cache, mounted read-only into the evictor CronJob.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import TieredPrefixCache

# The router's identity of a pod. Assumed, not confirmed against the router's source from
# here: `<pod IP>:<port>` of its per-pod subscriber, the port being where the pods publish
# KV events (spec.router.kvEventsPort, the router's podDiscoveryConfig.socketPort). llm-d's
# centralised-publisher guides name pods `$(POD_IP):$(POD_PORT)` with the serving port
# instead; should that be the router's, this is the one line to change.
POD_IDENTITY = "{ip}:{port}"
# At most this many pods a cache: a larger selection publishes to the first ones (sorted)
# and the evictor's copies stay bounded (each removal batch is sent once per pod).
MAX_EVENT_PODS = 256


def publishes_events(tpc: TieredPrefixCache) -> bool:
    """Whether the evictor publishes removals (the router takes them at its endpoint)."""
    return tpc.spec.router.enabled and tpc.spec.router.eviction_events_endpoint is not None


def event_pod_identities(tpc: TieredPrefixCache, pod_ips: Iterable[str]) -> list[str]:
    """The router identities of the pods at these addresses: sorted, at most
    MAX_EVENT_PODS."""
    port = tpc.spec.router.kv_events_port
    return sorted({POD_IDENTITY.format(ip=ip, port=port) for ip in pod_ips})[:MAX_EVENT_PODS]


def render_event_pods_configmap(tpc: TieredPrefixCache, pod_ips: Iterable[str]
                                ) -> dict[str, Any] | None:
    """pod_ips: the addresses of the cache's injected, running pods. None where the
    evictor publishes nothing (the reconcile then deletes the ConfigMap)."""
    if not publishes_events(tpc):
        return None
    lines = event_pod_identities(tpc, pod_ips)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(tpc, names.event_pods_configmap_name(tpc), "event-pods",
                                   owned=True),
        "data": {names.EVENT_PODS_KEY: "".join(f"{line}\n" for line in lines)},
    }
