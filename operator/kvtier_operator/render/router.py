"""The llm-d router (EPP) plugin config with tier-aware prefix-cache scoring.

Checked against the router's own definitions (plugin type names, parameter names and
types) in llm-d/llm-d-router at ROUTER_COMMIT: the plugin and parameter names below are
the router's `PluginType` constants and `json:` tags there (approximateprefix,
preciseprefixcache, tokenizer, kvcache.Config, kvevents.Config). The two dialects differ
only in where `dataLayer` puts discovery and cross-replica sync (pkg/epp/config/loader,
conversion to llm-d.ai/v1 at ROUTER_V1_COMMIT), which kvtier does not render: one model,
two apiVersions.
"""

from __future__ import annotations

from typing import Any

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import RouterScoring, TieredPrefixCache
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.yamlio import dump

ROUTER_COMMIT = "ebab687927f5331c1b39defcb579a07951bce56c"  # 2026-08-21, main
ROUTER_V1_COMMIT = "10bbcb7e27ea9c061f826d888dd4b95cf3d3faae"  # loader's v1 conversion test

PLUGINS_FILE = "tiered-prefix-cache-plugins.yaml"
# The router values' modelServers block, where the engine narrows the selector.
MODEL_SERVERS_FILE = "model-servers.yaml"

# Plugin types (the router's PluginType constants at ROUTER_COMMIT).
APPROX_PRODUCER = "approx-prefix-cache-producer"
PRECISE_PRODUCER = "precise-prefix-cache-producer"
TOKEN_PRODUCER = "token-producer"
PREFIX_SCORER = "prefix-cache-scorer"
QUEUE_SCORER = "queue-scorer"
KV_UTILIZATION_SCORER = "kv-cache-utilization-scorer"
NO_HIT_LRU_SCORER = "no-hit-lru-scorer"
ENDPOINT_NOTIFICATIONS = "endpoint-notification-source"
METRICS_SOURCE = "metrics-data-source"
METRICS_EXTRACTOR = "core-metrics-extractor"
# The router's KV-events subscription filter (kvevents.DefaultConfig().TopicFilter).
TOPIC_FILTER = "kv@"


def endpoint_picker_config(tpc: TieredPrefixCache,
                           observed_cpu_blocks: int | None = None) -> dict[str, Any]:
    """The router's EndpointPickerConfig in the spec's dialect and scoring mode.

    `observed_cpu_blocks`: the CPU tier's capacity the engines report (in router blocks),
    used instead of the one computed from the model's geometry when given."""
    router = tpc.spec.router
    if router.scoring == RouterScoring.precise:
        body = _precise(tpc)
    else:
        body = _approximate(tpc, observed_cpu_blocks)
    return {"apiVersion": str(router.api_version), "kind": "EndpointPickerConfig", **body}


def _profile(refs: list[str]) -> list[dict[str, Any]]:
    return [{"name": "default", "plugins": [{"pluginRef": r} for r in refs]}]


def _approximate(tpc: TieredPrefixCache, observed_cpu_blocks: int | None) -> dict[str, Any]:
    """GPU and CPU prefix scoring, each from the router's own estimate; without a CPU
    tier, GPU scoring only (files on the shared volume are every replica's, so an
    estimate of them cannot steer routing)."""
    spec = tpc.spec
    adapter = adapter_for(spec)
    block = adapter.router_block_size(spec)
    cpu_blocks = adapter.router_cpu_blocks(spec)
    if cpu_blocks is not None and observed_cpu_blocks is not None:
        cpu_blocks = observed_cpu_blocks
    plugins: list[dict[str, Any]] = [
        {"type": NO_HIT_LRU_SCORER},
        {"type": APPROX_PRODUCER, "name": "gpu-prefix-cache-producer",
         "parameters": {"blockSizeTokens": block}},
    ]
    if cpu_blocks is not None:
        plugins.append(
            {"type": APPROX_PRODUCER, "name": "cpu-prefix-cache-producer",
             "parameters": {
                 # The router's autoTune reads GPU metrics only; the CPU tier's size is
                 # kvtier's (computed, or the engine's own when observed).
                 "autoTune": False,
                 "blockSizeTokens": block,
                 "lruCapacityPerServer": cpu_blocks,
             }})
    plugins += [
        {"type": QUEUE_SCORER},
        {"type": KV_UTILIZATION_SCORER},
        {"type": PREFIX_SCORER, "name": "gpu-prefix-cache-scorer",
         "parameters": {"prefixMatchInfoProducerName": "gpu-prefix-cache-producer"}},
    ]
    refs = [QUEUE_SCORER, KV_UTILIZATION_SCORER, "gpu-prefix-cache-scorer"]
    if cpu_blocks is not None:
        plugins.append({"type": PREFIX_SCORER, "name": "cpu-prefix-cache-scorer",
                        "parameters": {"prefixMatchInfoProducerName":
                                       "cpu-prefix-cache-producer"}})
        refs.append("cpu-prefix-cache-scorer")
    return {"plugins": plugins, "schedulingProfiles": _profile([*refs, NO_HIT_LRU_SCORER])}


