"""The storage probe measures what vLLM will do (issue 25 part 4): rows of one
page-aligned array, one job per thread's share, the I/O path the store really used, and
vLLM's own fs tier side by side where vLLM is installed."""

from __future__ import annotations

import os

import pytest

from kvtier_offload import batchio
from kvtier_offload import volume_probe as probe
from kvtier_offload.buffers import RowArray
from kvtier_offload.cli import main
from kvtier_offload.store import BlockStore

SMALL = ["--block-bytes", str(64 << 10), "--total-bytes", str(1 << 20)]


@pytest.fixture(autouse=True)
def unpinned(request, monkeypatch):
    """Arenas in plain memory: asking for CUDA imports torch (seconds a worker); pinning
    has its own test (slow), and tests/offload/gpu runs the probe on a GPU."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setattr(probe, "cuda_available", lambda: False)


def test_blocks_go_as_one_job_per_threads_share_from_page_aligned_rows(tmp_path, monkeypatch):
    jobs: list[tuple[str, int, int]] = []
    for name in ("store_rows", "load_rows"):
        real = getattr(BlockStore, name)

        def spy(self, job_id, keys, rows, row_ids, real=real, name=name):
            jobs.append((name, len(keys), rows.ctypes.data % 4096))
            return real(self, job_id, keys, rows, row_ids)

        monkeypatch.setattr(BlockStore, name, spy)
    result = probe.probe(str(tmp_path), 64 << 10, 1 << 20, threads=4)
    assert result.failures == 0 and result.blocks == 16 and result.jobs == 4
    assert sorted(jobs) == sorted([("store_rows", 4, 0)] * 4 + [("load_rows", 4, 0)] * 4)
    assert os.listdir(tmp_path) == []


def test_the_arena_is_page_aligned_rows():
    arena = probe.Arena.make(64 << 10, 100, pin=False)
    assert arena.rows.shape == (probe.ARENA_ROWS, 64 << 10) and not arena.pinned
    assert arena.rows.ctypes.data % 4096 == 0 and arena.rows.strides[0] % 4096 == 0


@pytest.mark.slow  # imports torch (seconds), and so does asking it for CUDA
def test_rows_are_pinned_where_cuda_is_available():
    if not probe.cuda_available():
        pytest.skip("no CUDA here: rows cannot be pinned")
    import torch

    arena = probe.Arena.make(64 << 10, 4)
    assert arena.pinned and torch.from_numpy(arena.rows).is_pinned()


def test_the_path_reported_is_the_one_the_store_used(tmp_path, monkeypatch, capsys):
    assert main(["probe", "--path", str(tmp_path), *SMALL, "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert ("C batch path" if batchio.AVAILABLE else "Python path") in out
    # Without the extension the store moves every block on its Python path: so it says.
    monkeypatch.setattr(batchio, "AVAILABLE", False)
    assert main(["probe", "--path", str(tmp_path), *SMALL, "--threads", "2"]) == 0
    assert "Python path" in capsys.readouterr().out
    # Rows the batch path refuses under O_DIRECT (not 4 KiB aligned) go the Python way too.
    monkeypatch.setattr(batchio, "AVAILABLE", True)
    monkeypatch.setattr(RowArray, "batchable", lambda self, batch, direct, writes_into=True:
                        ([], []))
    result = probe.probe(str(tmp_path), 64 << 10, 1 << 20, threads=2)
    assert not result.batch_path


@pytest.mark.slow  # imports vLLM (seconds), and so does asking whether it is there
def test_vllm_runs_side_by_side_round_by_round(tmp_path, capsys):
    if not probe.vllm_available():
        pytest.skip("vLLM is not installed here")
    assert main(["probe", "--path", str(tmp_path), *SMALL, "--threads", "2", "--vllm",
                 "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "vLLM fs tier (O_DIRECT" in out and "kvtier/vLLM by round" in out
    assert out.count("x ") >= 2  # a store and a load ratio per round
    assert os.listdir(tmp_path) == []
    result = probe.probe(str(tmp_path), 64 << 10, 1 << 20, threads=2, compare_vllm=True,
                         rounds=3)
    assert len(result.vllm) == len(result.kvtier_rounds) == len(result.ratios()) == 3


def test_vllm_option_without_vllm_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(probe, "vllm_available", lambda: False)
    assert main(["probe", "--path", str(tmp_path), *SMALL, "--vllm"]) == 2
    assert "vLLM" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_block_size_o_direct_cannot_take_is_refused(tmp_path, capsys):
    assert main(["probe", "--path", str(tmp_path), "--block-bytes", "1000"]) == 2
    assert "--block-bytes" in capsys.readouterr().err


def test_the_store_benchmark_measures_through_the_probe(tmp_path, monkeypatch):
    from benchmarks import store as bench

    called = []
    real = probe.kvtier
    monkeypatch.setattr(probe, "kvtier", lambda *a, **k: called.append(a) or real(*a, **k))
    monkeypatch.setattr(bench, "drop_caches", lambda: None)
    arena = probe.Arena.make(64 << 10, 8, pin=False)
    store_gbps, load_gbps = bench.kvtier(str(tmp_path), 64 << 10, 8, arena)
    assert called and store_gbps > 0 and load_gbps > 0
