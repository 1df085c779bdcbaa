"""The evictor's BlockRemoved events (issue #33): vLLM's wire format, decoded here with
vLLM's own classes, hashes equal to what vLLM announces for the same blocks, and
publishing that never blocks or fails eviction."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from kvtier_evictor import cli
from kvtier_evictor.events import block_hash, packb

zmq = pytest.importorskip("zmq")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")

FP = "0123456789abcdef"
OLD = time.time() - 86400


def vllm_hash64(block_hash_bytes: bytes) -> int:
    """What vLLM announces for a block hash (kv_events.maybe_convert_block_hash)."""
    return int.from_bytes(block_hash_bytes, "big") & ((1 << 64) - 1)


def kvtier_file(root, block: bytes, group: int = 0, size: int = 64) -> str:
    key = (block + group.to_bytes(4, "big")).hex()
    d = root / "kvtier" / "v1" / FP / key[0:2] / key[2:4]
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{key}.kvb"
    p.write_bytes(b"x" * size)
    os.utime(p, (OLD, OLD))
    return str(p)


def vllm_fs_file(root, block: bytes, group: int = 0, size: int = 64) -> str:
    h = block.hex()
    d = root / f"m_{'a' * 12}_r0" / h[:3] / f"{h[3:5]}_g{group}"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{h}.bin"
    p.write_bytes(b"x" * size)
    os.utime(p, (OLD, OLD))
    return str(p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(root, layout, endpoint, capsys):
    code = cli.main(["--root", str(root), "--layout", layout, "--capacity-bytes", "100",
                     "--high-watermark", "10", "--low-watermark", "1",
                     "--min-idle-seconds", "0", "--events-endpoint", endpoint,
                     "--events-topic", "kv@cache@m", "--ok-exit-zero"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, report


def subscriber(port):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind(f"tcp://127.0.0.1:{port}")
    return sub


def received(sub, timeout=2.0):  # kept for the delivery test still to come (see CHANGELOG)
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
        elif out:
            break
    return out


def test_no_subscriber_never_fails_eviction(tmp_path, capsys):
    for _ in range(2):
        kvtier_file(tmp_path, os.urandom(32))
    started = time.monotonic()
    code, report = run(tmp_path, "kvtier", f"tcp://127.0.0.1:{free_port()}", capsys)
    assert code == 0 and report["files_deleted"] == 2
    assert report["events_published"] == 0 and report["events_dropped"] == 2
    assert "no connection" in report["events_problem"]
    assert time.monotonic() - started < 10


def test_unreachable_endpoint_never_fails_eviction(tmp_path, capsys):
    kvtier_file(tmp_path, os.urandom(32))
    code, report = run(tmp_path, "kvtier", "tcp://no-such-host.invalid:5557", capsys)
    assert code == 0 and report["files_deleted"] == 1
    assert report["events_dropped"] == 1 and report["events_problem"]


def test_slow_consumer_never_blocks_eviction(tmp_path, capsys):
    for _ in range(600):  # three batches
        kvtier_file(tmp_path, os.urandom(32), size=1)
    port = free_port()
    sub = subscriber(port)
    sub.setsockopt(zmq.RCVHWM, 1)
    try:  # never reads
        started = time.monotonic()
        code, report = run(tmp_path, "kvtier", f"tcp://127.0.0.1:{port}", capsys)
        assert time.monotonic() - started < 20
    finally:
        sub.close(0)
    assert code == 0 and report["files_deleted"] == 600
    assert report["events_published"] + report["events_dropped"] == 600


def test_name_without_a_full_hash_is_ignored_and_counted(tmp_path, capsys):
    short = tmp_path / "kvtier" / "v1" / FP / "ab" / "cd"
    short.mkdir(parents=True)
    p = short / "abcd0000.kvb"  # in the layout, but no block hash + group in it
    p.write_bytes(b"x" * 64)
    os.utime(p, (OLD, OLD))
    kvtier_file(tmp_path, os.urandom(32))
    port = free_port()
    sub = subscriber(port)
    try:
        code, report = run(tmp_path, "kvtier", f"tcp://127.0.0.1:{port}", capsys)
    finally:
        sub.close(0)
    assert code == 0 and report["files_deleted"] == 2
    assert report["events_ignored"] == 1 and report["events_published"] == 1


def test_names_map_to_the_hash_vllm_announces():
    block = bytes(range(32))
    key = block + (3).to_bytes(4, "big")
    assert block_hash("kvtier", key.hex() + ".kvb") == vllm_hash64(block)
    assert block_hash("vllm-fs", block.hex() + ".bin") == vllm_hash64(block)
    assert block_hash("kvtier", "abcd0000.kvb") is None
    assert block_hash("vllm-fs", "abc.bin") is None
    assert block_hash("sglang", block.hex() + "_m.bin") is None


def test_stdlib_msgpack_matches_msgspec():
    event = kv_events.BlockRemoved(block_hashes=[1, 2**64 - 1, 200], medium="STORAGE")
    ours = packb([1.5, [{"type": "BlockRemoved", "block_hashes": [1, 2**64 - 1, 200],
                         "medium": "STORAGE"}]])
    assert msgspec.msgpack.decode(ours, type=kv_events.KVEventBatch) == \
        kv_events.KVEventBatch(ts=1.5, events=[event])
    assert msgspec.msgpack.decode(packb({"s": "x" * 300, "n": -5, "b": None, "l": [True]})) \
        == {"s": "x" * 300, "n": -5, "b": None, "l": [True]}
