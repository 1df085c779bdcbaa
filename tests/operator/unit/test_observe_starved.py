"""A reading process that waited for the CPU (it runs SCHED_IDLE, after the webhook and
the handlers) must not blame the pods whose reads ran out of time meanwhile: those reads
are STARVED (the kernel's run_delay of the reading thread grew during the read), the
cache's MetricsReadable says ObservationStarved with the operator-side fix, and a read
that runs out of time without that wait still names the pod (#32 reviews)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe import reads
from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.observe.reads import (
    STARVED,
    ReadJob,
    ReadSettings,
    read_all,
)
from kvtier_operator.observe.scrape import DEADLINE_MISSED
from kvtier_operator.observe.window import WindowSum
from kvtier_operator.status import observed_tiers
from tests.operator.unit.test_metrics_late_reads import observed
from tests.operator.unit.test_observe_file_tiers import kvtier_tpc, offloaded
from tests.operator.unit.test_reconcile import NOW

TIMEOUT = 1.0
SETTINGS = ReadSettings(timeout=TIMEOUT, max_bytes=1 << 20, max_series=20_000, concurrency=2)


class _Silent(BaseHTTPRequestHandler):
    """A pod that never answers within the read's deadline; `arrived` runs as its request
    comes in (the read is then in flight)."""

    arrived: Callable[[], None] = staticmethod(lambda: None)

    def do_GET(self) -> None:
        self.arrived()
        time.sleep(3 * TIMEOUT)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def silent() -> Iterator[tuple[ReadJob, type[_Silent]]]:
    handler = type("Silent", (_Silent,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    launcher = adapter_for(kvtier_tpc().spec).launcher
    try:
        yield ReadJob("ml", "p", f"http://127.0.0.1:{server.server_address[1]}/metrics",
                      None, launcher, offloaded(kvtier_tpc())), handler
    finally:
        server.shutdown()


@pytest.mark.parametrize("waited,starved", [(2.0, True), (0.1, False), (None, False)],
                         ids=["waited-for-the-cpu", "ran-but-the-pod-was-silent",
                              "no-schedstat"])
def test_a_read_that_ran_out_of_time_is_starved_only_where_the_reader_waited_for_the_cpu(
        silent, monkeypatch, waited, starved):
    job, handler = silent
    wait: dict[str, float | None] = {"now": 0.0 if waited is not None else None}
    monkeypatch.setattr(reads, "cpu_wait_seconds", lambda: wait["now"])
    handler.arrived = staticmethod(lambda: wait.update(now=waited))
    (result,) = asyncio.run(read_all([job], SETTINGS))
    if starved:
        assert result.problem == STARVED
    else:
        assert result.problem is not None and DEADLINE_MISSED in result.problem


def _metrics(obs: CacheObservation):
    tpc = kvtier_tpc()
    return observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True).metrics


def test_the_observer_counts_starved_pods_and_status_names_the_operator_s_cpu():
    obs = observed(STARVED, STARVED)
    assert (obs.pods_unreadable, obs.pods_starved) == (2, 2)
    cond = _metrics(obs)
    assert (cond.status, cond.reason) == ("Unknown", "ObservationStarved")
    assert "resources.requests.cpu" in cond.message and "metrics port" not in cond.message


def test_a_pod_that_gave_no_figures_is_still_named_beside_starved_ones():
    obs = CacheObservation(window=WindowSum(), pods_read=1, pods_unreadable=2,
                           problems=["pod q: connection refused", f"pod p: {STARVED}"],
                           observed_at=NOW, reads=True, pods_selected=3, pods_starved=1)
    cond = _metrics(obs)
    assert (cond.status, cond.reason) == ("False", "MetricsUnreadable")
    assert "1 of 3 pod(s) gave no figures (pod q: connection refused)" in cond.message
    assert "waited for the CPU" in cond.message
