"""The engine's connector configuration, from its adapter: the options its command line
gets (vLLM: the --kv-transfer-config JSON) and the env vars its connector reads."""

from __future__ import annotations

from typing import Any

from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.engines.base import PodRole
from kvtier_operator.engines.registry import adapter_for


def kv_transfer_config(tpc: TieredPrefixCache) -> dict[str, Any]:
    """The options the engine's command line gets (for vLLM, --kv-transfer-config)."""
    options: dict[str, Any] = adapter_for(tpc.spec).launch_options(tpc)
    return options


def connector_env(tpc: TieredPrefixCache, role: PodRole = PodRole.server) -> dict[str, str]:
    """Environment the connector needs, by name (merged into the container's env)."""
    return adapter_for(tpc.spec).env(tpc, role)
