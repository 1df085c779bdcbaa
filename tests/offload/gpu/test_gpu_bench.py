"""The GPU benchmark (benchmarks/gpu.py, part of `make bench`): without CUDA it says it
skips and does nothing else; on a GPU its quick subset runs end to end, so the first GPU
session finds a benchmark that works."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_gpu_bench_says_it_skips_without_cuda(capsys):
    from benchmarks import gpu

    gpu.main()
    out = capsys.readouterr().out
    assert out.startswith("gpu: skipped, no CUDA device")
    assert out.count("\n") == 1, "it did more than skip"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bench_quick_subset_runs(monkeypatch, capsys):
    pytest.importorskip("vllm")
    import importlib

    monkeypatch.setenv("KVTIER_BENCH_GPU_QUICK", "1")
    from benchmarks import gpu

    gpu = importlib.reload(gpu)
    gpu.main()
    out = capsys.readouterr().out
    for section in ("B0 raw pinned DMA", "B1 vLLM", "B2 kvtier device phase",
                    "submit_store of", "B3 GPU -> file -> GPU"):
        assert section in out, f"{section!r} missing from:\n{out}"
