"""The pod plan: everything injection puts into a selected pod for one cache, computed
once from the spec and the operator's context, and its hash.

`pod_plan(tpc, ctx)` asks the spec's adapter once (launch options, env by role, extra
volumes, the offload package) and fixes the result in a frozen `PodPlan`. Injection
(render/pod.py) and the reconcile's pending-pod count only read it; the container-
dependent pieces (/dev/shm and memory sizing, which depend on the container's GPUs) are
the adapter's per container. `PodPlan.hash()` is the config hash a pod carries: a pod with
another one is pending a restart.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.base import Adapter, ExtraVolume, PodRole
from kvtier_operator.engines.chained_tiers import (
    SecretEnv,
    credential_env,
    ephemeral_storage_bytes,
    local_disk_volume,
)
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.validation.host_paths import host_path_refusal
from kvtier_operator.validation.object_endpoints import object_endpoint_refusal

FORMAT_VERSION = "2"  # bump when injection changes for an unchanged spec


@dataclass(frozen=True)
class PodPlan:
    """What injection writes for one cache (read-only; build it with pod_plan)."""

    tpc: TieredPrefixCache
    adapter: Adapter
    launch_options: Any  # what the engine's launcher passes (vLLM: the kv-transfer dict)
    kv_events: dict[str, Any] | None  # precise router scoring: the engine's KV-events config
    server_env: Mapping[str, str]  # by name, as the process sees them (unescaped)
    worker_env: Mapping[str, str]  # a multi-host worker's (no server, no options)
    claim: str | None  # the shared tier's PVC
    mount_path: str | None  # where it is mounted
    extra_volumes: tuple[ExtraVolume, ...]
    offload_image: str | None  # the init container's image; None: no offload package
    image_pull_policy: str
    container_name: str | None  # spec.containerName
    config_hash: str
    # Run before the engine's command (the /dev/shm sweep); None: the command as it is.
    command_prefix: tuple[str, ...] | None = None
    # The model servers' group (spec.storage.permissions.fsGroup), and the command of the
    # init container that prepares the tier's directory (None: none).
    fs_group: int | None = None
    prepare_command: tuple[str, ...] | None = None
    prepare_image: str | None = None
    # Extended resources the container requests and limits (adapter.device_resources).
    device_resources: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}))
    # Env from Secrets (the object store's credentials), by reference only.
    secret_env: tuple[SecretEnv, ...] = ()
    # What the server container's ephemeral-storage request grows by (an emptyDir disk).
    ephemeral_storage_bytes: int = 0
    # Why no pod may be injected (a host directory the admin does not allow); None: fine.
    refusal: str | None = None

    def env(self, role: PodRole) -> dict[str, str]:
        return dict(self.server_env if role == PodRole.server else self.worker_env)

    def hash(self) -> str:
        return self.config_hash


def _digest(tpc: TieredPrefixCache, adapter: Adapter, launch_options: Any,
            server_env: Mapping[str, str], claim: str | None, mount_path: str | None,
            extra_volumes: tuple[ExtraVolume, ...], offload_image: str | None,
            command_prefix: tuple[str, ...] | None, devices: Mapping[str, str] | None = None,
            permissions: dict[str, Any] | None = None, secret_env: tuple[SecretEnv, ...] = (),
            ephemeral_bytes: int = 0) -> str:
    # The keys and values pods have carried since FORMAT_VERSION 2: a plan that writes
    # the same keeps the same hash, so running pods are not reported pending.
    doc: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "kvTransferConfig": launch_options,
        "env": dict(server_env),
        "cpu": tpc.spec.cpu_bytes,
        "claim": claim,
        "mountPath": mount_path,
        "sidecarImage": offload_image,  # the key's name before 0.2: kept, so is the hash
        "containerName": tpc.spec.container_name,
        **adapter.fingerprint(tpc),
    }
    if command_prefix is not None:
        doc["commandPrefix"] = list(command_prefix)  # absent before: other hashes stay
    if extra_volumes:
        doc["volumes"] = [[v.volume, v.mount_path, v.read_only] for v in extra_volumes]
    if devices:
        doc["devices"] = dict(devices)  # absent before: other hashes stay
    if permissions is not None:
        doc["permissions"] = permissions  # absent before: other hashes stay
    if secret_env:  # references only: a rotated secret value restarts nothing
        doc["secretEnv"] = [[e.name, e.secret, e.key] for e in secret_env]
    if ephemeral_bytes:
        doc["ephemeralStorage"] = ephemeral_bytes
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def pod_plan(tpc: TieredPrefixCache, ctx: RenderContext) -> PodPlan:
    """The plan of a validated cache (validation.parse_tpc has checked its adapter)."""
    spec = tpc.spec
    adapter = adapter_for(spec)
    launch_options = adapter.launch_options(tpc)
    kv_events = adapter.kv_events_config(tpc)
    server_env = (adapter.env(tpc, PodRole.server) | adapter.launcher.options_env(launch_options)
                  | adapter.launcher.events_env(kv_events))
    worker_env = adapter.env(tpc, PodRole.worker)
    claim = names.claim_name(tpc)
    mount_path = spec.storage.mount_path if spec.storage else None
    extra = tuple(adapter.extra_volumes(tpc))
    disk = local_disk_volume(tpc)
    if disk is not None:
        extra += (disk,)
    image = ctx.offload_image if adapter.needs_offload_package(spec) else None
    prefix = names.SHM_SWEEP_PREFIX if adapter.sweeps_shm(spec) else None
    devices = adapter.device_resources(spec)
    fs_group, prepare, prepare_image = _permissions(tpc, adapter, ctx)
    permissions = None if fs_group is None else {
        "fsGroup": fs_group, "prepare": None if prepare is None else list(prepare),
        "image": prepare_image}
    secrets = credential_env(spec)
    ephemeral = ephemeral_storage_bytes(spec)
    return PodPlan(
        tpc=tpc, adapter=adapter, launch_options=launch_options, kv_events=kv_events,
        server_env=MappingProxyType(server_env), worker_env=MappingProxyType(worker_env),
        claim=claim, mount_path=mount_path, extra_volumes=extra, offload_image=image,
        image_pull_policy=ctx.image_pull_policy, container_name=spec.container_name,
        command_prefix=prefix, device_resources=MappingProxyType(devices),
        fs_group=fs_group, prepare_command=prepare, prepare_image=prepare_image,
        secret_env=secrets, ephemeral_storage_bytes=ephemeral,
        refusal=host_path_refusal(spec, ctx.allowed_host_paths)
        or object_endpoint_refusal(spec, ctx.allowed_object_endpoints),
        config_hash=_digest(tpc, adapter, launch_options, server_env, claim, mount_path,
                            extra, image, prefix, devices, permissions, secret_env=secrets,
                            ephemeral_bytes=ephemeral))


def _permissions(tpc: TieredPrefixCache, adapter: Adapter, ctx: RenderContext
                 ) -> tuple[int | None, tuple[str, ...] | None, str | None]:
    """spec.storage.permissions: the pods' fsGroup, and the prepare-dir command in exec
    form (validated mount path, the adapter's constant directory, an integer group) with
    its image; Nones where not asked for."""
    storage = tpc.spec.storage
    if storage is None or storage.permissions is None:
        return None, None, None
    group = storage.permissions.fs_group
    if not storage.permissions.prepare_directory:
        return group, None, None
    command = ("python3", "-m", "kvtier_offload", "prepare-dir", "--mount", storage.mount_path,
               "--dir", adapter.tier_directory(tpc.spec), "--group", str(group))
    return group, command, ctx.offload_image
