"""The operator's worker processes yield the CPU to the webhook and the handlers
(worker_process.init_worker): the observation's reading process runs SCHED_IDLE (the
kernel hands the CPU back the moment a normal task wakes; nice alone left admissions
1.24-1.82x slower at p99 with a round under way, benchmarks/observe.py); an admission
lane's worker takes nice only, since admissions must not wait behind a busy node; and
where the kernel or a seccomp profile refuses SCHED_IDLE the reader is niced and still
reads."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier_operator.admission_lanes import WORKER_NICENESS, spawn_pool
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.observe import reading_process
from kvtier_operator.observe.reading_process import NICENESS, ReadingProcess
from kvtier_operator.observe.reads import ReadJob, ReadSettings, read_round, unpack
from kvtier_operator.validation import parse_tpc
from kvtier_operator.worker_process import init_worker
from tests.helpers import ROOT
from tests.operator.unit.test_reconcile import body

PAGE = (ROOT / "tests" / "fixtures" / "metrics" / "vllm-0.32-gpu-direct-b-loaded.txt").read_bytes()
SETTINGS = ReadSettings(timeout=30.0, max_bytes=4 << 20, max_series=20_000, concurrency=2)


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def jobs() -> Iterator[list[ReadJob]]:
    """Three pods' jobs, their pages served by a local server: a captured vLLM page."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    launcher = adapter_for(parse_tpc(body({"cpu": None})).spec).launcher
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        yield [ReadJob("ml", f"p{i}", url, None, launcher, ("storage",)) for i in range(3)]
    finally:
        server.shutdown()


def _priority() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)


def assert_niced_not_idle(pool: ProcessPoolExecutor, niceness: int) -> None:
    """pool's worker runs the normal policy, `niceness` below this process."""
    try:
        policy, nice = pool.submit(_priority).result(60)
    finally:
        pool.shutdown()
    assert policy == os.SCHED_OTHER
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness)


def test_the_reading_process_runs_idle_policy_and_reads(jobs):
    reading = ReadingProcess()

    async def round_() -> list[bytes]:
        await reading.start()
        return await reading.read(jobs, SETTINGS)
    try:
        results = [unpack(r) for r in asyncio.run(round_())]
        assert reading.pid is not None
        assert os.sched_getscheduler(reading.pid) == os.SCHED_IDLE
    finally:
        reading.close()
    assert all(r.figures is not None for r in results), [r.problem for r in results]


def test_an_admission_worker_is_niced_but_not_idle():
    pool = spawn_pool(1)
    assert isinstance(pool, ProcessPoolExecutor)
    assert_niced_not_idle(pool, WORKER_NICENESS)


def _refused(*_args: object) -> None:
    raise PermissionError(1, "Operation not permitted")


def _init_refusing_idle(niceness: int) -> None:
    os.sched_setscheduler = _refused  # as a seccomp profile that refuses the call would
    init_worker(niceness, True)


def test_a_refused_idle_policy_leaves_the_reader_niced_and_reading(jobs):
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_refusing_idle, initargs=(NICENESS,))
    results = [unpack(r) for r in pool.submit(read_round, jobs, SETTINGS).result(60)]
    assert all(r.figures is not None for r in results), [r.problem for r in results]
    assert_niced_not_idle(pool, NICENESS)


def test_a_reader_that_could_not_run_idle_is_logged(caplog):
    caplog.set_level(logging.INFO, "kvtier_operator.observe")
    reading_process._log_priority(os.getpid(), idle=True)  # this process: not SCHED_IDLE
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "could not run SCHED_IDLE" in caplog.text
