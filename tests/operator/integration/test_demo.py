"""`make demo` is the main job: run it and check what it says it did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT

MIB = 1 << 20

pytestmark = pytest.mark.timeout(300)


def test_make_demo_runs_the_whole_system(tmp_path):
    env = {**os.environ, "KVTIER_DEMO_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "kvtier_demo"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240, check=False)
    out = result.stdout
    assert result.returncode == 0, result.stderr[-3000:]
    # the operator applied what the example asks for
    assert "name: qwen3-tiered-kv-cache" in out and "storageClassName: lustre" in out
    assert "name: qwen3-tiered-evictor" in out and "concurrencyPolicy: Forbid" in out
    assert "lruCapacityPerServer: 25600" in out
    # the webhook injected the pod, with the sizes docs/sizing.md states
    assert "+        memory: 303Gi" in out and "+        memory: 203Gi" in out
    assert "+      sizeLimit: 120Gi" in out and "--kv-transfer-config" in out
    # real blocks moved and came back intact; the evictor freed by LRU
    assert f"bit-identical: True ({48 * MIB:,} bytes stored, {48 * MIB:,} loaded)" in out
    assert "its next load was refused (bad-checksum) and the file removed" in out
    assert "on the C extension;" in out  # make test builds it: the demo's hot path is C
    assert "usage 90.0% -> " in out and ": freed, " in out
    # and the status tells the truth about all of it
    assert ("Ready=True, claim qwen3-tiered-kv-cache Bound, 1 pod injected, 0 pending, "
            "last eviction freed") in out
    blocks = [f for _, _, fs in os.walk(tmp_path / "volume") for f in fs if f.endswith(".kvb")]
    assert 0 < len(blocks) < 47  # some evicted, the most recent kept, the damaged one gone
    # the operator read the pod's metrics through its real path: the engine's figures a
    # real vLLM server's captured pages (idle, then after one prompt served from the
    # storage tier), kvtier's backend figures those of the blocks this run moved
    assert ("the engine's figures there are a capture from a real vLLM 0.32 API server, "
            "tests/fixtures/metrics/vllm-0.32-cpu-storage-u-idle.txt") in out
    assert ("Hit 96.0% of 200 prompt tokens, recomputed 4.0%, and each tier's hit share: "
            "from the captured engine page (tests/fixtures/metrics/"
            "vllm-0.32-cpu-storage-u-loaded.txt") in out
    assert "failed loads: from the blocks this run moved" in out
    status = yaml.safe_load(out.split(" -o yaml (status)\n")[1].split("\n=== summary")[0])
    storage = next(t for t in status["status"]["tiers"] if t["name"] == "storage")
    # the window holds exactly what the demo moved (the capture's own 393,216 bytes loaded
    # are not on the page), and the damaged block's refused load
    assert storage["bytesLoaded"] == storage["bytesStored"] == 48 * MIB
    assert storage["failedLoads"] >= 1
    assert 0 < storage["loadLatency"]["p50Seconds"] <= storage["loadLatency"]["p99Seconds"]
    assert storage["hitPercent"] == 96.0 and storage["hitSource"] == "engine"
    assert (f"  storage: hit 96.0% (engine), {48 * MIB:,} bytes loaded, {48 * MIB:,} bytes "
            f"stored, {storage['failedLoads']} failed loads, load p50 ") in out
    assert "TiersEffective=True (TiersEffective): no advice" in out
    short = out.split("=== kubectl get tpc qwen3-tiered\n")[1].splitlines()
    assert short[0].split() == ["NAME", "READY", "STORAGE", "INJECTED", "USAGE", "HIT", "AGE"]
    assert float(short[1].split()[5]) == 96.0  # the Hit column is a number
    table = out.split("=== kubectl get tpc qwen3-tiered -o wide\n")[1].splitlines()
    header = table[0].split()
    assert header == ["NAME", "READY", "STORAGE", "INJECTED", "PENDING", "USAGE", "HIT",
                      "GPU-HIT", "CPU-HIT", "LOCALDISK-HIT", "STORAGE-HIT",
                      "OBJECTSTORE-HIT", "RECOMPUTE", "LAST-EVICTION", "AGE"]
    row = dict(zip(header, table[1].split(), strict=True))
    assert row["NAME"] == "qwen3-tiered" and row["READY"] == "True"
    assert float(row["HIT"]) == 96.0 and float(row["STORAGE-HIT"]) == 96.0
    assert float(row["CPU-HIT"]) == 0.0 and float(row["RECOMPUTE"]) == 4.0
    assert row["LOCALDISK-HIT"] == row["OBJECTSTORE-HIT"] == "<none>"  # not configured
    assert row["AGE"].endswith(("s", "m")), row["AGE"]  # the harness stamps creation


@pytest.mark.parametrize(("example", "needles"), [
    ("vllm-tpu-multi-host.yaml", ["TPU_OFFLOAD_NUM_CPU_CHUNKS", "+        memory: 156024Mi",
                                  "leaderworkerset.sigs.k8s.io/worker-index: '0'",
                                  "Ready=True (Ready), 2 pod(s) injected"]),
    ("mooncake-store.yaml", ["MOONCAKE_CONFIG_PATH",
                             "prerequisite ConfigMap llm-d/mooncake-store-config",
                             "Ready=True (Ready), 1 pod(s) injected"]),
    ("mooncake-offload.yaml", ["prerequisite DaemonSet mooncake/mooncake-client",
                               '"load_async":true', "rdma/ib: '1'",
                               "Ready=True (Ready), 1 pod(s) injected"]),
    # #38: the local disk's per-pod claim and the object store's CronJob and Secret refs
    ("native-local-disk.yaml", ['"type":"KvtierLocalTier"', "+    ephemeral:",
                                "+          storageClassName: topolvm-provisioner",
                                "1 pod(s) injected"]),
    ("native-object-store.yaml", ['"type":"KvtierObjectTier"', "name: qwen3-object-store-objects",
                                  "- evict-objects", "+        secretKeyRef:",
                                  "Ready=True (Ready), 1 pod(s) injected"]),
])
def test_make_demo_shows_any_example(tmp_path, example, needles):
    """`make demo EXAMPLE=examples/...`: the operator and webhook for that engine."""
    env = {**os.environ, "KVTIER_DEMO_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "kvtier_demo", f"examples/{example}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stdout, needle
