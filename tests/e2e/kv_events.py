"""One vLLM engine (its own process) with KV events on, configured as kvtier renders a cache
with precise routing, and a ZMQ SUB that decodes what it publishes with vLLM's own classes
(vllm.distributed.kv_events). Then kvtier's evictor deletes the block files and publishes
to a SUB that binds, as the llm-d router's does. Prints what each side saw, as JSON on the
last line.

    python -m tests.e2e.kv_events MODEL ROOT gpu-direct|tiered

gpu-direct: kvtier's own OffloadingSpec (no CPU tier; what vLLM's CPU build runs), with a
block file flipped between two runs of the prompt (the manager announces its removal).
tiered: vLLM's TieringOffloadingSpec with kvtier's tier, its CPU-tier worker replaced by
one that moves no data (tests/e2e/noop_cpu_spec.py): the CPU tier's events and the tier's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.e2e.engine import BLOCK_SIZE, generate, gpu_direct_doc, prompt

WAIT_SECONDS = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendered(mode: str, root: str, port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """kv-transfer-config and kv-events-config exactly as the operator renders them for a
    cache with precise routing, pointed at root and a local port."""
    from kvtier_operator.engines.vllm.gpu import kv_events_config
    from kvtier_operator.render.connector import kv_transfer_config
    from kvtier_operator.validation import parse_tpc
    from tests.helpers import example

    doc = gpu_direct_doc() if mode == "gpu-direct" else example("native-kvtier.yaml")
    doc["spec"]["router"] = {"enabled": True, "scoring": "precise"}
    if mode == "tiered":
        doc["spec"]["cpu"] = {"size": "64Mi"}
        doc["spec"]["storage"]["blockSize"] = BLOCK_SIZE  # one engine block per file
    tpc = parse_tpc(doc)
    kv = kv_transfer_config(tpc)
    extra = kv["kv_connector_extra_config"]
    if mode == "gpu-direct":
        extra |= {"root_dir": root, "n_read_threads": 2, "n_write_threads": 2}
    else:
        (tier,) = extra["secondary_tiers"]
        tier |= {"root_dir": root, "n_read_threads": 2, "n_write_threads": 2}
        extra |= {"spec_name": "NoopTieringOffloadingSpec",
                  "spec_module_path": "tests.e2e.noop_cpu_spec"}
    events = kv_events_config(tpc)
    assert events is not None
    events["endpoint"] = f"tcp://*:{port}"
    return kv, events


class Subscriber:
    """A SUB socket on a thread, every message decoded with vLLM's KVEventBatch. connect:
    to the engine's bound publisher (the router's per-pod subscriber); else it binds (the
    router's zmqEndpoint, where the evictor connects)."""

    def __init__(self, endpoint: str, connect: bool) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        (self.sock.connect if connect else self.sock.bind)(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.events: list[tuple[str, Any]] = []  # (topic, event)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                topic, _seq, payload = self.sock.recv_multipart()
                batch = self._decoder.decode(payload)
                with self._lock:
                    self.events += [(topic.decode(), e) for e in batch.events]

    def seen(self, kind: str, medium: str | None = None) -> list[Any]:
        with self._lock:
            return [e for _, e in self.events if type(e).__name__ == kind
                    and (medium is None or e.medium == medium)]

    def topics(self) -> set[str]:
        with self._lock:
            return {t for t, _ in self.events}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)


def hashes(events: list[Any]) -> list[list[int]]:
    """(hash, group) pairs, sorted, as JSON lists."""
    return sorted([h, e.group_idx] for e in events for h in e.block_hashes)


def file_blocks(root: str) -> dict[str, list[int]]:
    """Each block file -> the (hash, group) kvtier's evictor maps its name to."""
    from kvtier_evictor.events import block_id

    out = {}
    for path in Path(root).rglob("*.kvb"):
        found = block_id("kvtier", str(path))
        assert found is not None, path
        out[str(path)] = list(found)
    return out


def until(condition, llm, timeout: float = WAIT_SECONDS) -> bool:
    """Run engine steps (a one-token prompt shorter than a block: nothing new to store)
    until condition() holds: vLLM publishes a tier's events from its scheduler steps."""
    deadline = time.monotonic() + timeout
    seed = 1000
    while time.monotonic() < deadline:
        if condition():
            return True
        seed += 1
        generate(llm, prompt(seed, tokens=4), max_tokens=1)
        time.sleep(0.05)
    return condition()


def evict(root: str, topic: str) -> tuple[dict[str, Any], list[Any]]:
    """kvtier's evictor, everything idle and over the watermarks, publishing to a SUB that
    binds: its report, the events that SUB received."""
    from kvtier_evictor import cli

    port = free_port()
    router = Subscriber(f"tcp://127.0.0.1:{port}", connect=False)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cli.main(["--root", root, "--layout", "kvtier", "--capacity-bytes", "1",
                      "--high-watermark", "10", "--low-watermark", "1",
                      "--min-idle-seconds", "0", "--events-endpoint",
                      f"tcp://127.0.0.1:{port}", "--events-topic", topic, "--ok-exit-zero"])
        report = json.loads(out.getvalue().strip().splitlines()[-1])
        deadline = time.monotonic() + 10
        while len(hashes(router.seen("BlockRemoved"))) < report["events_published"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        return report, router.seen("BlockRemoved")
    finally:
        router.close()


def main() -> None:
    model, root, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    port = free_port()
    kv, events_config = rendered(mode, root, port)
    # Connected before the engine binds (ZMQ retries): subscribed by the first prompt.
    sub = Subscriber(f"tcp://127.0.0.1:{port}", connect=True)
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=BLOCK_SIZE,
              enforce_eager=True, max_model_len=512, dtype="float32",
              enable_prefix_caching=True, kv_transfer_config=KVTransferConfig(**kv),
              kv_events_config=KVEventsConfig(**events_config))
    result: dict[str, Any] = {"topic": events_config["topic"]}
    try:
        generate(llm, prompt(1))
        files = file_blocks(root)
        stored = lambda: hashes(sub.seen("BlockStored", "STORAGE"))  # noqa: E731
        until(lambda: len(files) > 0 and len(stored()) >= len(files), llm)
        files = file_blocks(root)
        result |= {"files": sorted(files.values()), "storage_stored": stored(),
                   "gpu_stored": hashes(sub.seen("BlockStored", "GPU")),
                   "cpu_stored": hashes(sub.seen("BlockStored", "CPU"))}
        if mode == "gpu-direct":
            # A file flipped between two runs of the prompt: the load refuses it, the
            # worker removes it, the manager finds it gone and announces the removal.
            victim = sorted(files)[len(files) // 2]
            data = bytearray(Path(victim).read_bytes())
            data[-1] ^= 0xFF
            Path(victim).write_bytes(data)
            llm.reset_prefix_cache()
            generate(llm, prompt(1))
            removed = lambda: hashes(sub.seen("BlockRemoved", "STORAGE"))  # noqa: E731
            until(lambda: bool(removed()), llm)
            result |= {"corrupted": files[victim], "engine_removed": removed()}
        result["before_evict"] = sorted(file_blocks(root).values())
        report, removed_events = evict(root, events_config["topic"])
        result |= {"evictor_report": report, "evictor_removed": hashes(removed_events),
                   "evictor_media": sorted({e.medium for e in removed_events}),
                   "topics": sorted(sub.topics())}
    finally:
        sub.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
