"""The backend's metrics in prometheus-client's multiprocess mode (vLLM's worker processes
without a CPU tier, PROMETHEUS_MULTIPROC_DIR; the end-to-end check is
tests/e2e/test_observe.py): each gauge says how processes combine, and a process that
exits takes its live gauges with it."""

from __future__ import annotations

import os

import pytest

from kvtier_offload import metrics

pytest.importorskip("prometheus_client")


def test_every_gauge_says_how_processes_combine():
    gauges = [d for d in metrics.DEFINITIONS.values() if d.kind == "Gauge"]
    assert gauges
    for d in gauges:
        # prometheus-client's default ("all") would add a pid label per process
        assert d.multiprocess_mode in {"livesum", "max", "min", "sum", "liveall",
                                       "livemax", "livemin"}, d.name
    assert metrics.DEFINITIONS["kvtier_offload_queue_depth"].multiprocess_mode == "livesum"


def test_a_process_that_exits_removes_its_live_gauges(tmp_path, monkeypatch):
    hooks = []
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics.atexit, "register", hooks.append)
    monkeypatch.setattr(metrics, "_FORGET_REGISTERED", set())
    mine, other = tmp_path / f"gauge_livesum_{os.getpid()}.db", tmp_path / "gauge_livesum_1.db"
    counter = tmp_path / f"counter_{os.getpid()}.db"
    for path in (mine, other, counter):
        path.write_bytes(b"")
    with metrics._LOCK:
        metrics._forget_at_exit()
        metrics._forget_at_exit()  # once per process
    assert len(hooks) == 1
    hooks[0]()
    # its live gauges go; counters stay (they sum past the process), others' files stay
    assert not mine.exists() and other.exists() and counter.exists()


def test_nothing_is_registered_outside_multiprocess_mode(monkeypatch):
    hooks = []
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(metrics.atexit, "register", hooks.append)
    monkeypatch.setattr(metrics, "_FORGET_REGISTERED", set())
    with metrics._LOCK:
        metrics._forget_at_exit()
    assert hooks == []
