"""kvtier's object tier for vLLM's TieringOffloadingSpec: blocks as objects in an S3
bucket (object_store.py), for clusters with an object store and no RWX filesystem. Last
in secondary_tiers (the slowest):

    {"type": "KvtierObjectTier", "module_path": "kvtier_offload.vllm_object_tier",
     "bucket": "kv-cache", "endpoint_url": "https://s3.example:443",
     "addressing_style": "path", "max_concurrency": 16}

Credentials never go in here (they would be on vLLM's command line): boto3 reads them
from the environment or a credentials file a Secret provides; a setting that looks like
one is refused. boto3 is imported only when this tier is configured.

Everything but the store is KvtierStorageTier's (lookups, jobs, events, metrics, drain,
shutdown): ObjectStore has the block store's interface.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import Locality, Medium
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from kvtier_offload.layout import fingerprint
from kvtier_offload.metrics import Metrics, Recorder
from kvtier_offload.tier_events import TierEvents
from kvtier_offload.vllm_tier import KvtierStorageTier, fingerprint_config

log = logging.getLogger("kvtier_offload")


class KvtierObjectTier(KvtierStorageTier):
    medium: ClassVar[Medium] = Medium.STORAGE
    metrics_tier: ClassVar[str] = "objectStore"

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        bucket: str | None = None,
        prefix: str | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str = "auto",
        ca_bundle: str | None = None,
        max_concurrency: int = 16,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        max_attempts: int = 2,
        write_queue_seconds: float = 10.0,
        recompute_bound: bool = True,
        enable_kv_events: bool = False,
        locality: str | None = "REMOTE",
        backpressure_detector: Any = None,
        **unknown: Any,
    ) -> None:
        from kvtier_offload.object_store import (
            ObjectStore,
            ObjectStoreConfig,
            refuse_credentials,
        )

        refuse_credentials(unknown)
        if unknown:
            raise ValueError(f"KvtierObjectTier has no setting {', '.join(sorted(unknown))}")
        # Not KvtierStorageTier.__init__: that one opens a directory.
        SecondaryTierManager.__init__(self, offloading_spec, primary_kv_view, tier_type,
                                      backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        self._recorder = Recorder()
        config = fingerprint_config(offloading_spec, self.block_size_bytes)
        settings = ObjectStoreConfig(
            bucket=bucket or "", fingerprint=fingerprint(config), endpoint_url=endpoint_url,
            region=region, addressing_style=addressing_style, ca_bundle=ca_bundle,
            max_concurrency=max_concurrency, connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s, max_attempts=max_attempts,
            write_queue_seconds=write_queue_seconds)
        if prefix is not None:
            settings.prefix = prefix
        self.store = ObjectStore(settings, metrics=Metrics(self._recorder, self.metrics_tier))  # type: ignore[assignment]
        # reads: three quarters of the requests (object_store.ObjectStore's pool)
        self._bound_requests(offloading_spec, recompute_bound, max(1, max_concurrency * 3 // 4))
        self.events = TierEvents.configured(offloading_spec, tier_type, enable_kv_events,
                                            self.medium, self.locality)
        if self.events is not None:
            self.store.removals = self.events.removals
        log.info("kvtier object tier at %s (fingerprint %s, %d requests at most)",
                 self.store.layout.root, self.store.layout.fingerprint, max_concurrency)
