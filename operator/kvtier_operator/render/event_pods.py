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
from kvtier_operator.engines.registry import adapter_for

# The router's name of a pod, checked at llm-d-router ebab687: `<pod IP>:<port>`, the port
# one of its InferencePool's targetPorts (one endpoint per port, pkg/epp/datastore/
# datastore.go:332-346: Address = pod.Status.PodIP, Port = TargetPorts[rank]), never the
# KV-events port. Its per-pod subscriber indexes a pod's own events under
# fmt.Sprintf("%s:%s", Address, Port) (preciseprefixcache/extractor.go:80, which
# replaces the topic's pod, pkg/kvevents/pool.go:321-323), and scoring looks entries up by
# the same (preciseprefixcache/producer.go:379, utils.go:37). On the bound socket the
# evictor publishes to, the topic's pod segment is the name (engineadapter/common.go:
# 36-45), so it must be exactly this; a BlockRemoved under another name finds no KV cache
# group for it and is skipped (pool.go:589-607). IPv6 unbracketed, as Go's %s:%s writes it.
POD_IDENTITY = "{ip}:{port}"
# At most this many identities a cache (pods x target ports): a larger selection
# publishes to the first pods (sorted by address), each with all its ports, and the
# evictor's copies stay bounded (each removal batch is sent once per identity).
MAX_EVENT_PODS = 256


def publishes_events(tpc: TieredPrefixCache) -> bool:
    """Whether the evictor publishes removals (the router takes them at its endpoint)."""
    return tpc.spec.router.enabled and tpc.spec.router.eviction_events_endpoint is not None


def event_pod_identities(tpc: TieredPrefixCache, pod_ips: Iterable[str]) -> list[str]:
    """The router identities of the pods at these addresses, one per target port (the
    InferencePool's, adapter.router_target_ports): sorted, at most MAX_EVENT_PODS, and
    whole pods only (a pod keeps all its ports' names or none)."""
    ports = adapter_for(tpc.spec).router_target_ports(tpc.spec)
    pods = sorted(set(pod_ips))[:MAX_EVENT_PODS // max(1, len(ports))]
    return sorted({POD_IDENTITY.format(ip=ip, port=port) for ip in pods for port in ports})


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
