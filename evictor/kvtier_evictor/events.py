"""BlockRemoved for the block files the evictor deletes, in vLLM's KV-events wire format,
so that a router indexing KV events (llm-d's precise prefix-cache scorer) forgets them.

Wire format (vllm/distributed/kv_events.py, 0.24+): ZMQ PUB frames
[topic, sequence (8 bytes big-endian), msgpack(KVEventBatch)], the batch an array
[timestamp, [events]], each event a map tagged "type": {"type": "BlockRemoved",
"block_hashes": [...], "medium": "STORAGE"}. Block hashes are what vLLM announces for a
block: the last 8 bytes of its hash as an unsigned int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).

File name to block hash, per layout:
- kvtier: <key hex>.kvb, key = vLLM's OffloadKey = block hash + 4-byte group index;
- vllm-fs: <block hash hex>.bin (64 hex digits for sha256) under <hh>_g<group>/.
Any other name (another layout, a short key) is ignored and counted.

Only the stdlib encodes (the msgpack subset events need, below); pyzmq is imported only
when publishing is configured (--events-endpoint): the evictor's image and its tests run
without it otherwise. Publishing never blocks or fails eviction: the socket never waits
(a send that would block is dropped), the connection wait and close are bounded, and
every failure is counted in the report.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
import time
from typing import Any

log = logging.getLogger("kvtier_evictor")

MEDIUM = "STORAGE"  # what vLLM's file tiers announce (0.27+); the router lowercases it
BATCH = 256  # block hashes per event
CONNECT_WAIT_SECONDS = 2.0
SUBSCRIPTION_SETTLE_SECONDS = 1.5
LINGER_MS = 1000  # close waits at most this long for queued events to leave
SEND_HWM = 10_000  # messages queued per peer; beyond it a send is dropped, never waits
_MASK = (1 << 64) - 1
_KVTIER_NAME = re.compile(r"([0-9a-f]+)\.kvb\Z")
_VLLM_FS_NAME = re.compile(r"([0-9a-f]+)\.bin\Z")
OFFLOAD_KEY_GROUP_BYTES = 4  # vLLM make_offload_key: hash + group_idx.to_bytes(4, "big")


# ----------------------------------------------------------------- msgpack

def packb(obj: Any) -> bytes:
    """msgpack for None, bool, int (64-bit), float, str, bytes, list/tuple, dict."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True:
        out.append(0xC3)
    elif obj is False:
        out.append(0xC2)
    elif isinstance(obj, int):
        if 0 <= obj < 0x80:
            out.append(obj)
        elif -32 <= obj < 0:
            out.append(obj & 0xFF)
        elif 0 <= obj <= 0xFFFFFFFFFFFFFFFF:
            out += b"\xcf" + struct.pack(">Q", obj)
        elif -(1 << 63) <= obj < 0:
            out += b"\xd3" + struct.pack(">q", obj)
        else:
            raise OverflowError(f"{obj} does not fit msgpack's 64 bits")
    elif isinstance(obj, float):
        out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        data = obj.encode()
        _header(len(data), out, 0xA0, 31, 0xD9, 0xDA, 0xDB)
        out += data
    elif isinstance(obj, (bytes, bytearray)):
        _header(len(obj), out, None, 0, 0xC4, 0xC5, 0xC6)
        out += obj
    elif isinstance(obj, (list, tuple)):
        _header(len(obj), out, 0x90, 15, None, 0xDC, 0xDD)
        for item in obj:
            _pack(item, out)
    elif isinstance(obj, dict):
        _header(len(obj), out, 0x80, 15, None, 0xDE, 0xDF)
        for key, value in obj.items():
            _pack(key, out)
            _pack(value, out)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__}")


def _header(n: int, out: bytearray, fix: int | None, fix_max: int, b8: int | None,
            b16: int, b32: int) -> None:
    if fix is not None and n <= fix_max:
        out.append(fix | n)
    elif b8 is not None and n <= 0xFF:
        out += bytes((b8, n))
    elif n <= 0xFFFF:
        out += bytes((b16,)) + struct.pack(">H", n)
    else:
        out += bytes((b32,)) + struct.pack(">I", n)


# ------------------------------------------------------------- names to hashes

