"""The llm-d router (EPP) plugin config with tier-aware prefix-cache scoring."""

from __future__ import annotations

from typing import Any

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.yamlio import dump

PLUGINS_FILE = "tiered-prefix-cache-plugins.yaml"
# The router values' modelServers block, where the engine narrows the selector.
MODEL_SERVERS_FILE = "model-servers.yaml"


def endpoint_picker_config(tpc: TieredPrefixCache) -> dict[str, Any]:
    """GPU and CPU prefix scoring; without a CPU tier, GPU scoring only (files on the
    shared volume are every replica's, so they do not steer routing)."""
    spec = tpc.spec
    adapter = adapter_for(spec)
    block = adapter.router_block_size(spec)
    cpu_blocks = adapter.router_cpu_blocks(spec)
    plugins: list[dict[str, Any]] = [
        {"type": "no-hit-lru-scorer"},
        {"type": "approx-prefix-cache-producer", "name": "gpu-prefix-cache-producer",
         "parameters": {"blockSizeTokens": block}},
    ]
    cpu_plugins: list[dict[str, Any]] = [
        {"type": "approx-prefix-cache-producer", "name": "cpu-prefix-cache-producer",
         "parameters": {
             # vLLM exports no CPU-tier capacity metric, so autoTune cannot size it.
             "autoTune": False,
             "blockSizeTokens": block,
             "lruCapacityPerServer": cpu_blocks,
         }},
    ]
    plugins += [] if cpu_blocks is None else cpu_plugins
    plugins += [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer", "name": "gpu-prefix-cache-scorer",
         "parameters": {"prefixMatchInfoProducerName": "gpu-prefix-cache-producer"}},
    ]
    if cpu_blocks is not None:
        plugins.append({"type": "prefix-cache-scorer", "name": "cpu-prefix-cache-scorer",
                        "parameters": {"prefixMatchInfoProducerName":
                                       "cpu-prefix-cache-producer"}})
    refs = ["queue-scorer", "kv-cache-utilization-scorer", "gpu-prefix-cache-scorer"]
    refs += [] if cpu_blocks is None else ["cpu-prefix-cache-scorer"]
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": [
            {"name": "default",
             "plugins": [{"pluginRef": r} for r in [*refs, "no-hit-lru-scorer"]]},
        ],
    }


def render_router_configmap(tpc: TieredPrefixCache) -> dict[str, Any] | None:
    if not tpc.spec.router.enabled:
        return None
    data = {PLUGINS_FILE: dump(endpoint_picker_config(tpc))}
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
    """The router values' model-server selector where the engine narrows it (multi-host
    TPU: leaders only, the pods that run vLLM's HTTP server): the selector's labels plus
    the adapter's. None where the user's selector is the router's."""
    labels = adapter_for(tpc.spec).router_server_labels(tpc)
    if labels is None:
        return None
    return {"modelServers": {"matchLabels": {**(tpc.spec.selector.match_labels or {}),
                                             **labels}}}
