"""The vLLM connector configuration: --kv-transfer-config JSON and connector env vars."""

from __future__ import annotations

import json
from typing import Any

from kvtier_operator.models import Connector, StorageBackend, TieredPrefixCache
from kvtier_operator.render import sizing

# The kvtier storage tier, loaded by vLLM's TieringOffloadingSpec from the injected
# package (sidecar/kvtier_offload/vllm_tier.py defines it).
KVTIER_TIER_TYPE = "KvtierStorageTier"
KVTIER_TIER_MODULE = "kvtier_offload.vllm_tier"
# Without a CPU tier: kvtier's own OffloadingSpec (sidecar/kvtier_offload/vllm_spec.py)
# under kvtier's connector (vllm_connector.py), which reports a block it could not load
# so that vLLM recomputes it (vLLM's own OffloadingConnector would stop the engine).
KVTIER_SPEC_NAME = "KvtierOffloadingSpec"
KVTIER_SPEC_MODULE = "kvtier_offload.vllm_spec"
KVTIER_CONNECTOR = "KvtierOffloadingConnector"
KVTIER_CONNECTOR_MODULE = "kvtier_offload.vllm_connector"
LMCACHE_DISK_DIR = "lmcache"


def kv_transfer_config(tpc: TieredPrefixCache) -> dict[str, Any]:
    spec = tpc.spec
    if spec.connector == Connector.lmcache:
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if spec.gpu_direct:
        return _gpu_direct_config(tpc)
    storage = spec.storage
    backend = spec.storage_backend
    extra: dict[str, Any] = {"cpu_bytes_to_use": spec.cpu_bytes}
    if storage is not None and backend is not None:
        tier: dict[str, Any]
        if backend == StorageBackend.vllm_fs:
            tier = {"type": "fs"}
        else:
            tier = {"type": KVTIER_TIER_TYPE, "module_path": KVTIER_TIER_MODULE}
        tier |= {
            "root_dir": storage.mount_path,
            "n_read_threads": storage.read_threads,
            "n_write_threads": storage.write_threads,
        }
        extra = {
            "spec_name": "TieringOffloadingSpec",
            **extra,
            "block_size": storage.file_tokens,
            "secondary_tiers": [tier],
        }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _gpu_direct_config(tpc: TieredPrefixCache) -> dict[str, Any]:
    """No CPU tier: kvtier's connector and spec; a load that fails is recomputed."""
    spec = tpc.spec
    storage = spec.storage
    assert storage is not None  # the model requires the kvtier shared tier
    return {
        "kv_connector": KVTIER_CONNECTOR,
        "kv_connector_module_path": KVTIER_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": KVTIER_SPEC_NAME,
            "spec_module_path": KVTIER_SPEC_MODULE,
            "root_dir": storage.mount_path,
            "n_read_threads": storage.read_threads,
            "n_write_threads": storage.write_threads,
            "max_staging_bytes": sizing.staging_bytes(spec),
        },
    }


def kv_transfer_json(tpc: TieredPrefixCache) -> str:
    return json.dumps(kv_transfer_config(tpc), separators=(",", ":"), sort_keys=False)


def connector_env(tpc: TieredPrefixCache) -> dict[str, str]:
    """Environment the connector needs, by name (merged into the container's env)."""
    spec = tpc.spec
    env = {"PYTHONHASHSEED": str(tpc.hash_seed)}
    if spec.connector == Connector.lmcache:
        env["LMCACHE_LOCAL_CPU"] = "True"
        env["LMCACHE_MAX_LOCAL_CPU_SIZE"] = str(sizing.lmcache_cpu_gb(spec))
        if spec.storage is not None:
            env["LMCACHE_LOCAL_DISK"] = f"file://{spec.storage.mount_path}/{LMCACHE_DISK_DIR}/"
            env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = str(sizing.lmcache_disk_gb(spec))
            env["LMCACHE_CHUNK_SIZE"] = str(spec.storage.file_tokens)
    return env
