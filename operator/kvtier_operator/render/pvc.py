"""The shared-tier PersistentVolumeClaim."""

from __future__ import annotations

from typing import Any

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import DeletePolicy, TieredPrefixCache


def render_pvc(tpc: TieredPrefixCache) -> dict[str, Any] | None:
    """The PVC to create, or None when there is no storage tier or it is existingClaim."""
    storage = tpc.spec.storage
    if storage is None or storage.pvc is None:
        return None
    template = storage.pvc
    claim = names.claim_name(tpc)
    assert claim is not None
    spec: dict[str, Any] = {
        "accessModes": list(template.access_modes),
        "resources": {"requests": {"storage": template.size}},
        "volumeMode": "Filesystem",
    }
    if template.storage_class_name is not None:
        spec["storageClassName"] = template.storage_class_name
    owned = template.delete_policy == DeletePolicy.Delete
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": names.metadata(tpc, claim, "storage", owned=owned),
        "spec": spec,
    }
