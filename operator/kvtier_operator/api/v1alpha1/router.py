"""spec.router: the llm-d router (EPP) config kvtier renders."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, TypeAlias

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvtier_operator.api.v1alpha1.fields import ApiModel, ConfigMapName, ZmqEndpoint

# A TCP port a pod serves on.
Port: TypeAlias = Annotated[int, Field(ge=1, le=65535)]
# An InferencePool's targetPorts (the Gateway API inference extension allows 8).
MAX_TARGET_PORTS = 8


class RouterApiVersion(StrEnum):
    """The router config's dialect. Both carry the same plugins and scheduling profiles;
    llm-d.ai/v1 is the current one, llm-d.ai/v1alpha1 what older routers load."""

    v1 = "llm-d.ai/v1"
    v1alpha1 = "llm-d.ai/v1alpha1"


class RouterScoring(StrEnum):
    # The router guesses each pod's prefix cache from what it routed (per-tier LRUs).
    approximate = "approximate"
    # The engines publish KV events; the router indexes what each pod really holds.
    precise = "precise"


class TierWeights(ApiModel):
    """A hit's worth on each tier relative to a GPU hit (1.0); unset: the engine's default
    from the tier's speed (docs/modes.md, "Routing")."""

    gpu: float | None = Field(default=None, ge=0, le=1,
                              description="A GPU (HBM) hit; default 1.0.")
    cpu: float | None = Field(default=None, ge=0, le=1,
                              description="A CPU-tier hit; default 0.8.")
    local_disk: float | None = Field(
        default=None, ge=0, le=1, description="A hit on the node's local disk "
        "(spec.localDisk); default 0.6.")
    storage: float | None = Field(default=None, ge=0, le=1,
                                  description="A hit on the shared volume; default 0.4.")
    object_store: float | None = Field(
        default=None, ge=0, le=1, description="A hit in the object store "
        "(spec.objectStore); default 0.2.")

    def of(self, tier: str) -> float | None:
        """The weight given for a tier by its name (status.tiers[].name: gpu, cpu,
        localDisk, storage, objectStore); None: unset."""
        for name, info in type(self).model_fields.items():
            if tier in (name, info.alias):
                return getattr(self, name)
        raise KeyError(tier)


# Removals the router could never take: it binds the endpoint and indexes the pods' KV
# events only in the precise config kvtier renders (render/router.py).
EVICTION_EVENTS_NEED_PRECISE = (
    "spec.router.evictionEventsEndpoint: the router takes the evictor's removals only "
    "with the precise config kvtier renders (the pods' KV events, the bound endpoint); "
    "set spec.router.enabled: true and scoring: precise, or remove evictionEventsEndpoint")


class Router(ApiModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!has(self.evictionEventsEndpoint) || (has(self.enabled) && self.enabled "
                "&& has(self.scoring) && self.scoring == 'precise')",
        "message": EVICTION_EVENTS_NEED_PRECISE}]})

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
    api_version: RouterApiVersion = Field(
        default=RouterApiVersion.v1,
        description="The router config's apiVersion: llm-d.ai/v1 (current routers) or "
        "llm-d.ai/v1alpha1 (older ones).",
    )
    scoring: RouterScoring = Field(
        default=RouterScoring.approximate,
        description="approximate: the router estimates each pod's cache per tier from its "
        "own routing. precise: the pods publish KV events (kvtier adds --kv-events-config) "
        "and the router indexes them, every tier weighted.",
    )
    tier_weights: TierWeights = Field(
        default_factory=TierWeights,
        description="Per-tier weight of a prefix hit (0..1, GPU 1.0) in precise scoring; "
        "unset tiers take the engine's defaults from their speed. The router weighs by the "
        "medium a tier announces: vLLM's local disk, shared volume and object store all "
        "announce STORAGE, so they share one weight, the fastest configured one's.",
    )
    kv_events_port: int = Field(
        default=5557, ge=1024, le=65535,
        description="precise: the port each pod publishes KV events on (the router "
        "connects to <pod IP>:<port>).",
    )
    target_ports: list[Port] | None = Field(
        default=None, min_length=1, max_length=MAX_TARGET_PORTS,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="The ports the router sends these pods' requests to: its "
        "InferencePool's targetPorts, in the same order (one a data-parallel rank). The "
        "router names a pod <pod IP>:<port>, one per port, and the evictor's removals are "
        "sent under those names. Default: the engine's serving port (vLLM 8000).",
    )
    eviction_events_endpoint: ZmqEndpoint | None = Field(
        default=None,
        description="Where the evictor publishes BlockRemoved for every block file it "
        "deletes, as tcp://<host>:<port> (a router-side KV-events endpoint, e.g. its "
        "Service); unset: the evictor publishes nothing. Failures never block eviction.",
    )

    @model_validator(mode="after")
    def _eviction_events_need_precise(self) -> Router:
        if self.eviction_events_endpoint is not None and not (
                self.enabled and self.scoring == RouterScoring.precise):
            raise ValueError(EVICTION_EVENTS_NEED_PRECISE)
        return self

    @field_validator("target_ports")
    @classmethod
    def _ports_once(cls, ports: list[int] | None) -> list[int] | None:
        if ports is not None and len(set(ports)) != len(ports):
            raise ValueError("spec.router.targetPorts lists a port twice; list each once, "
                             "as in the InferencePool's targetPorts")
        return ports
