"""Shared test builders."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge patch into a copy of base; a None value deletes the key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


BASE_TPC: dict[str, Any] = {
    "apiVersion": "kvtier.dev/v1alpha1",
    "kind": "TieredPrefixCache",
    "metadata": {"name": "cache", "namespace": "ml"},
    "spec": {
        "selector": {"matchLabels": {"llm-d.ai/role": "decode"}},
        "model": {"name": "Qwen/Qwen3-32B", "kvBytesPerToken": 262144},
        "cpu": {"size": "100Gi"},
        "storage": {"pvc": {"size": "1Ti"}},
    },
}


def tpc_doc(spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    doc = merge(BASE_TPC, {"spec": spec or {}})
    doc["metadata"].update(meta)
    return doc


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def vllm_pod(**container: Any) -> dict[str, Any]:
    c = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.32.0",
        "command": ["vllm", "serve"],
        "args": ["Qwen/Qwen3-32B", "--tensor-parallel-size=2"],
    }
    c.update(container)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "decode-0", "namespace": "ml",
                     "labels": {"llm-d.ai/role": "decode"}},
        "spec": {"containers": [c]},
    }
