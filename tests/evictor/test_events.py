"""The evictor's BlockRemoved events (issue #33): delivered to a subscriber that binds, as
the llm-d router's does, decoded there with vLLM's own classes, hashes and groups equal to
what vLLM announces for the same blocks, and publishing that never blocks or fails
eviction (no subscriber, an unreachable endpoint, a subscriber that never reads, names
outside the layout)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from kvtier_evictor import cli
from kvtier_evictor.events import batch_payload, block_id

zmq = pytest.importorskip("zmq")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")

FP = "0123456789abcdef"
OLD = time.time() - 86400
TOPIC = "kv@cache@m"
# A hung consumer's buffers, so that what fits in flight is known and far below the
# messages sent: the kernel doubles these and has a floor of a few KiB. In flight then:
# 10 queued (SEND_HWM), ZMQ's 8 KiB batches on each end and the two kernel buffers,
# at most some 300 of the ~100-byte messages (about 100 seen), against SLOW_FILES sent.
SLOW_RCVBUF = 4096
SLOW_SNDBUF = 4096
SLOW_FILES = 1000


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
                     "--events-topic", TOPIC, "--ok-exit-zero"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, report


class Router:
    """What the llm-d router's producer does with its zmqEndpoint: a SUB that binds,
    subscribes to "kv@" and keeps receiving (pkg/kvevents/zmq_subscriber.go,
    remote=false), here on a thread; each message decoded with vLLM's classes. With
    reads=N it stops reading after N messages and never reads again (a hung consumer),
    its queue one message and its kernel receive buffer the smallest (SLOW_RCVBUF)."""

    def __init__(self, port: int, reads: int | None = None) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 1 if reads is not None else 1000)
        if reads is not None:  # before bind: the accepted connection takes it
            self.sub.setsockopt(zmq.RCVBUF, SLOW_RCVBUF)
        self.sub.bind(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.reads = reads
        self.messages: list[tuple[bytes, int, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        while not self._stop.is_set():
            if self.reads is not None and len(self.messages) >= self.reads:
                self._stop.wait()  # hung: the socket is never read again
                break
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.messages.append((topic, int.from_bytes(seq, "big"),
                                      decoder.decode(payload)))

    def close(self, quiet: float = 0.5) -> list:
        """Stop once nothing arrived for `quiet` seconds; the messages received."""
        count, deadline = -1, time.monotonic() + 10
        while count != len(self.messages) and time.monotonic() < deadline:
            count = len(self.messages)
            time.sleep(quiet)
        self._stop.set()
        self._thread.join()
        self.sub.close(0)
        return self.messages


@pytest.mark.parametrize("layout", ["kvtier", "vllm-fs"])
def test_a_bound_subscriber_receives_every_removal(tmp_path, capsys, layout):
    """No sleep, no loss: the first batch is sent once the subscription arrived."""
    make = kvtier_file if layout == "kvtier" else vllm_fs_file
    blocks = {(os.urandom(32), group) for group in (0, 1) for _ in range(300)}
    for block, group in blocks:
        make(tmp_path, block, group, size=1)
    port = free_port()
    router = Router(port)
    try:
        code, report = run(tmp_path, layout, f"tcp://127.0.0.1:{port}", capsys)
    finally:
        messages = router.close()
    assert code == 0 and report["files_deleted"] == 600, report
    assert report["events_published"] == 600 and report["events_dropped"] == 0, report
    assert not report["events_problem"]
    assert {topic for topic, _, _ in messages} == {TOPIC.encode()}
    assert [seq for _, seq, _ in messages] == list(range(len(messages)))
    got = set()
    for _, _, batch in messages:
        for event in batch.events:
            assert isinstance(event, kv_events.BlockRemoved)
            assert event.medium == "STORAGE"
            got.update((h, event.group_idx) for h in event.block_hashes)
    assert got == {(vllm_hash64(block), group) for block, group in blocks}


def test_no_subscriber_never_fails_eviction(tmp_path, capsys):
    for _ in range(2):
        kvtier_file(tmp_path, os.urandom(32))
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))  # accepts, never speaks ZMTP
    try:
        started = time.monotonic()
        code, report = run(tmp_path, "kvtier", f"tcp://127.0.0.1:{port}", capsys)
        assert time.monotonic() - started < 10
    finally:
        listener.close()
    assert code == 0 and report["files_deleted"] == 2
    assert report["events_published"] == 0 and report["events_dropped"] == 2
    assert "no subscriber" in report["events_problem"]


def test_a_subscriber_for_other_topics_gets_nothing_counted_as_dropped(tmp_path, capsys):
    kvtier_file(tmp_path, os.urandom(32))
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"other@")
    try:
        code, report = run(tmp_path, "kvtier", f"tcp://127.0.0.1:{port}", capsys)
    finally:
        sub.close(0)
    assert code == 0 and report["files_deleted"] == 1
    assert report["events_published"] == 0 and report["events_dropped"] == 1


def test_unreachable_endpoint_never_fails_eviction(tmp_path, capsys):
    kvtier_file(tmp_path, os.urandom(32))
    started = time.monotonic()
    code, report = run(tmp_path, "kvtier", "tcp://no-such-host.invalid:5557", capsys)
    assert time.monotonic() - started < 10
    assert code == 0 and report["files_deleted"] == 1
    assert report["events_dropped"] == 1 and report["events_problem"]


def test_slow_consumer_never_blocks_eviction(tmp_path, capsys, monkeypatch):
    """A subscriber that stops reading after its first message: once its queue and the
    socket buffers are full, batches are refused and counted, and the run neither
    waits nor fails. The buffers are made small on both ends (the publisher's
    SEND_BUFFER_BYTES, the subscriber's RCVBUF): with the kernel's own, loopback's
    autotuned buffers (megabytes) took every one of 3000 small messages in a CI run and
    nothing was dropped, which made this depend on the machine and its load."""
    from kvtier_evictor import events

    monkeypatch.setattr(events, "BATCH", 1)  # one message per file: fill the queues
    monkeypatch.setattr(events, "SEND_HWM", 10)
    monkeypatch.setattr(events, "SEND_BUFFER_BYTES", SLOW_SNDBUF)
    for _ in range(SLOW_FILES):
        kvtier_file(tmp_path, os.urandom(32), size=1)
    port = free_port()
    router = Router(port, reads=1)
    try:
        started = time.monotonic()
        code, report = run(tmp_path, "kvtier", f"tcp://127.0.0.1:{port}", capsys)
        assert time.monotonic() - started < 20
    finally:
        router.close(quiet=0)
    assert code == 0 and report["files_deleted"] == SLOW_FILES
    assert report["events_published"] + report["events_dropped"] == SLOW_FILES
    # At most some hundreds in flight (SLOW_FILES' note); the rest is refused.
    assert report["events_dropped"] > SLOW_FILES // 2, report
    assert "dropped events" in report["events_problem"]


def test_name_without_a_full_hash_is_ignored_and_counted(tmp_path, capsys):
    short = tmp_path / "kvtier" / "v1" / FP / "ab" / "cd"
    short.mkdir(parents=True)
    p = short / "abcd0000.kvb"  # in the layout, but no block hash + group in it
    p.write_bytes(b"x" * 64)
    os.utime(p, (OLD, OLD))
    kvtier_file(tmp_path, os.urandom(32))
    port = free_port()
    router = Router(port)
    try:
        code, report = run(tmp_path, "kvtier", f"tcp://127.0.0.1:{port}", capsys)
    finally:
        messages = router.close()
    assert code == 0 and report["files_deleted"] == 2
    assert report["events_ignored"] == 1 and report["events_published"] == 1
    assert sum(len(e.block_hashes) for _, _, b in messages for e in b.events) == 1


def test_names_map_to_the_hash_and_group_vllm_announces():
    block = bytes(range(32))
    key = block + (3).to_bytes(4, "big")
    assert block_id("kvtier", f"/r/ab/{key.hex()}.kvb") == (vllm_hash64(block), 3)
    assert block_id("vllm-fs", f"/r/m/000/00_g2/{block.hex()}.bin") == (vllm_hash64(block), 2)
    assert block_id("kvtier", "/r/abcd0000.kvb") is None
    assert block_id("vllm-fs", "/r/m/000/00/abc.bin") is None
    assert block_id("vllm-fs", f"/r/m/000/00/{block.hex()}.bin") is None  # no group dir
    assert block_id("sglang", f"/r/{block.hex()}_m.bin") is None


def test_the_payload_is_vllms_block_removed():
    batch = msgspec.msgpack.decode(batch_payload([1, 2**64 - 1, 200], 1, 1.5),
                                   type=kv_events.KVEventBatch)
    assert batch == kv_events.KVEventBatch(ts=1.5, events=[kv_events.BlockRemoved(
        block_hashes=[1, 2**64 - 1, 200], medium="STORAGE", group_idx=1)])


def run_for_pods(root, endpoint, pods_file, capsys):
    code = cli.main(["--root", str(root), "--layout", "kvtier", "--capacity-bytes", "100",
                     "--high-watermark", "10", "--low-watermark", "1",
                     "--min-idle-seconds", "0", "--events-endpoint", endpoint,
                     "--events-topic", TOPIC, "--events-pods-file", str(pods_file),
                     "--ok-exit-zero"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, report


def test_each_pod_gets_every_removal_under_its_own_topic(tmp_path, capsys):
    """The router (ebab687) keys entries by the topic's pod segment, with no pool
    identity (#2586): each pod the operator listed gets its own copy of every batch,
    numbered as a stream of its own (0, 1, 2, ...: what a vLLM publisher sends and a
    router subscriber that checks sequences accepts without a gap or a reset)."""
    root = tmp_path / "kv"
    blocks = {(os.urandom(32), group) for group in (0, 1) for _ in range(150)}
    for block, group in blocks:
        kvtier_file(root, block, group, size=1)
    pods = ["10.0.0.7:8000", "fd00::12:8000"]
    pods_file = tmp_path / "pods"
    pods_file.write_text("".join(f"{p}\n" for p in pods) + "not-a-pod\n")
    port = free_port()
    router = Router(port)
    try:
        code, report = run_for_pods(root, f"tcp://127.0.0.1:{port}", pods_file, capsys)
    finally:
        messages = router.close()
    assert code == 0 and report["files_deleted"] == 300, report
    assert report["events_published"] == 600 and report["events_dropped"] == 0, report
    assert "not-a-pod" in report["events_problem"]
    want = {(vllm_hash64(block), group) for block, group in blocks}
    for pod in pods:
        got = set()
        for topic, _, batch in messages:
            if topic == f"kv@{pod}@m".encode():
                for event in batch.events:
                    assert isinstance(event, kv_events.BlockRemoved)
                    assert event.medium == "STORAGE"
                    got.update((h, event.group_idx) for h in event.block_hashes)
        assert got == want, pod
    assert {topic for topic, _, _ in messages} == {f"kv@{p}@m".encode() for p in pods}
    for pod in pods:
        seqs = [seq for topic, seq, _ in messages if topic == f"kv@{pod}@m".encode()]
        assert seqs == list(range(len(seqs))) and seqs, (pod, seqs)


@pytest.mark.parametrize("content", [None, "", "\n\n", "pod-a:8000\n10.0.0.1:0\n"])
def test_no_pods_publishes_nothing_and_says_why(tmp_path, capsys, content):
    root = tmp_path / "kv"
    for _ in range(3):
        kvtier_file(root, os.urandom(32))
    pods_file = tmp_path / "pods"
    if content is not None:
        pods_file.write_text(content)
    port = free_port()
    router = Router(port)
    try:
        code, report = run_for_pods(root, f"tcp://127.0.0.1:{port}", pods_file, capsys)
    finally:
        messages = router.close(quiet=0.2)
    assert code == 0 and report["files_deleted"] == 3, report
    assert report["events_published"] == 0 and report["events_dropped"] == 3, report
    assert str(pods_file) in report["events_problem"]
    assert messages == []


def test_the_pods_file_is_read_bounded(tmp_path):
    from kvtier_evictor.events import EVENT_PODS_MAX_LINES, read_event_pods

    pods_file = tmp_path / "pods"
    pods_file.write_text("".join(f"10.1.{i // 250}.{i % 250}:8000\n" for i in range(5000)))
    pods, problem = read_event_pods(str(pods_file))
    assert len(pods) == EVENT_PODS_MAX_LINES and problem
    pods_file.write_text("10.0.0.1:8000\n" + "x" * 200_000)
    pods, problem = read_event_pods(str(pods_file))
    assert pods == ["10.0.0.1:8000"] and "bytes" in problem
