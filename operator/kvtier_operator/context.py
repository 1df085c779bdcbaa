"""Operator-level settings the pod plan and the renderers need (images), passed in rather
than read."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier_operator import __version__

DEFAULT_OFFLOAD_IMAGE = f"ghcr.io/kvtier/kvtier-offload:{__version__}"
DEFAULT_OPERATOR_IMAGE = f"ghcr.io/kvtier/kvtier-operator:{__version__}"


@dataclass(frozen=True)
class RenderContext:
    offload_image: str = DEFAULT_OFFLOAD_IMAGE  # the offload backend's init container
    evictor_image: str = DEFAULT_OPERATOR_IMAGE
    image_pull_policy: str = "IfNotPresent"
    # Per cache, from the observation (reconcile sets it): the CPU-tier capacity the
    # engines report (vLLM 0.33's kv_offload_config_info), per replica, in the router's
    # blocks (the adapter's router_block_size); None: not exported, use the computed one.
    observed_cpu_blocks: int | None = None
    # Node directories a cache's local disk may be under (spec.localDisk.volume.hostPath),
    # the admin's choice (Helm value localDisk.allowedHostPaths); empty: none.
    allowed_host_paths: tuple[str, ...] = ()
    # S3 endpoints a cache's object store may name (spec.objectStore.endpoint), the admin's
    # choice (Helm value objectStore.allowedEndpoints); empty: none (AWS only).
    allowed_object_endpoints: tuple[str, ...] = ()
