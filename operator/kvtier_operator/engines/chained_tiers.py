"""What the tiers chained behind the CPU tier put into a pod whatever the engine: the
local disk's volume and the ephemeral storage it takes (spec.localDisk), and the object
store's credentials as references to a Secret (spec.objectStore). The tier settings the
engine reads are its adapter's (engines/vllm/gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier_operator import names
from kvtier_operator.api.quantity import format_bytes
from kvtier_operator.api.v1alpha1 import TieredPrefixCache, TieredPrefixCacheSpec
from kvtier_operator.engines.base import ExtraVolume


@dataclass(frozen=True)
class SecretEnv:
    """An env var the pod takes from a Secret (valueFrom secretKeyRef): the value never
    passes through kvtier, its pod patch, its status or its logs."""

    name: str
    secret: str
    key: str

    def entry(self) -> dict[str, Any]:
        return {"name": self.name,
                "valueFrom": {"secretKeyRef": {"name": self.secret, "key": self.key}}}


def credential_env(spec: TieredPrefixCacheSpec) -> tuple[SecretEnv, ...]:
    """The object store's access key as boto3 reads it from the environment."""
    store = spec.object_store
    if store is None or store.credentials_secret is None:
        return ()
    ref = store.credentials_secret
    out = [SecretEnv("AWS_ACCESS_KEY_ID", ref.name, ref.access_key_id_key),
           SecretEnv("AWS_SECRET_ACCESS_KEY", ref.name, ref.secret_access_key_key)]
    if ref.session_token_key is not None:
        out.append(SecretEnv("AWS_SESSION_TOKEN", ref.name, ref.session_token_key))
    return tuple(out)


def host_directory(tpc: TieredPrefixCache) -> str | None:
    """The node directory of a hostPath local disk: one of its own per cache under the
    path given, so that two caches never count (and evict) each other's blocks."""
    disk = tpc.spec.local_disk
    if disk is None or disk.volume.host_path is None:
        return None
    return f"{disk.volume.host_path.path}/{tpc.namespace}/{tpc.name}"


def local_disk_volume(tpc: TieredPrefixCache) -> ExtraVolume | None:
    """The local disk's volume, mounted read-write at spec.localDisk.mountPath."""
    disk = tpc.spec.local_disk
    if disk is None:
        return None
    size = format_bytes(disk.volume_bytes)
    source = disk.volume
    volume: dict[str, Any] = {"name": names.VOLUME_LOCAL_DISK}
    if source.ephemeral is not None:
        claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                                 "resources": {"requests": {"storage": size}}}
        if source.ephemeral.storage_class_name is not None:
            claim["storageClassName"] = source.ephemeral.storage_class_name
        volume["ephemeral"] = {"volumeClaimTemplate": {
            "metadata": {"labels": {names.LABEL_CACHE: tpc.name}}, "spec": claim}}
    elif source.host_path is not None:
        volume["hostPath"] = {"path": host_directory(tpc), "type": "DirectoryOrCreate"}
    else:
        volume["emptyDir"] = {"sizeLimit": size}
    return ExtraVolume(volume=volume, mount_path=disk.mount_path, read_only=False)


def ephemeral_storage_bytes(spec: TieredPrefixCacheSpec) -> int:
    """What the local disk adds to the container's ephemeral-storage request: an emptyDir
    counts against the node's ephemeral storage (the kubelet evicts a pod past its share);
    a claim or a host directory does not."""
    disk = spec.local_disk
    if disk is None or disk.volume.empty_dir is None:
        return 0
    return disk.volume_bytes
