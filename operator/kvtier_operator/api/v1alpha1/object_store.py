"""spec.objectStore: an S3-compatible object store as the last tier (kvtier's backend over
boto3), for clusters with an object store and no ReadWriteMany filesystem, held to a byte
budget by a CronJob that deletes the oldest blocks."""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property

from pydantic import Field

from kvtier_operator.api.durations import duration_seconds
from kvtier_operator.api.quantity import quantity_bytes
from kvtier_operator.api.v1alpha1.fields import (
    ENUM_BOUND,
    ApiModel,
    BucketName,
    EndpointUrl,
    ObjectPrefix,
    Quantity,
    Region,
    Schedule,
    SecretKey,
    SecretName,
)

DEFAULT_OBJECT_PREFIX = "kvtier/v1"  # the backend's own default (kvtier_offload.layout)


class AddressingStyle(StrEnum):
    auto = "auto"
    path = "path"
    virtual = "virtual"


class CredentialsSecret(ApiModel):
    name: SecretName = Field(
        description="The Secret (in this namespace) holding the access key; its values "
        "reach the pods as env valueFrom secretKeyRef, never the CR, the command line, "
        "the status or a log.")
    access_key_id_key: SecretKey = Field(
        default="AWS_ACCESS_KEY_ID", description="The key holding the access key id.")
    secret_access_key_key: SecretKey = Field(
        default="AWS_SECRET_ACCESS_KEY", description="The key holding the secret key.")
    session_token_key: SecretKey | None = Field(
        default=None, description="The key holding a session token, where there is one.")


class ObjectStoreTier(ApiModel):
    bucket: BucketName = Field(description="The bucket, which must exist.")
    prefix: ObjectPrefix = Field(
        default=DEFAULT_OBJECT_PREFIX,
        description="Key prefix of the tier's objects: <prefix>/<fingerprint>/<key>.kvb. "
        "Caches of one model with the same hashSeed and prefix share blocks; nothing else "
        "under the bucket is touched or counted.",
    )
    endpoint: EndpointUrl | None = Field(
        default=None, description="The S3 endpoint, http(s)://host[:port] (Ceph RGW, "
        "MinIO, ...); unset: AWS S3.")
    region: Region | None = Field(default=None, description="The region (AWS_REGION); "
                                  "unset: boto3's default.")
    addressing_style: AddressingStyle = Field(
        default=AddressingStyle.auto, json_schema_extra=ENUM_BOUND,
        description="auto, path (bucket in the path; most S3-compatible stores) or virtual "
        "(bucket in the host name).")
    credentials_secret: CredentialsSecret | None = Field(
        default=None,
        description="Where the access key is. Unset: the pods' own identity (IRSA's web "
        "identity token, instance roles).")
    max_concurrency: int = Field(
        default=16, ge=1, le=256,
        description="Requests in flight per replica at most (I/O threads, connections).")
    budget: Quantity = Field(
        description="The most bytes the tier's objects may take under the prefix, all "
        "replicas together; the eviction CronJob deletes the oldest (by last store) above "
        "it. S3 keeps no access time, so this is FIFO, not LRU.")
    eviction_schedule: Schedule = Field(
        default="*/10 * * * *",
        description="Cron schedule of the eviction CronJob (python -m kvtier_offload "
        "evict-objects).")
    min_age: str = Field(
        default="10m", pattern=r"^([0-9]+(h|m|s))+$", max_length=32,
        description="Objects stored more recently are never deleted (a lookup may just "
        "have found them), e.g. 10m.")

    @cached_property
    def budget_bytes(self) -> int:
        return quantity_bytes(self.budget)

    @property
    def min_age_seconds(self) -> float:
        return duration_seconds(self.min_age)
