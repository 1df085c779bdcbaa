"""The TieredPrefixCache resource: metadata, spec and status, and the hash seed."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field

from kvtier_operator.api import rules
from kvtier_operator.api.group import API_VERSION, KIND
from kvtier_operator.api.v1alpha1.fields import ApiModel
from kvtier_operator.api.v1alpha1.spec import TieredPrefixCacheSpec
from kvtier_operator.api.v1alpha1.status import TieredPrefixCacheStatus


class ObjectMeta(ApiModel):
    model_config = ConfigDict(extra="allow")
    # kvtier derives object names and label values from the name (rules.CR_NAME).
    name: Annotated[str, AfterValidator(rules.CR_NAME.check)]
    namespace: Annotated[str, AfterValidator(rules.NAMESPACE.check)] = "default"
    generation: int | None = None
    uid: str | None = None


class TieredPrefixCache(ApiModel):
    api_version: Literal["kvtier.dev/v1alpha1"] = Field(default=API_VERSION)
    kind: Literal["TieredPrefixCache"] = Field(default=KIND)
    metadata: ObjectMeta
    spec: TieredPrefixCacheSpec
    status: TieredPrefixCacheStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def hash_seed(self) -> int:
        if self.spec.hash_seed is not None:
            return self.spec.hash_seed
        digest = hashlib.sha256(f"{self.namespace}/{self.name}".encode()).digest()
        return int.from_bytes(digest[:4], "big")


def spec_fingerprint(spec: TieredPrefixCacheSpec) -> str:
    """Stable short hash of a spec's JSON form (sorted keys)."""
    doc: dict[str, Any] = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
