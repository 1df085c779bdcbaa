"""The object tier's store (object_store.py) and eviction (object_evict.py) against a real
S3 server (Ceph's RADOS Gateway, tests/rgw.py): real blocks, checked bit-identical."""

from __future__ import annotations

import datetime
import logging
import time

import pytest

from kvtier_offload.fileformat import HEADER_SIZE
from kvtier_offload.object_evict import evict_to_budget
from kvtier_offload.object_store import ObjectStore, ObjectStoreConfig
from tests.offload.conftest import FP, keys, rows, run_load, run_store

BLOCK = 64 << 10


@pytest.fixture
def make_store(s3_env, bucket):
    stores: list[ObjectStore] = []

    def make(**kw) -> ObjectStore:
        kw.setdefault("fingerprint", FP)
        kw.setdefault("max_concurrency", 4)
        store = ObjectStore(ObjectStoreConfig(bucket=bucket, endpoint_url=s3_env.endpoint,
                                              addressing_style="path", **kw))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close(30)


def settled(store, key) -> bool:
    deadline = time.monotonic() + 10
    while (answer := store.lookup(key)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(answer)


def test_blocks_stored_by_one_engine_load_bit_identical_in_another(make_store):
    writer, reader = make_store(), make_store()  # two engine processes, one bucket
    names, data = keys(12, salt=b"share"), rows(12, BLOCK, seed=1)
    assert run_store(writer, 1, list(zip(names, data, strict=True))).success
    assert all(settled(reader, k) for k in names)
    dests = [memoryview(bytearray(BLOCK)) for _ in names]
    outcome = run_load(reader, 2, list(zip(names, dests, strict=True)))
    assert outcome.success and outcome.nbytes == 12 * BLOCK
    assert all(d == s for d, s in zip(dests, data, strict=True))
    assert not settled(reader, keys(1, salt=b"never")[0])  # a miss is a miss


def test_a_corrupt_foreign_or_missing_object_is_a_miss_never_bytes(make_store, s3, bucket):
    store = make_store()
    names, data = keys(3, salt=b"bad"), rows(3, BLOCK, seed=2)
    assert run_store(store, 1, list(zip(names, data, strict=True))).success
    client = s3.client()
    first = store.layout.name(names[0])
    body = bytearray(client.get_object(Bucket=bucket, Key=first)["Body"].read())
    body[HEADER_SIZE + 100] ^= 0xFF  # one flipped payload bit
    client.put_object(Bucket=bucket, Key=first, Body=bytes(body))
    other = make_store(fingerprint="ffeeddccbbaa9988")  # another configuration's object
    assert run_store(other, 2, [(names[1], data[1])]).success
    client.copy_object(Bucket=bucket, Key=store.layout.name(names[1]),
                       CopySource={"Bucket": bucket, "Key": other.layout.name(names[1])})
    client.delete_object(Bucket=bucket, Key=store.layout.name(names[2]))
    store.forget(names[0]), store.forget(names[1]), store.forget(names[2])
    for i, key in enumerate(names):
        dest = memoryview(bytearray(BLOCK))
        assert not run_load(store, 10 + i, [(key, dest)]).success
        assert not settled(store, key)  # and no hit after it
    # The refused objects were deleted: bad for every reader (S3 PUT is atomic).
    left = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert left == {other.layout.name(names[1])}


def test_lookups_never_wait_on_the_server(make_store):
    store = make_store()
    (name,) = keys(1, salt=b"look")
    assert run_store(store, 1, [(name, rows(1, BLOCK)[0])]).success
    store.forget(name)
    assert store.lookup(name) is None  # asked in the background: "ask again"
    assert settled(store, name)


def test_credentials_come_from_the_environment_and_are_never_logged(make_store, s3, caplog,
                                                                    monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-" + s3.secret_key[:8])
    caplog.set_level(logging.DEBUG)
    store = make_store()
    (name,) = keys(1, salt=b"cred")
    assert not run_store(store, 1, [(name, rows(1, BLOCK)[0])]).success  # refused: bad key
    assert "SignatureDoesNotMatch" in caplog.text or "AccessDenied" in caplog.text
    assert s3.secret_key[:8] not in caplog.text


def test_eviction_holds_the_prefix_to_a_byte_budget_oldest_first(make_store, s3, bucket):
    store = make_store()
    names, data = keys(8, salt=b"evict"), rows(8, BLOCK, seed=3)
    for i in range(8):
        assert run_store(store, i, [(names[i], data[i])]).success
        time.sleep(1.05)  # LastModified has whole seconds
    client = s3.client()
    client.put_object(Bucket=bucket, Key="kvtier/v1/notes.txt", Body=b"x" * 10_000_000)
    each = HEADER_SIZE + BLOCK
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    dry = evict_to_budget(client, bucket, "kvtier/v1", 3 * each, dry_run=True, now=later)
    assert (dry.objects, dry.deleted) == (8, 5)
    assert len(client.list_objects_v2(Bucket=bucket)["Contents"]) == 9
    young = evict_to_budget(client, bucket, "kvtier/v1", 3 * each)  # all just stored
    assert young.deleted == 0 and young.over_budget
    report = evict_to_budget(client, bucket, "kvtier/v1", 3 * each, now=later)
    assert (report.deleted, report.deleted_bytes, report.over_budget) == (5, 5 * each, False)
    left = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert left == {store.layout.name(k) for k in names[5:]} | {"kvtier/v1/notes.txt"}
