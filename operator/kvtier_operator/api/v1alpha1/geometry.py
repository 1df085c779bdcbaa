"""spec.model: the served model and its KV geometry (bytes per token)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvtier_operator.api.v1alpha1.fields import ApiModel, ModelName

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


class ModelGeometry(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.kvBytesPerToken) || (has(self.layers) && has(self.kvHeads)"
                    " && has(self.headDim) && has(self.dtype))",
                    "message": "spec.model needs kvBytesPerToken, or all of layers, kvHeads, "
                    "headDim and dtype",
                }
            ]
        }
    )
    name: ModelName = Field(
        description="Model name as vLLM serves it (e.g. Qwen/Qwen3-32B); used by LMCache "
        "and the router config.",
    )
    kv_bytes_per_token: int | None = Field(
        default=None,
        gt=0,
        description="KV-cache bytes one token occupies in one replica, summed over all "
        "layers and tensor-parallel ranks. Give this, or layers/kvHeads/headDim/dtype.",
    )
    layers: int | None = Field(default=None, gt=0, description="Attention layers holding KV.")
    kv_heads: int | None = Field(
        default=None, gt=0, description="KV heads per layer (num_key_value_heads)."
    )
    head_dim: int | None = Field(default=None, gt=0, description="Dimension of one head.")
    dtype: Literal["bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = (
        Field(default=None, description="KV-cache dtype: bfloat16, float16, float32 or fp8*.")
    )

    kv_cache_groups: int = Field(
        default=1, ge=1, le=64,
        description="KV cache groups vLLM makes for the model: 1 for a model whose layers "
        "all hold full-attention KV (dense, GQA, MLA); more for a hybrid model (sliding-"
        "window or Mamba layers beside full attention; vLLM logs the groups at start). "
        "kvBytesPerToken (or layers x kvHeads x headDim x 2 x dtype) is then the sum over "
        "every group's layers. kvtier refuses what vLLM cannot do with several groups "
        "(in-step loads, spec.syncLoadBudget).",
    )

    @model_validator(mode="after")
    def _geometry(self) -> ModelGeometry:
        parts = {"layers": self.layers, "kvHeads": self.kv_heads, "headDim": self.head_dim,
                 "dtype": self.dtype}
        given = [k for k, v in parts.items() if v is not None]
        if given and len(given) < len(parts):
            missing = ", ".join(k for k in parts if parts[k] is None)
            raise ValueError(
                f"incomplete KV geometry: {missing} missing; give all of layers, kvHeads, "
                "headDim and dtype, or only kvBytesPerToken"
            )
        if not given and self.kv_bytes_per_token is None:
            raise ValueError(
                "no KV geometry: give kvBytesPerToken, or layers, kvHeads, headDim and dtype"
            )
        if given and self.kv_bytes_per_token is not None:
            computed = self._computed()
            if computed != self.kv_bytes_per_token:
                raise ValueError(
                    f"kvBytesPerToken {self.kv_bytes_per_token} disagrees with "
                    f"layers x kvHeads x headDim x 2 x dtype bytes = {computed}; "
                    "fix one or give only one of them"
                )
        return self

    def _computed(self) -> int:
        assert self.layers and self.kv_heads and self.head_dim and self.dtype
        return self.layers * self.kv_heads * self.head_dim * 2 * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token if self.kv_bytes_per_token is not None else self._computed()

