"""spec.router: the llm-d router (EPP) config kvtier renders."""

from __future__ import annotations

from pydantic import Field

from kvtier_operator.api.v1alpha1.fields import ApiModel, ConfigMapName


class Router(ApiModel):
    enabled: bool = Field(
        default=False,
        description="Render the llm-d router (EPP) prefix-cache scorer config into a ConfigMap.",
    )
    config_map_name: ConfigMapName | None = Field(
        default=None,
        description="Name of that ConfigMap; default <name>-router. Renaming it deletes the "
        "one the operator made under the old name."
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="Tokens per router prefix block (the EPP's blockSizeTokens); the CPU "
        "lruCapacityPerServer is computed with it. Default: the engine's (16 for vLLM).",
    )

