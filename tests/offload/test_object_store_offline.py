"""The object tier where no S3 server answers, and where boto3 is not installed: the
backend still imports, and every failure is a failed block, fast."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from kvtier_offload.object_store import ObjectStore, ObjectStoreConfig
from tests.offload.conftest import FP, keys, rows, run_load, run_store


def test_the_backend_imports_without_boto3_and_the_tier_names_it():
    code = ("import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
            "import kvtier_offload.store, kvtier_offload.object_store as o\n"
            "try:\n"
            "    o.make_client(o.ObjectStoreConfig(bucket='b', fingerprint='0' * 16))\n"
            "except o.MissingPackage as err:\n"
            "    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "needs boto3" in out and "pip install boto3" in out


def test_no_server_fails_blocks_within_the_timeouts(monkeypatch):
    pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = ObjectStore(ObjectStoreConfig(
        bucket="kvtier", fingerprint=FP, endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1", connect_timeout=0.5, read_timeout=0.5, max_attempts=1,
        max_concurrency=2))
    try:
        (name,), (data,) = keys(1), rows(1, 4096)
        began = time.monotonic()
        assert not run_store(store, 1, [(name, data)]).success
        assert not run_load(store, 2, [(name, memoryview(bytearray(4096)))]).success
        assert store.lookup(name) is None  # never waits
        deadline = time.monotonic() + 10
        while (answer := store.lookup(name)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answer is False and time.monotonic() - began < 10
    finally:
        store.close(10)


@pytest.mark.parametrize("settings, message", [
    ({"bucket": ""}, "needs bucket"),
    ({"addressing_style": "dns"}, "addressing_style"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"read_timeout": 0}, "read_timeout"),
])
def test_settings_are_checked_by_name(settings, message):
    config = ObjectStoreConfig(**{"bucket": "b", "fingerprint": FP, **settings})
    with pytest.raises(ValueError, match=message):
        config.check()
