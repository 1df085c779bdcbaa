"""vLLM's MooncakeStoreConnector (built into vLLM 0.32): the KV pool lives in a Mooncake
store (master + clients someone else runs); the pod lends it host memory, reads its
client config from a ConfigMap the CR names, and evicts nothing itself (the master does)."""

from __future__ import annotations

from typing import Any

from kvtier_operator.api.v1alpha1 import Connector, Engine, TieredPrefixCache, TieredPrefixCacheSpec
from kvtier_operator.engines.base import Adapter, ExtraVolume, PodRole, Prerequisite
from kvtier_operator.engines.sizing import PodSizing, pinned_process_sizing
from kvtier_operator.engines.vllm.launch import VLLM
from kvtier_operator.engines.vllm.versions import VLLM_VERSIONS

MOONCAKE_CONNECTOR = "MooncakeStoreConnector"
CONFIG_VOLUME = "kvtier-mooncake-config"
CONFIG_DIR = "/etc/kvtier/mooncake"
ENV_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"  # vllm/distributed/mooncake_store.py reads it


class VllmMooncakeStore(Adapter):
    engine = Engine.vllm
    versions = VLLM_VERSIONS
    connector = Connector.mooncake_store
    title = ("vLLM on GPU with MooncakeStoreConnector: KV pool in a Mooncake store that "
             "evicts on its own (no shared file tier kvtier manages)")
    launcher = VLLM
    settings_block = "mooncake"

    def launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        return {"kv_connector": MOONCAKE_CONNECTOR, "kv_role": "kv_both"}

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        mooncake = tpc.spec.mooncake
        assert mooncake is not None
        return super().env(tpc, role) | {ENV_CONFIG_PATH: f"{CONFIG_DIR}/{mooncake.config_key}"}

    def extra_volumes(self, tpc: TieredPrefixCache) -> list[ExtraVolume]:
        mooncake = tpc.spec.mooncake
        assert mooncake is not None
        return [ExtraVolume(volume={"name": CONFIG_VOLUME, "configMap": {
            "name": mooncake.config_map_name,
            "items": [{"key": mooncake.config_key, "path": mooncake.config_key}]}},
            mount_path=CONFIG_DIR)]

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        # cpu.size: the host memory this pod lends the store (global_segment_size in
        # Mooncake's embedded mode), allocated in the vLLM process.
        return pinned_process_sizing(spec.cpu_bytes, existing_shm_bytes)

    def prerequisites(self, tpc: TieredPrefixCache) -> list[Prerequisite]:
        mooncake = tpc.spec.mooncake
        assert mooncake is not None
        found = [Prerequisite("ConfigMap", tpc.namespace, mooncake.config_map_name,
                              "spec.mooncake.configMapName", key=mooncake.config_key)]
        service = mooncake.master_service
        if service is not None:
            found.append(Prerequisite("Service", service.namespace or tpc.namespace,
                                      service.name, "spec.mooncake.masterService"))
        return found
