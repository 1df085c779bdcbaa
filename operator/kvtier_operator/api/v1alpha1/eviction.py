"""spec.eviction: the evictor CronJob that keeps the shared volume under its watermarks."""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvtier_operator.api.durations import duration_seconds
from kvtier_operator.api.v1alpha1.fields import ApiModel, Schedule


class CapacitySource(StrEnum):
    Filesystem = "Filesystem"
    ClaimSize = "ClaimSize"



class Eviction(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.lowWatermark < self.highWatermark",
                    "message": "spec.eviction.lowWatermark must be below highWatermark",
                },
                {
                    "rule": "self.inodeLowWatermark < self.inodeHighWatermark",
                    "message": "spec.eviction.inodeLowWatermark must be below inodeHighWatermark",
                },
            ]
        }
    )
    schedule: Schedule = Field(
        default="*/5 * * * *",
        description="Cron schedule of the evictor CronJob (five fields or @hourly etc.).",
    )
    high_watermark: int = Field(
        default=85, ge=1, le=100, description="Start evicting above this % of bytes used."
    )
    low_watermark: int = Field(
        default=70, ge=1, le=99, description="Evict until bytes used fall below this %."
    )
    inode_high_watermark: int = Field(
        default=90, ge=1, le=100, description="Start evicting above this % of inodes used."
    )
    inode_low_watermark: int = Field(
        default=80, ge=1, le=99, description="Evict until inodes used fall below this %."
    )
    min_idle: str = Field(
        default="10m",
        max_length=32,
        pattern=r"^([0-9]+(h|m|s))+$",
        description="Never delete a file used more recently than this (e.g. 10m, 1h).",
    )
    capacity: CapacitySource = Field(
        default=CapacitySource.Filesystem,
        description="Filesystem: usage from statvfs. ClaimSize: usage against the PVC's size, "
        "for filesystems whose statvfs reports a whole shared export (NFS, EFS, Lustre).",
    )
    suspend: bool = Field(default=False, description="Suspend the evictor CronJob.")
    fs_group: int | None = Field(
        default=None,
        ge=0,
        le=2147483647,  # Kubernetes' largest group id
        description="fsGroup of the evictor pod, so it may delete files the model servers "
        "wrote (match the model servers' group).",
    )

    @field_validator("min_idle")
    @classmethod
    def _duration(cls, value: str) -> str:
        duration_seconds(value)
        return value

    @model_validator(mode="after")
    def _watermarks(self) -> Eviction:
        if not self.low_watermark < self.high_watermark:
            raise ValueError(
                f"lowWatermark {self.low_watermark} must be below highWatermark "
                f"{self.high_watermark} (0 < low < high <= 100); lower lowWatermark"
            )
        if not self.inode_low_watermark < self.inode_high_watermark:
            raise ValueError(
                f"inodeLowWatermark {self.inode_low_watermark} must be below "
                f"inodeHighWatermark {self.inode_high_watermark}; lower inodeLowWatermark"
            )
        return self

    @property
    def min_idle_seconds(self) -> int:
        return duration_seconds(self.min_idle)

