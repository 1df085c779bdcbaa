"""A reading process that waited for the CPU (it runs SCHED_IDLE, after the webhook and
the handlers) must not blame the pods whose reads ran out of time meanwhile: those reads
are STARVED, the cache's MetricsReadable says ObservationStarved with the operator-side
fix, and a read that runs out of time in a round without that wait still names the pod
(#32 review)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.observe.reads import STARVED, ReadJob, ReadResult, ReadSettings, read_all
from kvtier_operator.observe.scrape import DEADLINE_MISSED
from kvtier_operator.observe.window import WindowSum
from kvtier_operator.status import observed_tiers
from tests.operator.unit.test_metrics_late_reads import observed
from tests.operator.unit.test_observe_file_tiers import kvtier_tpc, offloaded
from tests.operator.unit.test_reconcile import NOW

TIMEOUT = 1.0
SETTINGS = ReadSettings(timeout=TIMEOUT, max_bytes=1 << 20, max_series=20_000, concurrency=2)


class _Silent(BaseHTTPRequestHandler):
    """A pod that never answers within the read's deadline."""

    def do_GET(self) -> None:
        time.sleep(3 * TIMEOUT)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def silent_job() -> Iterator[ReadJob]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    launcher = adapter_for(kvtier_tpc().spec).launcher
    try:
        yield ReadJob("ml", "p", f"http://127.0.0.1:{server.server_address[1]}/metrics",
                      None, launcher, offloaded(kvtier_tpc()))
    finally:
        server.shutdown()


async def _read(job: ReadJob, starve_for: float) -> ReadResult:
    if starve_for:  # the process gets no CPU for a while: its loop runs nothing
        asyncio.get_running_loop().call_later(0.1, time.sleep, starve_for)
    (result,) = await read_all([job], SETTINGS)
    return result


def test_a_read_that_ran_out_of_time_while_the_reader_waited_is_starved(silent_job):
    result = asyncio.run(_read(silent_job, starve_for=1.5 * TIMEOUT))
    assert result.problem == STARVED


def test_a_read_that_ran_out_of_time_in_a_round_without_that_wait_names_the_pod(silent_job):
    result = asyncio.run(_read(silent_job, starve_for=0.0))
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
