"""The tiers of a cache: spec.cpu (CPU RAM per replica) and spec.storage (the shared
file tier on a PersistentVolumeClaim)."""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from typing import Literal, TypeAlias

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvtier_operator.api.quantity import MIB, quantity_bytes
from kvtier_operator.api.v1alpha1.fields import (
    ENUM_BOUND,
    STORE_NICE_DESCRIPTION,
    ApiModel,
    ClaimName,
    MountPath,
    Quantity,
    StorageClassName,
)

DEFAULT_FILE_TOKENS = 256  # storage.blockSize when unset
HOST_STAGING_TWICE = ("spec.storage: stagingSize is hostStagingSize's deprecated name; give "
                      "only hostStagingSize")


class StorageBackend(StrEnum):
    kvtier = "kvtier"
    vllm_fs = "vllm-fs"


class DeletePolicy(StrEnum):
    Retain = "Retain"
    Delete = "Delete"



class CpuTier(ApiModel):
    size: Quantity = Field(
        description="CPU RAM tier per replica (vLLM cpu_bytes_to_use), e.g. 100Gi. The pod's "
        "memory request and /dev/shm grow by this much (see docs/sizing.md)."
    )

    @cached_property
    def bytes(self) -> int:
        """size in bytes, parsed once."""
        return quantity_bytes(self.size)


# ----------------------------------------------------------------- storage


ONCE_POD_ALONE = ("spec.storage.pvc.accessModes: ReadWriteOncePod cannot be combined with "
                  "other access modes (Kubernetes refuses such a claim); use ReadWriteMany to "
                  "share the tier")


AccessMode: TypeAlias = Literal[
    "ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany"]


def _share_by_default() -> list[AccessMode]:
    return ["ReadWriteMany"]


class ClaimTemplate(ApiModel):
    size: Quantity = Field(description="Requested capacity of the new PVC, e.g. 9000Gi.")
    storage_class_name: StorageClassName | None = Field(
        default=None,
        description="StorageClass of the new PVC (e.g. lustre, efs-sc). Omit for the "
        "cluster's default class; an explicit empty string is refused.",
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_share_by_default,
        json_schema_extra={"default": ["ReadWriteMany"], "x-kubernetes-validations": [
            {"rule": "size(self) == 1 || !self.exists(m, m == 'ReadWriteOncePod')",
             "message": ONCE_POD_ALONE}]},
        min_length=1,
        description="Access modes of the new PVC. ReadWriteMany lets every replica share it.",
    )

    @field_validator("access_modes")
    @classmethod
    def _once_pod_alone(cls, value: list[str]) -> list[str]:
        if "ReadWriteOncePod" in value and len(value) > 1:
            raise ValueError(ONCE_POD_ALONE.split(": ", 1)[1])
        return value
    delete_policy: DeletePolicy = Field(
        default=DeletePolicy.Retain,
        description="Retain keeps the PVC and its cached KV when the TieredPrefixCache is "
        "deleted; Delete removes it with the resource.",
    )

    @field_validator("storage_class_name", mode="before")
    @classmethod
    def _no_empty_class(cls, value: object) -> object:
        if value == "":
            raise ValueError(
                "an empty storageClassName disables dynamic provisioning; omit it to use "
                "the default class, or name a class"
            )
        return value


class TierPermissions(ApiModel):
    """How model servers that do not run as root may write a fresh volume."""

    fs_group: int = Field(
        ge=1, le=2147483647,  # Kubernetes' largest group id; 0 would be root's group
        description="The group the model servers write the tier as: the model-server "
        "pods' securityContext.fsGroup (a supplementary group of their containers; where "
        "the volume's CSI driver applies fsGroup, the kubelet also gives it the volume), "
        "and the evictor's unless eviction.fsGroup is set. A pod that sets another "
        "fsGroup is left alone and reported.",
    )
    prepare_directory: bool = Field(
        default=False,
        description="Opt in, for volumes whose CSI driver does not apply fsGroup (see "
        "docs/operations.md): an init container (the offload image, exec form, root with "
        "CHOWN, DAC_OVERRIDE and FOWNER only) creates the tier's own directory, gives it to "
        "fsGroup and sets mode 2775 (group-writable, setgid) before the model server "
        "starts. Not recursive; refuses symlinks. The model server itself never runs as "
        "root.",
    )


