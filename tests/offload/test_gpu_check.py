"""`make gpu-check` (scripts/gpu_check.py) on CPU, with vLLM hidden as on the borrowed GPU
machines (torch alone): every GPU part skips cleanly, the worker's vLLM types come from
the test stand-in and work, and one report comes out with the facts, every GPU test's
outcome and the benchmark's part."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_gpu_check_without_cuda_or_vllm_skips_the_gpu_and_writes_its_report(tmp_path):
    report = tmp_path / "report.md"
    env = {**os.environ, "PYTHONPATH": "offload:."}
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--hide-vllm", "--quick",
                           "--report", str(report)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    text = report.read_text()
    assert "| CUDA available | False |" in text
    assert "| vLLM | absent: types from tests/offload/vllm032.py |" in text
    assert "| test_a_cpu_round_trip_with_this_machines_vllm_types | passed |" in text
    assert "| test_g7_a_load_does_not_wait_behind_a_large_store | skipped |" in text
    assert "failed" not in text.split("## GPU tests")[1].split("##")[0].replace(
        "pytest exit", "")
    assert "| error |" not in text
    assert "gpu: skipped, no CUDA device" in text
    assert "- nothing measured (no CUDA device)" in text
