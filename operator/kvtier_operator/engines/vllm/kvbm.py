"""NVIDIA Dynamo KVBM under vLLM (kvbm's DynamoConnector): a CPU tier in pinned memory
sized by DYN_KVBM_CPU_CACHE_GB. Its disk tier is per process, not a shared tier, so
kvtier offers none here; KVBM evicts on its own."""

from __future__ import annotations

from typing import Any

from kvtier_operator.api.v1alpha1 import Connector, Engine, TieredPrefixCache, TieredPrefixCacheSpec
from kvtier_operator.engines.base import Adapter, PodRole
from kvtier_operator.engines.sizing import GB, PodSizing, pinned_process_sizing
from kvtier_operator.engines.vllm import sizing
from kvtier_operator.engines.vllm.launch import VLLM
from kvtier_operator.engines.vllm.versions import VLLM_VERSIONS

KVBM_CONNECTOR = "DynamoConnector"
KVBM_CONNECTOR_MODULE = "kvbm.vllm_integration.connector"
ENV_CPU_CACHE_GB = "DYN_KVBM_CPU_CACHE_GB"


class VllmKvbm(Adapter):
    engine = Engine.vllm
    versions = VLLM_VERSIONS
    connector = Connector.kvbm
    title = ("vLLM on GPU with NVIDIA KVBM's DynamoConnector: CPU tier in pinned memory "
             "(KVBM's disk tier is per process, not shared)")
    launcher = VLLM

    def validate(self, spec: TieredPrefixCacheSpec) -> None:
        super().validate(spec)
        if sizing.kvbm_cpu_gb(spec) < 1:
            raise ValueError("spec.cpu.size must be at least 1G (10^9 bytes) with connector "
                             "kvbm: DYN_KVBM_CPU_CACHE_GB counts whole GB")

    def launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        return {"kv_connector": KVBM_CONNECTOR, "kv_role": "kv_both",
                "kv_connector_module_path": KVBM_CONNECTOR_MODULE}

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        return super().env(tpc, role) | {ENV_CPU_CACHE_GB: str(sizing.kvbm_cpu_gb(tpc.spec))}

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        return pinned_process_sizing(sizing.kvbm_cpu_gb(spec) * GB, existing_shm_bytes)
