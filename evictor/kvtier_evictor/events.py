"""BlockRemoved for the block files the evictor deletes, in vLLM's KV-events wire format,
so that a router indexing KV events (llm-d's precise prefix-cache scorer) forgets them.

Wire format (vllm/distributed/kv_events.py, 0.24+): ZMQ frames [topic, sequence (8 bytes
big-endian), msgpack(KVEventBatch)], the batch an array [timestamp, [events]], each
event a map tagged "type": {"type": "BlockRemoved", "block_hashes": [...], "medium":
"STORAGE", "group_idx": g}. Block hashes are what vLLM announces for a block: the last 8
bytes of its hash as an unsigned int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), one event per
KV cache group, as vLLM's own offloading events (OffloadingEventsTracker) send them.

File name to (block hash, group), per layout:
- kvtier: <key hex>.kvb, key = vLLM's OffloadKey = block hash + 4-byte group index;
- vllm-fs: <block hash hex>.bin (64 hex digits for sha256) under <hh>_g<group>/.
Any other name (another layout, a short key) is ignored and counted.

Delivery. The router's subscriber binds (llm-d-router pkg/kvevents/zmq_subscriber.go,
the producer's zmqEndpoint) and the evictor connects to it. A ZMQ subscription travels
after the connection, and a publisher drops what it sends before one has arrived (the
"slow joiner"), so the evictor publishes from an XPUB socket: it sees the subscriptions
themselves, waits (bounded) for one that matches its topic before the first send, and
keeps reading them, so an unsubscribe or a lost subscriber stops the sends. With
XPUB_NODROP a full queue (a subscriber that never reads) refuses a send instead of
dropping it silently, so every hash is counted: published (accepted by the socket for a
subscribed peer) or dropped.

Topics: `kv@<pod>@<model>`, one copy of each batch per engine pod (no pool identity at
the router's commit, llm-d-router #2586). Checked at llm-d-router ebab687: the bound
socket is the producer's "local-subscriber", whose messages carry no source endpoint
(preciseprefixcache/producer.go:193-197), so the router takes the pod from the topic:
split at "@", exactly three parts, else the whole topic and no model
(pkg/kvevents/engineadapter/common.go:36-45, vllm_adapter.go:64-65; pool.go:316-323).
<pod> must be the key the pod's own events were indexed under: its per-pod subscriber
stamps them `<pod IP>:<InferencePool target port>` (preciseprefixcache/extractor.go:80,
the port from pkg/epp/datastore/datastore.go:332-346), and a BlockRemoved under any
other pod finds no KV cache group for it and is skipped (pool.go:589-607). The operator
writes those identities (render/event_pods.py). The model segment is not read for
removals (pool.go:644-650).

Sequence numbers: the bound socket's subscriber has no replay endpoint, so it takes
every message and never compares sequences (zmq_subscriber.go:177-179); only a per-pod
subscriber with a replay port tracks them, per connection: a repeat is skipped, a gap
asks for a replay, a lower one resets the pod (zmq_subscriber.go:182-243). The evictor
numbers each topic on its own, from 0 and without gaps over the sends the socket took,
as a vLLM publisher numbers its stream: one counter across all pods' topics would give
each pod's stream gaps of (pods - 1).

pyzmq and msgspec (vLLM's own encoder for these events; `kvtier[events]`) are imported
only when publishing is configured (--events-endpoint); the evictor's other paths and
the name mapping run on the stdlib. Publishing never blocks or fails eviction: sends
never wait, the subscription wait and the close are bounded, every failure is counted.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
from typing import Any

log = logging.getLogger("kvtier_evictor")

MEDIUM = "STORAGE"  # what vLLM's file tiers announce (0.27+); the router lowercases it
BATCH = 256  # block hashes per event
SUBSCRIBER_WAIT_SECONDS = 2.0  # before eviction starts: a subscriber's subscription
LINGER_MS = 1000  # close waits at most this long for queued events to leave
SEND_HWM = 10_000  # messages queued per peer; beyond it a send is refused, never waits
# The connection's kernel send buffer (ZMQ_SNDBUF, SO_SNDBUF); None: the kernel's own
# (autotuned, megabytes on loopback). Beyond SEND_HWM the socket buffers hold the rest
# of what a subscriber that stopped reading was sent; tests make them small so that a
# slow consumer fills them at a known point.
SEND_BUFFER_BYTES: int | None = None
_MASK = (1 << 64) - 1
_KVTIER_NAME = re.compile(r"([0-9a-f]+)\.kvb\Z")
_VLLM_FS_NAME = re.compile(r"([0-9a-f]+)\.bin\Z")
_VLLM_FS_GROUP_DIR = re.compile(r"[0-9a-f]+_g([0-9]+)\Z")
OFFLOAD_KEY_GROUP_BYTES = 4  # vLLM make_offload_key: hash + group_idx.to_bytes(4, "big")
SUBSCRIBE, UNSUBSCRIBE = 1, 0  # the first byte of an XPUB's subscription message
# The event-pods file (the operator's <cache>-event-pods ConfigMap): one router identity
# of an engine pod a line, `<ip>:<port>`; read once at run start, bounded.
EVENT_PODS_MAX_BYTES = 64 * 1024
EVENT_PODS_MAX_LINES = 256  # the operator's MAX_EVENT_PODS


# ---------------------------------------------------------------- pods' topics

def _pod_identity(line: str) -> str | None:
    """`<ip>:<port>` as the operator writes it (IPv6 unbracketed), else None."""
    host, sep, port = line.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return line


def read_event_pods(path: str) -> tuple[list[str], str]:
    """The pods' identities in the file and, where a line or the file was refused, why.
    Reads at most EVENT_PODS_MAX_BYTES and EVENT_PODS_MAX_LINES lines."""
    try:
        with open(path, "rb") as f:
            data = f.read(EVENT_PODS_MAX_BYTES + 1)
    except OSError as err:
        return [], f"cannot read the event pods file {path}: {err.strerror or err}"
    problem = ""
    if len(data) > EVENT_PODS_MAX_BYTES:
        data = data[:EVENT_PODS_MAX_BYTES].rpartition(b"\n")[0]
        problem = f"{path} is over {EVENT_PODS_MAX_BYTES} bytes: read its first lines"
    pods: list[str] = []
    for raw in data.decode("utf-8", errors="replace").splitlines():
        line = raw.strip()
        if not line:
            continue
        if len(pods) == EVENT_PODS_MAX_LINES:
            problem = problem or f"{path} lists over {EVENT_PODS_MAX_LINES} pods: used the first"
            break
        if _pod_identity(line) is None:
            problem = problem or f"{path}: {line[:80]!r} is not <ip>:<port>, skipped"
            continue
        if line not in pods:
            pods.append(line)
    if not pods and not problem:
        problem = f"{path} lists no pods (none injected and running yet)"
    return pods, problem


def pod_topics(topic: str, pods: list[str]) -> list[str]:
    """kv@<pod>@<model> for each pod, the model taken from topic (kv@<any>@<model>)."""
    prefix, _, rest = topic.partition("@")
    model = rest.partition("@")[2]
    return [f"{prefix}@{pod}@{model}" for pod in pods]


# ------------------------------------------------------------- names to hashes

def block_id(layout: str, path: str) -> tuple[int, int] | None:
    """(the hash vLLM announced for the block in this file as a 64-bit int, its KV cache
    group), or None where the name is not one of the layout's block names with a full
    hash."""
    parent, _, name = path.rpartition("/")
    if layout == "kvtier":
        m = _KVTIER_NAME.fullmatch(name)
        if m is None or len(m.group(1)) % 2:
            return None
        key = bytes.fromhex(m.group(1))
        if len(key) < 8 + OFFLOAD_KEY_GROUP_BYTES:
            return None
        block, group = key[:-OFFLOAD_KEY_GROUP_BYTES], key[-OFFLOAD_KEY_GROUP_BYTES:]
        return int.from_bytes(block[-8:], "big") & _MASK, int.from_bytes(group, "big")
    if layout == "vllm-fs":
        m = _VLLM_FS_NAME.fullmatch(name)
        g = _VLLM_FS_GROUP_DIR.fullmatch(parent.rpartition("/")[2])
        if m is None or g is None or len(m.group(1)) % 2 or len(m.group(1)) < 16:
            return None
        return int.from_bytes(bytes.fromhex(m.group(1))[-8:], "big") & _MASK, int(g.group(1))
    return None


def batch_payload(hashes: list[int], group: int, ts: float) -> bytes:
    """One KVEventBatch holding one BlockRemoved (msgspec: what vLLM encodes with)."""
    import msgspec

    event = {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM,
             "group_idx": group}
    return msgspec.msgpack.encode([ts, [event]])


# ------------------------------------------------------------------ publisher

class Publisher:
    """Collects the block files deleted (from any thread) and publishes their removal in
    batches, once under each topic (one a pod: pod_topics). Counters, in block hashes
    times topics: published (accepted by the socket for a subscribed peer), dropped (not
    sent: no pyzmq or msgspec, no subscriber, a full queue; with no topic at all, each
    hash once), ignored (names outside the layout's mapping, once each). `problem` may
    be given: the first reason, e.g. why the topics are missing."""

    def __init__(self, endpoint: str, topics: list[str], layout: str,
                 subscriber_wait: float = SUBSCRIBER_WAIT_SECONDS, problem: str = "") -> None:
        self.endpoint = endpoint
        self.topics = [t.encode() for t in topics]
        self.layout = layout
        self.published = 0
        self.dropped = 0
        self.ignored = 0
        self.problem = ""
        if problem:
            self._fail(problem)
        self._pending: dict[int, list[int]] = {}  # group -> hashes
        # Each topic's own sequence, from 0 and without gaps over the batches the socket
        # took: one stream per pod, as each vLLM publisher numbers its own (see
        # "Sequence numbers" in the module docstring).
        self._seq = dict.fromkeys(self.topics, 0)
        self._lock = threading.Lock()
        self._socket: Any = None
        self._zmq: Any = None
        self._prefixes: set[bytes] = set()  # the subscriptions the peers sent
        self._open(subscriber_wait)

    def _subscribed(self, topic: bytes) -> bool:
        return any(topic.startswith(p) for p in self._prefixes)

    @property
    def subscribed(self) -> bool:
        """Some subscriber takes every topic (the router subscribes to "kv@")."""
        return bool(self.topics) and all(self._subscribed(t) for t in self.topics)

    def _open(self, wait: float) -> None:
        if not self.topics:  # nothing to publish under: no socket, every hash dropped
            self._fail("no topic to publish under")
            return
        try:  # optional: only when publishing is configured
            import msgspec  # noqa: F401
            import zmq
        except ImportError as err:
            self._fail(f"{err.name} is not installed (kvtier[events]): no KV events published")
            return
        try:
            sock: Any = zmq.Context.instance().socket(zmq.XPUB)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            if SEND_BUFFER_BYTES is not None:
                sock.setsockopt(zmq.SNDBUF, SEND_BUFFER_BYTES)
            sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full queue refuses: counted, not lost
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a completed connection
            sock.connect(self.endpoint)
        except zmq.ZMQError as err:
            self._fail(f"cannot publish to {self.endpoint}: {err}")
            return
        self._zmq = zmq
        self._socket = sock
        deadline = time.monotonic() + wait
        while not self.subscribed:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            self._read_subscriptions()
        if not self.subscribed:
            self._fail(f"no subscriber for {self.topics[0].decode(errors='replace')!r} at "
                       f"{self.endpoint} within {wait:g}s (sent once one subscribes)")

    def _fail(self, problem: str) -> None:
        if not self.problem:
            self.problem = problem
            log.warning("kvtier-evictor: %s", problem)

    def _read_subscriptions(self) -> None:
        """Take the (un)subscriptions the peers sent so far (never waits)."""
        zmq = self._zmq
        while True:
            try:
                message = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == bytes((SUBSCRIBE,)):
                self._prefixes.add(message[1:])
            elif message[:1] == bytes((UNSUBSCRIBE,)):
                self._prefixes.discard(message[1:])

    def removed(self, path: str) -> None:
        """A block file was deleted (any thread)."""
        found = block_id(self.layout, path)
        with self._lock:
            if found is None:
                self.ignored += 1
                return
            block, group = found
            hashes = self._pending.setdefault(group, [])
            hashes.append(block)
            if len(hashes) >= BATCH:
                self._flush_locked(group)

    def _flush_locked(self, group: int) -> None:
        hashes = self._pending.pop(group, [])
        if not hashes:
            return
        if self._socket is None:
            self.dropped += len(hashes) * max(len(self.topics), 1)
            return
        self._read_subscriptions()
        payload = batch_payload(hashes, group, time.time())
        for topic in self.topics:
            if not self._subscribed(topic):  # XPUB would filter it out
                self.dropped += len(hashes)
                continue
            frames = [topic, self._seq[topic].to_bytes(8, "big"), payload]
            try:
                self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
            except self._zmq.ZMQError as err:  # Again: the subscriber's queue is full
                self.dropped += len(hashes)
                self._fail(f"dropped events: {err}")
                continue
            self._seq[topic] += 1
            self.published += len(hashes)

    def close(self) -> None:
        with self._lock:
            for group in list(self._pending):
                self._flush_locked(group)
            if self._socket is not None:
                self._socket.close()  # waits at most LINGER_MS for queued events
                self._socket = None
