"""spec.localDisk: the node-local disk tier (local NVMe) of each replica, between the CPU
tier and the shared volume, bounded by kvtier's backend (LRU within `capacity`)."""

from __future__ import annotations

from functools import cached_property

from pydantic import ConfigDict, Field, model_validator

from kvtier_operator.api.quantity import GIB, MIB, quantity_bytes
from kvtier_operator.api.v1alpha1.fields import (
    STORE_NICE_DESCRIPTION,
    ApiModel,
    HostPath,
    MountPath,
    Quantity,
    StorageClassName,
)

# The volume holds the block files (at most `capacity`) plus what a filesystem and the
# writes in flight need beside them: a tenth more, at least 1 GiB (docs/sizing.md).
HEADROOM_FRACTION = 10
MIN_HEADROOM_BYTES = GIB
ONE_SOURCE = ("spec.localDisk.volume needs exactly one of ephemeral (a claim per pod "
              "from a StorageClass), hostPath (a directory the admin allows) or emptyDir "
              "(the node's ephemeral storage)")
MIN_CAPACITY = 64 * MIB


class EphemeralClaim(ApiModel):
    storage_class_name: StorageClassName | None = Field(
        default=None,
        description="StorageClass of the per-pod claim (local-path, TopoLVM, a local PV "
        "class); omit for the cluster's default class. The claim lives and dies with the "
        "pod (a generic ephemeral volume).",
    )


class HostDirectory(ApiModel):
    path: HostPath = Field(
        description="The node directory: one of the directories the kvtier admin allows "
        "(Helm value localDisk.allowedHostPaths; none by default). The cache mounts "
        "<path>/<namespace>/<name> below it (created if absent). Replicas of this cache on "
        "one node share that directory, each bounding its own writes by capacity "
        "(docs/sizing.md).",
    )


class EmptyDirSource(ApiModel):
    pass


class LocalDiskVolume(ApiModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "(has(self.ephemeral) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + "
                "(has(self.emptyDir) ? 1 : 0) == 1",
        "message": ONE_SOURCE}]})

    ephemeral: EphemeralClaim | None = Field(
        default=None, description="A generic ephemeral volume: a claim per pod of the "
        "tier's volume size from a StorageClass, deleted with the pod.")
    host_path: HostDirectory | None = Field(
        default=None, description="A directory on the node, kept across pod restarts "
        "(blocks found there are verified before use; another model's are never loaded).")
    empty_dir: EmptyDirSource | None = Field(
        default=None, description="An emptyDir on the node's ephemeral storage with a "
        "sizeLimit of the tier's volume size; the pod's ephemeral-storage request grows by "
        "as much, so the kubelet does not evict the pod for it.")

    @model_validator(mode="after")
    def _one_source(self) -> LocalDiskVolume:
        given = [s for s in (self.ephemeral, self.host_path, self.empty_dir) if s is not None]
        if len(given) != 1:
            raise ValueError(ONE_SOURCE.removeprefix("spec.localDisk.volume "))
        return self


class LocalDiskTier(ApiModel):
    capacity: Quantity = Field(
        description="The most bytes the tier's block files take per pod, e.g. 500Gi: "
        "kvtier's backend evicts least recently used blocks to stay within it (vLLM's own "
        "fs tier has no bound). The volume is sized a tenth larger (at least 1Gi more).",
    )
    volume: LocalDiskVolume = Field(description="Where the tier's directory comes from.")
    mount_path: MountPath = Field(
        default="/mnt/kv-local",
        description="Where the volume is mounted in the model-server container.",
    )
    read_threads: int = Field(default=16, ge=1, le=256, description="Parallel file readers.")
    write_threads: int = Field(default=8, ge=1, le=256, description="Parallel file writers.")
    store_nice: int | None = Field(default=None, ge=0, le=19,
                                   description=STORE_NICE_DESCRIPTION)

    @model_validator(mode="after")
    def _room_for_blocks(self) -> LocalDiskTier:
        if self.bytes < MIN_CAPACITY:
            raise ValueError(f"capacity {self.capacity} is too small to hold KV blocks; "
                             "give at least 64Mi, e.g. 500Gi")
        return self

    @cached_property
    def bytes(self) -> int:
        """capacity in bytes, parsed once."""
        return quantity_bytes(self.capacity)

    @property
    def volume_bytes(self) -> int:
        """The volume's size: capacity plus headroom."""
        return self.bytes + max(self.bytes // HEADROOM_FRACTION, MIN_HEADROOM_BYTES)