def block_hash(layout: str, name: str) -> int | None:
    """The hash vLLM announced for the block in this file (64-bit int), or None where the
    name is not one of the layout's block names with a full hash."""
    if layout == "kvtier":
        m = _KVTIER_NAME.fullmatch(name)
        if m is None or len(m.group(1)) % 2:
            return None
        key = bytes.fromhex(m.group(1))
        if len(key) < 8 + OFFLOAD_KEY_GROUP_BYTES:
            return None
        return int.from_bytes(key[:-OFFLOAD_KEY_GROUP_BYTES][-8:], "big") & _MASK
    if layout == "vllm-fs":
        m = _VLLM_FS_NAME.fullmatch(name)
        if m is None or len(m.group(1)) % 2 or len(m.group(1)) < 16:
            return None
        return int.from_bytes(bytes.fromhex(m.group(1))[-8:], "big") & _MASK
    return None


def batch_payload(hashes: list[int], ts: float) -> bytes:
    event = {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}
    return packb([ts, [event]])


# ------------------------------------------------------------------ publisher

class Publisher:
    """Collects the block files deleted (from any thread) and publishes their removal in
    batches. Counters: published (block hashes handed to the socket), dropped (hashes
    whose send failed or that were never sent: no pyzmq, no connection), ignored (names
    outside the layout's mapping)."""

    def __init__(self, endpoint: str, topic: str, layout: str,
                 connect_wait: float = CONNECT_WAIT_SECONDS) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.layout = layout
        self.published = 0
        self.dropped = 0
        self.ignored = 0
        self.problem = ""
        self._pending: list[int] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._socket: Any = None
        self._monitor: Any = None
        self._zmq: Any = None
        self.connected = False
        self._connect(connect_wait)

    def _connect(self, wait: float) -> None:
        try:
            import zmq  # optional: only when publishing is configured
        except ImportError:
            self.problem = "pyzmq is not installed: no KV events published"
            log.warning("kvtier-evictor: %s", self.problem)
            return
        try:
            ctx: Any = zmq.Context.instance()
            sock = ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a live connection
            monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.endpoint)
        except zmq.ZMQError as err:
            self.problem = f"cannot publish to {self.endpoint}: {err}"
            log.warning("kvtier-evictor: %s", self.problem)
            return
        self._zmq = zmq
        self._socket = sock
        self._monitor = monitor
        deadline = time.monotonic() + wait
        while not self.connected and time.monotonic() < deadline:
            if monitor.poll(int(max(deadline - time.monotonic(), 0) * 1000) + 1):
                self._events()
        if self.connected:
            # A subscriber's subscription travels after the connection: events sent
            # before it arrives are filtered out by the PUB socket (ZMQ's slow joiner).
            time.sleep(SUBSCRIPTION_SETTLE_SECONDS)
        else:
            self.problem = f"no connection to {self.endpoint} within {wait:g}s"
            log.warning("kvtier-evictor: %s (events sent once it connects)", self.problem)

    def _events(self) -> None:
        """Read the connection's state from the monitor (never waits)."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            self.connected = event == self._zmq.EVENT_CONNECTED

    def removed(self, path: str) -> None:
        """A block file was deleted (any thread)."""
        h = block_hash(self.layout, path.rsplit("/", 1)[-1])
        with self._lock:
            if h is None:
                self.ignored += 1
                return
            self._pending.append(h)
            if len(self._pending) >= BATCH:
                self._flush_locked()

    def _flush_locked(self) -> None:
        hashes, self._pending = self._pending, []
        if not hashes:
            return
        if self._socket is not None:
            self._events()
        if self._socket is None or not self.connected:  # a PUB would drop them silently
            self.dropped += len(hashes)
            return
        frames = [self.topic, self._seq.to_bytes(8, "big"), batch_payload(hashes, time.time())]
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.ZMQError as err:  # Again: no peer or the peer's queue is full
            self.dropped += len(hashes)
            if not self.problem:
                self.problem = f"dropped events: {err}"
            return
        self._seq += 1
        self.published += len(hashes)

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            if self._socket is not None:
                self._socket.disable_monitor()
                self._monitor.close(0)
                self._socket.close()  # waits at most LINGER_MS for queued events
                self._socket = None
