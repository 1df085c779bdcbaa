"""vLLM's MooncakeStoreConnector (built into vLLM 0.32): the KV pool lives in a Mooncake
store (master + clients someone else runs); the pod lends it host memory, reads its
client config from a ConfigMap the CR names, and evicts nothing itself (the master does).

Two variants, as llm-d's mooncake-store guides: the pods lend memory segments to the pool
(mode embedded), or, with spec.mooncake.offload, a client DaemonSet owns the pool and its
SSD tier (mode standalone-store) and vLLM loads asynchronously. With protocol rdma each
pod requests the RDMA device. The ConfigMap's content is checked against the spec
(mooncake_config.py) in the PrerequisitesReady condition."""

from __future__ import annotations

from functools import partial
from typing import Any

from kvtier_operator.api.v1alpha1 import (
    Connector,
    Engine,
    MooncakeProtocol,
    TieredPrefixCache,
    TieredPrefixCacheSpec,
)
from kvtier_operator.engines.base import Adapter, ExtraVolume, PodRole, Prerequisite
from kvtier_operator.engines.sizing import PodSizing, pinned_process_sizing
from kvtier_operator.engines.vllm import mooncake_config
from kvtier_operator.engines.vllm.launch import VLLM
from kvtier_operator.engines.vllm.versions import VLLM_VERSIONS

MOONCAKE_CONNECTOR = "MooncakeStoreConnector"
CONFIG_VOLUME = "kvtier-mooncake-config"
CONFIG_DIR = "/etc/kvtier/mooncake"
OFFLOAD_VOLUME = "kvtier-mooncake-offload"
ENV_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"  # vllm/distributed/mooncake_store.py reads it
# kv_connector_extra_config key of the store connector: loads from the store do not block
# the engine's step. vLLM's default is True; written out, as llm-d's SSD variant does, so
# that a changed default cannot turn it off under the SSD tier.
LOAD_ASYNC = "load_async"


class VllmMooncakeStore(Adapter):
    engine = Engine.vllm
    versions = VLLM_VERSIONS
    connector = Connector.mooncake_store
    title = ("vLLM on GPU with MooncakeStoreConnector: KV pool in a Mooncake store that "
             "evicts on its own, in the pods' memory or a client DaemonSet's with its SSD "
             "tier (no shared file tier kvtier manages)")
    launcher = VLLM
    settings_block = "mooncake"

    def launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        options: dict[str, Any] = {"kv_connector": MOONCAKE_CONNECTOR, "kv_role": "kv_both"}
        mooncake = tpc.spec.mooncake
        assert mooncake is not None
        if mooncake.offload is not None:
            options["kv_connector_extra_config"] = {LOAD_ASYNC: True}
        return options

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        mooncake = tpc.spec.mooncake
        assert mooncake is not None
        return super().env(tpc, role) | {ENV_CONFIG_PATH: f"{CONFIG_DIR}/{mooncake.config_key}"}

    def extra_volumes(self, tpc: TieredPrefixCache) -> list[ExtraVolume]:
        mooncake = tpc.spec.mooncake
        assert mooncake is not None
        volumes = [ExtraVolume(volume={"name": CONFIG_VOLUME, "configMap": {
            "name": mooncake.config_map_name,
            "items": [{"key": mooncake.config_key, "path": mooncake.config_key}]}},
            mount_path=CONFIG_DIR)]
        if mooncake.offload is not None:
            # Mooncake's client library checks that the master's root_fs_dir exists; the
            # files themselves are the client DaemonSet's.
            volumes.append(ExtraVolume(volume={"name": OFFLOAD_VOLUME, "emptyDir": {}},
                                       mount_path=mooncake.offload.root_dir,
                                       read_only=False))
        return volumes

    def device_resources(self, spec: TieredPrefixCacheSpec) -> dict[str, str]:
        mooncake = spec.mooncake
        assert mooncake is not None
        if mooncake.protocol == MooncakeProtocol.rdma:
            return {mooncake.rdma_resource: "1"}
        return {}

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        # cpu.size: the host memory this pod lends the store (global_segment_size plus
        # local_buffer_size), allocated in the vLLM process; the ConfigMap is checked
        # against it (mooncake_config.problems).
        return pinned_process_sizing(spec.cpu_bytes, existing_shm_bytes)

    def router_cpu_blocks(self, spec: TieredPrefixCacheSpec) -> int | None:
        # With the SSD tier the pool is the client DaemonSet's, shared by every replica:
        # nothing per replica for a CPU-tier scorer to count.
        mooncake = spec.mooncake
        assert mooncake is not None
        return None if mooncake.offload is not None else super().router_cpu_blocks(spec)

    def prerequisites(self, tpc: TieredPrefixCache) -> list[Prerequisite]:
        mooncake = tpc.spec.mooncake
        assert mooncake is not None
        found = [Prerequisite("ConfigMap", tpc.namespace, mooncake.config_map_name,
                              "spec.mooncake.configMapName", key=mooncake.config_key,
                              check=partial(mooncake_config.problems, tpc.spec))]
        service = mooncake.master_service
        if service is not None:
            found.append(Prerequisite("Service", service.namespace or tpc.namespace,
                                      service.name, "spec.mooncake.masterService"))
        if mooncake.offload is not None:
            client = mooncake.offload.client_daemon_set
            found.append(Prerequisite("DaemonSet", client.namespace or tpc.namespace,
                                      client.name, "spec.mooncake.offload.clientDaemonSet"))
        return found
