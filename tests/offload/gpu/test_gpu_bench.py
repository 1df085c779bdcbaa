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
    """With or without vLLM (its types from tests/offload/vllm032.py): every section,
    both shapes through B3 with fresh keys and every file written (B3/B4 of the v2
    review crashed on the second shape and timed no writes), and rows for the report."""
    import importlib

    monkeypatch.setenv("KVTIER_BENCH_GPU_QUICK", "1")
    from benchmarks import gpu

    gpu = importlib.reload(gpu)
    rows = gpu.run()
    out = capsys.readouterr().out
    for section in ("B0 raw pinned DMA", "B1 vLLM", "B2 kvtier device phase",
                    "submit_store of", "F the volume's parallel file floor",
                    "B3 GPU -> file -> GPU"):
        assert section in out, f"{section!r} missing from:\n{out}"
    b3 = [r for r in rows if r["section"] == "B3"]
    assert {r["shape"] for r in b3} == set(gpu.SHAPES), "B3 stopped before its last shape"
    assert all(r["store_gbps"] > 0 and r["load_gbps"] > 0 for r in b3)


def test_gpu_bench_b3_runs_both_shapes_with_fresh_keys_on_cpu(monkeypatch, tmp_path, capsys):
    """B3 on CPU tensors (the v2 review's reproduction): both shapes in one root, every
    run writes every block of fresh keys (the run raises otherwise), the store figure
    waits for the writes, and the scratch holds one job's files at a time."""
    import importlib

    monkeypatch.setenv("KVTIER_BENCH_GPU_QUICK", "1")
    from benchmarks import gpu

    gpu = importlib.reload(gpu)
    gpu._use_vllm_types()
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    def cpu_kv(layers: int, page: int, num_blocks: int):
        return CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(
            torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8), page)
            for _ in range(layers)], group_data_refs=[[]])

    monkeypatch.setattr(gpu, "_kv", cpu_kv)
    monkeypatch.setattr(gpu, "RUNS", 8)  # two runs per job size: the keys must differ
    raw = {(d, s): s / 50e9 for d in ("d2h", "h2d", "both") for s in gpu.RAW_SIZES}
    gpu.ROWS.clear()
    floor = gpu.file_floor(str(tmp_path), "disk")
    gpu.end_to_end(raw, str(tmp_path), "disk", floor)
    b3 = [r for r in gpu.ROWS if r["section"] == "B3"]
    assert [(r["shape"], r["blocks"]) for r in b3] == [
        (shape, blocks) for shape in gpu.SHAPES for blocks in gpu.JOB_BLOCKS]
    assert not list(tmp_path.rglob("*.kvb")), "a run's files were left on the scratch"
    assert gpu.scratch_bytes() >= max(r["bytes"] for r in b3)
    assert "B3 GPU -> file -> GPU" in capsys.readouterr().out


def _cpu_bench(monkeypatch):
    """benchmarks/gpu.py's quick subset with the KV cache on CPU tensors (its dry run)."""
    import importlib

    monkeypatch.setenv("KVTIER_BENCH_GPU_QUICK", "1")
    from benchmarks import gpu

    gpu = importlib.reload(gpu)
    gpu._use_vllm_types()
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    def cpu_kv(layers: int, page: int, num_blocks: int):
        return CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(
            torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8), page)
            for _ in range(layers)], group_data_refs=[[]])

    monkeypatch.setattr(gpu, "_kv", cpu_kv)
    monkeypatch.setattr(gpu, "SHAPES", {"small 4x8KiB": (4, 8 << 10)})
    gpu.ROWS.clear()
    return gpu


def test_gpu_bench_b4_compares_16_and_256_token_files_on_cpu(monkeypatch, tmp_path, capsys):
    """B4's dry run: the same job in one-block files and in 256-token files, both written
    whole (the run raises otherwise) and removed, one row with both figures."""
    gpu = _cpu_bench(monkeypatch)
    gpu.files_per_job(str(tmp_path), "disk")
    (row,) = [r for r in gpu.ROWS if r["section"] == "B4"]
    assert row["blocks"] == gpu.B4_BLOCKS and row["bytes"] == gpu.B4_BLOCKS * 4 * (8 << 10)
    # every run wrote exactly these (it raises otherwise)
    assert row["files"] == {1: gpu.B4_BLOCKS, 16: gpu.B4_BLOCKS // 16}
    assert all(row[k] > 0 for k in ("store_gbps_16", "store_gbps_256", "load_gbps_16",
                                     "load_gbps_256"))
    assert not list(tmp_path.rglob("*.kvb"))
    assert "B4 16-token files against 256-token files" in capsys.readouterr().out


def test_gpu_bench_b5_times_steps_with_and_without_offload_on_cpu(monkeypatch, tmp_path,
                                                                   capsys):
    """B5's dry run: alternating phases of the stand-in step, the offload phases polling,
    storing 256-token files and loading the warm ones every other step; every offload job
    succeeds, the rounds' files are removed, the report's goal line is written."""
    import json

    gpu = _cpu_bench(monkeypatch)
    monkeypatch.setattr(gpu, "STEP_MATRIX", (256, 512))
    rows_file = tmp_path / "rows.json"
    monkeypatch.setenv("KVTIER_BENCH_GPU_ROWS", str(rows_file))
    gpu.step_interference(str(tmp_path), "disk", device="cpu")
    (row,) = [r for r in gpu.ROWS if r["section"] == "B5"]
    assert row["steps"] == gpu.STEP_ROUNDS * gpu.STEPS
    assert row["step_p99_ms"] > 0 and row["offload_p99_ms"] > 0
    stores = gpu.STEP_ROUNDS * gpu.STEPS
    assert row["jobs"] == stores + stores // 2 == row["jobs_ok"]
    assert len(list(tmp_path.rglob("*.kvb"))) == 4, "only the warm files stay"
    assert "B5 engine step with and without offload" in capsys.readouterr().out
    assert json.loads(rows_file.read_text())[-1]["section"] == "B5"  # kept as it came
    from scripts.gpu_check import against_goals

    (line,) = [g for g in against_goals(gpu.ROWS) if "engine step p99" in g]
    assert f"{row['p99_ratio']:.3f}x" in line
