"""spec.peerSharing: replicas sharing KV blocks with each other, without shared storage.

Refused for now, with the reason (docs/architecture.md, "Peer sharing"): no engine kvtier
supports has a peer-sharing mode that works between replicas of a cache without things
kvtier cannot provide. The field exists so that a cache asking for it is told why, at
the API server, rather than told the field is unknown."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from kvtier_operator.api.v1alpha1.fields import ENUM_BOUND, ApiModel

PEER_SHARING_REFUSED = (
    "spec.peerSharing is not available: no engine kvtier supports can share KV blocks "
    "between replicas without shared storage in a way kvtier can run for you today "
    "(vLLM's p2p tier needs NIXL and a router that names the peer in every request; "
    "LMCache P2P needs its controller and NIXL; Mooncake's transfer engine needs RDMA "
    "and its master: docs/architecture.md, Peer sharing). Remove peerSharing; share "
    "through spec.storage (a ReadWriteMany volume) or spec.objectStore (S3)")


class PeerMechanism(StrEnum):
    vllm_p2p = "vllm-p2p"  # vLLM's p2p secondary tier (NIXL data, ZMQ control)
    lmcache_p2p = "lmcache-p2p"  # LMCache's P2P sharing (controller + NIXL)
    mooncake = "mooncake"  # Mooncake's transfer engine


class PeerSharing(ApiModel):
    mechanism: PeerMechanism | None = Field(
        default=None, json_schema_extra=ENUM_BOUND,
        description="Refused whatever it says (see spec.peerSharing).")
