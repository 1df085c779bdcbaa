"""One S3 server (Ceph's RADOS Gateway, tests/rgw.py) for the whole session: start-up costs
about 13 s on 2 cores, paid once; tests/conftest.py keeps all of tests/s3 on one worker.
Each test gets a bucket of its own."""

from __future__ import annotations

import secrets
import sys
import tempfile
from pathlib import Path

import pytest

from tests.rgw import RGWUnavailable, S3Server, rgw_server


@pytest.fixture(scope="session")
def s3() -> S3Server:
    base = Path(tempfile.mkdtemp(prefix="kvtier-rgw-"))
    try:
        with rgw_server(base) as server:
            print(f"\nS3 server (Ceph RADOS Gateway) up in {server.start_seconds:.1f}s",
                  file=sys.stderr)
            yield server
    except RGWUnavailable as e:
        pytest.skip(f"no S3 server here: {e}")
    assert not base.exists()
    assert all(p.poll() is not None for p in server.processes)


@pytest.fixture
def bucket(s3) -> str:
    name = f"kvtier-{secrets.token_hex(6)}"
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_env(s3, monkeypatch) -> S3Server:
    """The test user's keys in the environment only, as a pod gets them from a Secret."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    return s3
