"""The demo pod's kvtier backend: a real BlockStore on the demo's shared volume, in the
demo's own process, so its kvtier_offload_* metrics (prometheus-client's default
registry, tier "storage") are the ones the pod's /metrics serves (kvtier_demo.replay).

It opens before the pod runs (the operator's first read is the window's baseline), then
moves real KV-sized blocks: stores them, loads them back and compares, and damages one
block file on the volume so that its next load is refused, as a second engine's would be.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier_offload import digest
from kvtier_offload.fileformat import HEADER_SIZE
from kvtier_offload.layout import fingerprint
from kvtier_offload.metrics import SHARED_TIER
from kvtier_offload.store import BlockStore, StoreConfig, hot_path

BLOCKS, BLOCK_BYTES = 48, 1 << 20
FLIPPED = 64  # payload bytes inverted in the damaged block's file


@dataclass(frozen=True)
class Moved:
    """What the demo's moves did, by the demo's own count (not the metrics')."""

    identical: bool
    bytes_stored: int
    bytes_loaded: int
    store_gbps: float
    load_gbps: float
    path: str
    damaged: Path  # the block file whose payload the demo damaged
    refused: bool  # its load failed (the engine recomputes those tokens)
    refused_why: str  # the reason the store counted it under (corrupt_files)
    kept: int  # block files left on the volume


class DemoBlocks:
    """A BlockStore on `volume`, open from construction until close()."""

    def __init__(self, volume: Path, fingerprint_src: dict[str, Any]) -> None:
        self.volume = volume
        self.store = BlockStore(StoreConfig(
            root=str(volume), fingerprint=fingerprint(fingerprint_src), read_threads=2,
            write_threads=2, write_queue_seconds=60))

    def _run(self, what: str, submit: Any) -> list[bool]:
        submit()
        self.store.drain()
        outcomes = [o.success for o in self.store.finished()]
        if not outcomes:
            raise SystemExit(f"demo: the block store reported no {what} in {self.volume}")
        return outcomes

    def move(self) -> Moved:
        arena = mmap.mmap(-1, BLOCKS * BLOCK_BYTES)
        arena[:] = os.urandom(BLOCKS * BLOCK_BYTES)
        rows = [memoryview(arena)[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] for i in range(BLOCKS)]
        keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(BLOCKS)]
        start = time.perf_counter()
        if not all(self._run("store", lambda: self.store.store(
                1, list(zip(keys, rows, strict=True))))):
            raise SystemExit(f"demo: the block store failed to store into {self.volume}")
        stored_s = time.perf_counter() - start
        back = mmap.mmap(-1, BLOCKS * BLOCK_BYTES)
        dests = [memoryview(back)[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] for i in range(BLOCKS)]
        start = time.perf_counter()
        if not all(self._run("load", lambda: self.store.load(
                2, list(zip(keys, dests, strict=True))))):
            raise SystemExit(f"demo: the block store failed to load from {self.volume}")
        loaded_s = time.perf_counter() - start
        identical = back[:] == arena[:]
        damaged, refused, why = self._damage_and_load(keys[-1])
        now = time.time()  # age the files: the evictor never touches what was just used
        kept = 0
        for i, key in enumerate(keys):
            path = self.store.layout.path(key)
            if os.path.exists(path):  # the refused block's file is gone
                os.utime(path, (now - 3600 - 60 * i, now - 3600 - 60 * i))
                kept += 1
        code, reason = hot_path(True)
        path = ("the C extension" if code == "ok"
                else f"the Python path, digest by {digest.BACKEND} ({reason})")
        total = BLOCKS * BLOCK_BYTES
        return Moved(identical=identical, bytes_stored=total, bytes_loaded=total,
                     store_gbps=total / stored_s / 1e9, load_gbps=total / loaded_s / 1e9,
                     path=path, damaged=damaged, refused=refused, refused_why=why,
                     kept=kept)

    def _damage_and_load(self, key: bytes) -> tuple[Path, bool, str]:
        """Invert FLIPPED bytes in the middle of key's payload on the volume, then load
        it: the store checks the payload's digest, refuses the file and counts why."""
        path = Path(self.store.layout.path(key))
        with path.open("r+b") as f:
            f.seek(HEADER_SIZE + BLOCK_BYTES // 2)
            payload = f.read(FLIPPED)
            f.seek(HEADER_SIZE + BLOCK_BYTES // 2)
            f.write(bytes(b ^ 0xFF for b in payload))
        before = self._corrupt_counts()
        dest = bytearray(BLOCK_BYTES)
        outcomes = self._run("load", lambda: self.store.load(3, [(key, memoryview(dest))]))
        after = self._corrupt_counts()
        why = ", ".join(sorted(r for r, n in after.items() if n > before.get(r, 0.0)))
        return path, not any(outcomes), why

    @staticmethod
    def _corrupt_counts() -> dict[str, float]:
        """kvtier_offload_corrupt_files by reason, as the store counted them."""
        from prometheus_client import REGISTRY

        return {s.labels["reason"]: s.value for family in REGISTRY.collect()
                if family.name == "kvtier_offload_corrupt_files"
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("tier") == SHARED_TIER}

    def close(self) -> None:
        self.store.close()