class StorageTier(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.pvc) != has(self.existingClaim)",
                    "message": "spec.storage needs exactly one of pvc (a new claim) or "
                    "existingClaim (the name of one you manage)",
                },
                {
                    "rule": "!has(self.stagingSize) || !has(self.hostStagingSize)",
                    "message": HOST_STAGING_TWICE,
                },
            ]
        }
    )
    backend: StorageBackend | None = Field(
        default=None,
        json_schema_extra=ENUM_BOUND,
        description="Who writes the shared files with connector native: kvtier (the "
        "injected kvtier backend; the default) or vllm-fs (vLLM's built-in fs tier). Leave "
        "unset with connector lmcache, which writes its own disk files.",
    )
    pvc: ClaimTemplate | None = Field(
        default=None, description="Create a PersistentVolumeClaim for the shared tier."
    )
    existing_claim: ClaimName | None = Field(
        default=None,
        description="Use this existing PVC (never modified or deleted by kvtier).",
    )
    mount_path: MountPath = Field(
        default="/mnt/files-storage",
        description="Where the volume is mounted in the model-server container.",
    )
    block_size: int | None = Field(
        default=None,
        ge=16,
        multiple_of=16,
        description="Tokens per offloaded file (vLLM block_size): a positive multiple of 16 "
        "and of the GPU block size; default 256. Without a CPU tier the default is 256 "
        "halved until the pinned staging (hostStagingSize) holds 8 files of the model's KV.",
    )
    read_threads: int = Field(default=16, ge=1, le=256, description="Parallel file readers.")
    write_threads: int = Field(default=16, ge=1, le=256, description="Parallel file writers.")
    store_nice: int | None = Field(default=None, ge=0, le=19,
                                   description=STORE_NICE_DESCRIPTION)
    max_size_per_replica: Quantity | None = Field(
        default=None,
        description="LMCache only: the disk cap of one replica (LMCACHE_MAX_LOCAL_DISK_SIZE). "
        "Defaults to the new PVC's size times highWatermark; required with existingClaim.",
    )
    permissions: TierPermissions | None = Field(
        default=None,
        description="For model servers that do not run as root: the group they write as, "
        "and optionally an init container that prepares the tier's directory on a fresh "
        "volume (docs/operations.md says which storage needs which).",
    )
    direct_io: bool | None = Field(
        default=None, alias="directIO",
        description="LMCache only: its disk files written and read with O_DIRECT "
        "(use_odirect in LMCACHE_EXTRA_CONFIG), bypassing the page cache; default true, as "
        "in llm-d's guide. Set false where the filesystem refuses O_DIRECT (tmpfs, some "
        "FUSE filesystems).",
    )
    host_staging_size: Quantity | None = Field(
        default=None,
        description="Without a CPU tier only: the pinned host memory each vLLM worker process "
        "(one per GPU) uses to stage KV pages between GPU and files (kvtier's "
        "max_staging_bytes); default 1Gi. The pod's memory request grows by this much per "
        "worker process (see docs/sizing.md).",
    )
    staging_size: Quantity | None = Field(
        default=None,
        description="Deprecated: hostStagingSize's name before 0.2, read the same way; "
        "rename it hostStagingSize.",
    )

    @field_validator("host_staging_size", "staging_size")
    @classmethod
    def _staging_size(cls, value: str | None) -> str | None:
        if value is not None and quantity_bytes(value) < MIB:
            raise ValueError(f"{value!r} is too small to stage a KV block; use e.g. 1Gi")
        return value

    @model_validator(mode="after")
    def _staging_once(self) -> StorageTier:
        if self.host_staging_size is not None and self.staging_size is not None:
            raise ValueError(HOST_STAGING_TWICE.removeprefix("spec.storage: "))
        return self

    @property
    def host_staging(self) -> str | None:
        """hostStagingSize, or its deprecated name stagingSize."""
        return self.host_staging_size if self.host_staging_size is not None \
            else self.staging_size

    @cached_property
    def staging_bytes(self) -> int | None:
        """hostStagingSize in bytes, parsed once; None when unset."""
        return None if self.host_staging is None else quantity_bytes(self.host_staging)

    @property
    def block_tokens(self) -> int:
        """Tokens per file with a CPU tier (vLLM's block_size for the tiers)."""
        return self.block_size if self.block_size is not None else DEFAULT_FILE_TOKENS

    @model_validator(mode="after")
    def _one_claim(self) -> StorageTier:
        if self.pvc is not None and self.existing_claim is not None:
            raise ValueError(
                "pvc and existingClaim are mutually exclusive; keep pvc to let kvtier create "
                "the claim, or existingClaim to use yours"
            )
        if self.pvc is None and self.existing_claim is None:
            raise ValueError("needs pvc (a new claim) or existingClaim (the name of yours)")
        return self

