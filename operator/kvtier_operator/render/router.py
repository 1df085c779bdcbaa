"""The llm-d router (EPP) plugin config with tier-aware prefix-cache scoring."""

from __future__ import annotations

from typing import Any

from kvtier_operator.models import TieredPrefixCache
from kvtier_operator.render import names, sizing
from kvtier_operator.yamlio import dump

PLUGINS_FILE = "tiered-prefix-cache-plugins.yaml"


def endpoint_picker_config(tpc: TieredPrefixCache) -> dict[str, Any]:
    spec = tpc.spec
    block = spec.router.block_size
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "no-hit-lru-scorer"},
            {"type": "approx-prefix-cache-producer", "name": "gpu-prefix-cache-producer",
             "parameters": {"blockSizeTokens": block}},
            {"type": "approx-prefix-cache-producer", "name": "cpu-prefix-cache-producer",
             "parameters": {
                 # vLLM exports no CPU-tier capacity metric, so autoTune cannot size it.
                 "autoTune": False,
                 "blockSizeTokens": block,
                 "lruCapacityPerServer": sizing.router_lru_capacity(spec),
             }},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer", "name": "gpu-prefix-cache-scorer",
             "parameters": {"prefixMatchInfoProducerName": "gpu-prefix-cache-producer"}},
            {"type": "prefix-cache-scorer", "name": "cpu-prefix-cache-scorer",
             "parameters": {"prefixMatchInfoProducerName": "cpu-prefix-cache-producer"}},
        ],
        "schedulingProfiles": [
            {"name": "default", "plugins": [
                {"pluginRef": "queue-scorer"},
                {"pluginRef": "kv-cache-utilization-scorer"},
                {"pluginRef": "gpu-prefix-cache-scorer"},
                {"pluginRef": "cpu-prefix-cache-scorer"},
                {"pluginRef": "no-hit-lru-scorer"},
            ]},
        ],
    }


def render_router_configmap(tpc: TieredPrefixCache) -> dict[str, Any] | None:
    if not tpc.spec.router.enabled:
        return None
    text = dump(endpoint_picker_config(tpc))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(tpc, names.router_configmap_name(tpc), "router", owned=True),
        "data": {PLUGINS_FILE: text},
    }
