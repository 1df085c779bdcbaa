"""Which sample workload in examples/ each example TieredPrefixCache selects."""

from __future__ import annotations

from typing import Any

VLLM_GPU = "vllm-deployment.yaml"
TPU_SINGLE_HOST = "tpu-deployment.yaml"
TPU_MULTI_HOST = "tpu-leaderworkerset.yaml"
SGLANG = "sglang-deployment.yaml"


def sample_workload(doc: dict[str, Any]) -> str:
    """The examples/ file holding the workload an example CR is written for."""
    spec = doc.get("spec") or {}
    if spec.get("engine") == "vllm-tpu":
        hosts = (spec.get("tpu") or {}).get("hosts", 1)
        return TPU_MULTI_HOST if hosts > 1 else TPU_SINGLE_HOST
    if spec.get("engine") == "sglang":
        return SGLANG
    return VLLM_GPU
