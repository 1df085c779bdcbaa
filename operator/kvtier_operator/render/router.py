"""The llm-d router (EPP) plugin config with tier-aware prefix-cache scoring."""

from __future__ import annotations

from typing import Any

from kvtier_operator.models import TieredPrefixCache
from kvtier_operator.render import names, sizing
from kvtier_operator.yamlio import dump

PLUGINS_FILE = "tiered-prefix-cache-plugins.yaml"


def endpoint_picker_config(tpc: TieredPrefixCache) -> dict[str, Any]:
    """GPU and CPU prefix scoring; without a CPU tier, GPU scoring only (files on the
    shared volume are every replica's, so they do not steer routing)."""
    spec = tpc.spec
    block = spec.router.block_size
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
             "lruCapacityPerServer": sizing.router_lru_capacity(spec),
         }},
    ]
    plugins += [] if spec.gpu_direct else cpu_plugins
    plugins += [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer", "name": "gpu-prefix-cache-scorer",
         "parameters": {"prefixMatchInfoProducerName": "gpu-prefix-cache-producer"}},
    ]
    if not spec.gpu_direct:
        plugins.append({"type": "prefix-cache-scorer", "name": "cpu-prefix-cache-scorer",
                        "parameters": {"prefixMatchInfoProducerName":
                                       "cpu-prefix-cache-producer"}})
    refs = ["queue-scorer", "kv-cache-utilization-scorer", "gpu-prefix-cache-scorer"]
    refs += [] if spec.gpu_direct else ["cpu-prefix-cache-scorer"]
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
    text = dump(endpoint_picker_config(tpc))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(tpc, names.router_configmap_name(tpc), "router", owned=True),
        "data": {PLUGINS_FILE: text},
    }
