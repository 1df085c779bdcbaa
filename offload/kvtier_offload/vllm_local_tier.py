"""kvtier's tier on a node-local directory (local NVMe, a hostPath, an emptyDir): the
block store bounded by a byte capacity, least recently used blocks evicted inside the
backend (capacity.py). It goes between vLLM's CPU tier and the shared volume, first in
secondary_tiers (vLLM stores every chunk to all its tiers and looks them up in order):

    "secondary_tiers": [
      {"type": "KvtierLocalTier", "module_path": "kvtier_offload.vllm_local_tier",
       "root_dir": "/mnt/kv-local", "capacity_bytes": 500000000000},
      {"type": "KvtierStorageTier", "module_path": "kvtier_offload.vllm_tier",
       "root_dir": "/mnt/files-storage"}]

A class of its own, not a setting of KvtierStorageTier: vLLM labels every tier's metrics
with its type, so the local and the shared tier must not share one. Every other setting
is KvtierStorageTier's; locality defaults to LOCAL (on its KV events).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvtier_offload.vllm_tier import KvtierStorageTier


class KvtierLocalTier(KvtierStorageTier):
    metrics_tier: ClassVar[str] = "localDisk"

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 root_dir: str, capacity_bytes: int | str | None = None,
                 locality: str | None = "LOCAL", **settings: Any) -> None:
        if capacity_bytes is None:
            raise ValueError(f"{type(self).__name__} at {root_dir} needs capacity_bytes: "
                             "the most bytes its block files may take on the node's disk")
        super().__init__(offloading_spec, primary_kv_view, tier_type, root_dir,
                         capacity_bytes=capacity_bytes, locality=locality, **settings)
