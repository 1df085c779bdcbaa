"""Runs everywhere, CPU included: the worker's round trip with whichever vLLM types this
machine has (vLLM's own, or tests/offload/vllm032.py on a torch-only GPU machine), so a
`make gpu-check` report shows the stand-in works before any GPU test relies on it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_a_cpu_round_trip_with_this_machines_vllm_types(tmp_path):
    from tests.offload.worker_cases import DTYPES, round_trip

    round_trip(tmp_path, "per-layer", DTYPES["bf16"], "cpu")