def backend_configs(tpc: TieredPrefixCache) -> list[dict[str, Any]]:
    """kvCacheBackendConfigs: every tier the spec configures under the medium its engine
    announces (lowercased, as the router compares), each with its weight. A tier left
    out would score as the router's default for an unknown medium (1.0 at ROUTER_COMMIT,
    0 since the router's PRs #2808/#2809), never what its speed is worth."""
    return [{"name": t.router_name, "weight": t.weight}
            for t in adapter_for(tpc.spec).router_tiers(tpc.spec)]


def _precise(tpc: TieredPrefixCache) -> dict[str, Any]:
    """The KV-events path: a token producer, the precise producer that subscribes to each
    pod's KV events (the pods publish on spec.router.kvEventsPort, kvtier's pod patch) and
    indexes every tier with its weight, and the generic prefix scorer reading it. With
    spec.router.evictionEventsEndpoint the producer also binds that port, where kvtier's
    evictor publishes BlockRemoved for the files it deletes."""
    spec = tpc.spec
    router = spec.router
    adapter = adapter_for(spec)
    kv_events: dict[str, Any] = {
        "topicFilter": TOPIC_FILTER,
        "discoverPods": True,
        "podDiscoveryConfig": {
            "podLabelSelector": ",".join(f"{k}={v}" for k, v in sorted(
                {**(spec.selector.match_labels or {}),
                 **(adapter.router_server_labels(tpc) or {})}.items())),
            "podNamespace": tpc.metadata.namespace,
            "socketPort": router.kv_events_port,
        },
    }
    if router.eviction_events_endpoint is not None:
        port = router.eviction_events_endpoint.rsplit(":", 1)[1]
        kv_events["zmqEndpoint"] = f"tcp://*:{port}"
    plugins: list[dict[str, Any]] = [
        {"type": TOKEN_PRODUCER, "parameters": {"modelName": spec.model.name}},
        {"type": ENDPOINT_NOTIFICATIONS},
        {"type": METRICS_SOURCE},
        {"type": METRICS_EXTRACTOR},
        {"type": PRECISE_PRODUCER, "parameters": {
            "tokenProcessorConfig": {"blockSize": adapter.router_block_size(spec)},
            "indexerConfig": {"kvCacheBackendConfigs": backend_configs(tpc)},
            "kvEventsConfig": kv_events,
        }},
        {"type": PREFIX_SCORER,
         "parameters": {"prefixMatchInfoProducerName": PRECISE_PRODUCER}},
        {"type": QUEUE_SCORER},
        {"type": KV_UTILIZATION_SCORER},
    ]
    return {
        "plugins": plugins,
        "dataLayer": {"sources": [
            {"pluginRef": METRICS_SOURCE, "extractors": [{"pluginRef": METRICS_EXTRACTOR}]},
            {"pluginRef": ENDPOINT_NOTIFICATIONS,
             "extractors": [{"pluginRef": PRECISE_PRODUCER}]},
        ]},
        "schedulingProfiles": _profile([PREFIX_SCORER, QUEUE_SCORER, KV_UTILIZATION_SCORER]),
    }


def render_router_configmap(tpc: TieredPrefixCache,
                            observed_cpu_blocks: int | None = None) -> dict[str, Any] | None:
    if not tpc.spec.router.enabled:
        return None
    data = {PLUGINS_FILE: dump(endpoint_picker_config(tpc, observed_cpu_blocks))}
    servers = model_servers(tpc)
    if servers is not None:
        data[MODEL_SERVERS_FILE] = dump(servers)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(tpc, names.router_configmap_name(tpc), "router", owned=True),
        "data": data,
    }


def model_servers(tpc: TieredPrefixCache) -> dict[str, Any] | None:
    """The router values' model-server block (the llm-d router chart's
    router.modelServers, config/charts/routerlib/values.yaml at ROUTER_COMMIT) where kvtier
    has something to say: the selector where the engine narrows it (multi-host TPU:
    leaders only, the pods that run vLLM's HTTP server: the selector's labels plus the
    adapter's), and the InferencePool's targetPorts where spec.router.targetPorts gives
    them, so the pool and the names kvtier publishes removals under (render/event_pods.py)
    come from one field. None where the chart's own values are right."""
    router = tpc.spec.router
    labels = adapter_for(tpc.spec).router_server_labels(tpc)
    if labels is None and not router.target_ports:
        return None
    servers: dict[str, Any] = {}
    if labels is not None or tpc.spec.selector.match_labels:
        servers["matchLabels"] = {**(tpc.spec.selector.match_labels or {}), **(labels or {})}
    if router.target_ports:
        servers["targetPorts"] = [{"number": port} for port in router.target_ports]
    return {"modelServers": servers}
