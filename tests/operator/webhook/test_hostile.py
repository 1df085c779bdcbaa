"""The webhook under hostile input: every answer is clean JSON, memory stays bounded, slow
clients are closed, and one slow admission does not hold up the others."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import multiprocessing
import ssl
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from kvtier_demo.certs import make_certs
from kvtier_operator import admission, webhook
from kvtier_operator.admission_lanes import AdmissionLanes, LaneLimits
from kvtier_operator.render.pod import inject as real_inject
from kvtier_operator.webhook import (
    MUTATE_PATH,
    VALIDATE_PATH,
    CacheRegistry,
    ConflictLog,
    make_app,
    mutate_pod,
    serve,
    tls_context,
)
from tests.helpers import tpc_doc
from tests.operator.webhook.test_webhook import (
    CTX,
    Webhook,
    free_port,
    load_example,
    minimal_pod,
    review,
)


async def start(tmp_path, lanes=None):
    ca = make_certs(tmp_path / "certs")
    caches, conflicts = CacheRegistry(), ConflictLog()
    port = free_port()
    tls = tls_context(str(tmp_path / "certs" / "tls.crt"), str(tmp_path / "certs" / "tls.key"))
    app = make_app(caches, conflicts, CTX, lanes) if lanes else make_app(caches, conflicts, CTX)
    runner = await serve(app, "127.0.0.1", port, tls)
    return runner, Webhook(caches, conflicts, f"https://127.0.0.1:{port}", ca,
                           tmp_path / "certs")


@pytest.fixture
async def hook(tmp_path):
    runner, hook = await start(tmp_path)
    yield hook
    await runner.cleanup()


def strict_json(text):
    """json.loads that refuses NaN and Infinity, as every JSON parser but Python's does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


REVIEW_HEAD = '{"kind":"AdmissionReview","request":{"uid":"u","operation":"CREATE",'


@pytest.mark.parametrize("body", [
    "[" * 50000 + "]" * 50000,
    '{"a":' * 5000 + "1" + "}" * 5000,
    REVIEW_HEAD + '"object":{"metadata":{"annotations":' + "[" * 990 + "]" * 990 + "}}}}",
    '{"kind":"AdmissionReview","request":{"uid":NaN,"operation":"DELETE"}}',
    '{"kind":"AdmissionReview","request":{"uid":Infinity,"operation":"DELETE"}}',
    REVIEW_HEAD + '"object":{"spec":{"priority":1e400}}}}',
    '{"kind":"AdmissionReview","request":{"uid":["u"],"operation":"DELETE"}}',
    REVIEW_HEAD + '"object":{"metadata":{"labels":' + '{"a":' * 150 + "1" + "}" * 150 + "}}}}",
], ids=["deep-array", "deep-object", "deep-annotation", "nan-uid", "infinity-uid",
        "infinite-number", "list-uid", "deep-150"])
async def test_malformed_json_gets_a_clean_400(tmp_path, body):
    # Served as the operator serves it: a body past small_body goes to the bulk lane's
    # worker process, which the operator starts with the webhook (register_server warms
    # it). Started cold by the first request instead, its spawn and imports at its lower
    # priority took over the 4 s admission deadline beside two CPU hogs (a 503), while
    # rejecting the 50,000-deep array takes json.loads 0.2 ms.
    lanes = AdmissionLanes()
    if len(body) > lanes.limits.small_body:
        await lanes.warm()
    runner, hook = await start(tmp_path, lanes)
    try:
        await answers_are_clean_400s(hook, body)
    finally:
        await runner.cleanup()


async def answers_are_clean_400s(hook, body):
    for path in (MUTATE_PATH, VALIDATE_PATH):
        status, text = await hook.post(path, data=body.encode())
        answer = strict_json(text) if isinstance(text, str) else text
        assert status == 400, (path, status, text)
        assert "error" in answer and "Traceback" not in json.dumps(answer)


async def test_nesting_bound_holds_when_the_recursion_limit_is_raised(hook):
    # cel-python raises the interpreter's recursion limit to 2500 on import: the bound on
    # nesting must not depend on it.
    body = REVIEW_HEAD + '"object":{"metadata":{"annotations":' + "[" * 990 + "]" * 990
    body += "}}}}"
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        status, _ = await hook.post(MUTATE_PATH, data=body.encode())
    finally:
        sys.setrecursionlimit(old)
    assert status == 400


@pytest.mark.parametrize("metadata", ["x", [1], 3])
async def test_non_object_metadata_is_denied_or_left_alone_not_a_500(hook, metadata):
    doc = tpc_doc(name="x", namespace="llm-d")
    doc["metadata"] = metadata
    status, answer = await hook.post(VALIDATE_PATH, review(doc))
    assert status == 200, answer
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["code"] == 400
    assert "metadata" in answer["response"]["status"]["message"]
    hook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
    pod = minimal_pod()
    pod["metadata"] = metadata
    status, answer = await hook.post(MUTATE_PATH, review(pod))
    assert status == 200 and answer["response"] == {"uid": "u-1", "allowed": True}


async def test_a_cache_the_models_cannot_take_is_denied_cleanly(hook):
    doc = tpc_doc({"cpu": {"size": "Infinity"}}, name="x", namespace="llm-d")
    status, answer = await hook.post(VALIDATE_PATH, review(doc))
    assert status == 200, answer
    assert answer["response"]["allowed"] is False
    assert "Traceback" not in answer["response"]["status"]["message"]


def test_the_conflict_log_stays_bounded_under_a_flood_of_conflicting_pods():
    caches, conflicts = CacheRegistry(), ConflictLog()
    doc = load_example("native-kvtier.yaml")
    doc["spec"]["containerName"] = "vllm"  # no such container: every pod conflicts
    caches.observe("ADDED", doc)
    names = []
    for i in range(250):
        pod = minimal_pod()
        pod["metadata"]["name"] = f"flood-{i}"
        pod["spec"]["containers"][0]["name"] = f"c{i}-" + "x" * 20_000
        names.append(pod["metadata"]["name"])
        mutate_pod(review(pod, uid=f"u{i}"), caches, conflicts, CTX)
    kept = conflicts.for_cache("llm-d", "qwen3-tiered", names)
    assert 0 < len(kept) <= 100
    assert "flood-249" in kept and "flood-0" not in kept  # the newest are kept
    assert all(len(why) <= 1000 for why in kept.values())
    # and overall, across caches: 40 caches x 100 pods with 2 kB reasons
    for c in range(40):
        for i in range(100):
            conflicts.record("ns", f"cache-{c}", f"pod-{i}", "why " * 500)
    total = [conflicts.for_cache("ns", f"cache-{c}", [f"pod-{i}" for i in range(100)])
             for c in range(40)]
    assert sum(map(len, total)) <= 2000
    assert sum(len(p) + len(w) for kept in total for p, w in kept.items()) <= 2000 * 1300
    assert total[-1] and not total[0]  # the newest caches' entries are the ones kept


async def tls_stream(hook):
    port = int(hook.url.rsplit(":", 1)[1])
    return await asyncio.open_connection("127.0.0.1", port, ssl=hook.client_ssl)


async def closed_by_server(reader, trickle, within):
    """Trickle bytes until the server closes the connection; False if it never does."""
    async def wait():
        while True:
            try:
                trickle()
                if await asyncio.wait_for(reader.read(1024), 0.05) == b"":
                    return True
            except TimeoutError:
                continue
            except (ConnectionError, ssl.SSLError):
                return True
    try:
        return await asyncio.wait_for(wait(), within)
    except TimeoutError:
        return False


@pytest.mark.parametrize("phase", ["headers", "body"])
async def test_a_trickling_client_is_disconnected_after_the_read_timeout(tmp_path, monkeypatch,
                                                                         phase):
    monkeypatch.setattr(webhook, "REQUEST_READ_TIMEOUT", 0.3, raising=False)
    runner, hook = await start(tmp_path)
    try:
        reader, writer = await tls_stream(hook)
        head, drip = f"POST {MUTATE_PATH} HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"
        if phase == "body":
            drip = b" "
            head += "1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
        writer.write(head.encode())
        started = time.monotonic()
        assert await closed_by_server(reader, lambda: writer.write(drip), within=5)
        assert time.monotonic() - started >= 0.25
        writer.close()
        # a well-behaved client is still served
        status, _ = await hook.post(MUTATE_PATH, review(minimal_pod()))
        assert status == 200
    finally:
        await runner.cleanup()


async def test_a_client_that_goes_away_is_logged_once_without_a_traceback(hook, caplog):
    caplog.set_level(logging.DEBUG)
    _, writer = await tls_stream(hook)
    writer.write(f"POST {MUTATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 1000\r\n\r\n{\"kind\": ".encode())
    await writer.drain()
    await asyncio.sleep(0)
    writer.transport.abort()

    def about_it():
        return [r for r in caplog.records
                if r.name.startswith(("aiohttp", "kvtier_operator.webhook"))
                and r.levelno >= logging.INFO]
    deadline = time.monotonic() + 5
    while not about_it() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    records = about_it()
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.INFO and records[0].exc_info is None
    assert "went away" in records[0].getMessage()


class Spin:
    """inject, made to spin the CPU for pods named slow* (holding the GIL as Python code
    does) from `started.set()` until the test sets `release` (at most SPIN_LIMIT s).
    The events are multiprocessing ones when the spin runs in a forked worker process."""

    SPIN_LIMIT = 5.0

    def __init__(self, events=threading):
        self.started, self.release = events.Event(), events.Event()

    def __call__(self, tpc, pod, ctx):
        if pod["metadata"]["name"].startswith("slow"):
            self.started.set()
            end = time.perf_counter() + self.SPIN_LIMIT
            while not self.release.is_set() and time.perf_counter() < end:
                pass
        return real_inject(tpc, pod, ctx)

    async def until_started(self):
        deadline = time.monotonic() + 10
        while not self.started.is_set():
            assert time.monotonic() < deadline, "the slow admission never started"
            await asyncio.sleep(0.005)


async def timed_post(hook, path, payload):
    start = time.perf_counter()
    status, answer = await hook.post(path, payload)
    return status, answer, time.perf_counter() - start


async def test_a_slow_admission_does_not_hold_up_a_concurrent_one(hook, monkeypatch):
    spin = Spin()
    monkeypatch.setattr(admission, "inject", spin)
    hook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
    slow_pod = minimal_pod()
    slow_pod["metadata"]["name"] = "slow-0"
    slow = asyncio.create_task(timed_post(hook, MUTATE_PATH, review(slow_pod)))
    try:
        await spin.until_started()
        status, answer, took = await timed_post(hook, MUTATE_PATH,
                                                review(minimal_pod(), uid="u-2"))
        assert status == 200 and "patch" in answer["response"]
        assert not slow.done(), "the valid admission was answered only after the slow one"
        assert took < 2.0, f"a valid admission waited {took:.2f} s behind a slow one"
    finally:
        spin.release.set()
    status, answer, _ = await slow
    assert status == 200 and "patch" in answer["response"]


async def test_a_full_lane_and_an_admission_past_its_deadline_answer_503(tmp_path, monkeypatch):
    spin = Spin()
    monkeypatch.setattr(admission, "inject", spin)
    lanes = AdmissionLanes(LaneLimits(quick_workers=1, quick_pending=1, deadline=0.3))
    runner, hook = await start(tmp_path, lanes)
    try:
        hook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
        slow_pod = minimal_pod()
        slow_pod["metadata"]["name"] = "slow-0"
        slow = asyncio.create_task(timed_post(hook, MUTATE_PATH, review(slow_pod)))
        await spin.until_started()
        status, answer, _ = await timed_post(hook, MUTATE_PATH, review(minimal_pod()))
        assert status == 503 and "busy" in answer["error"]
        status, answer, _ = await slow  # while it still spins: answered at its deadline
        assert status == 503 and "took over 0.3 s" in answer["error"]
        assert lanes.quick.in_flight == 1  # its slot is held until the work really ends
        spin.release.set()
        deadline = time.monotonic() + 5
        while lanes.quick.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        status, answer, _ = await timed_post(hook, MUTATE_PATH, review(minimal_pod()))
        assert status == 200 and "patch" in answer["response"]
    finally:
        spin.release.set()
        await runner.cleanup()


def big_pod(name):
    pod = minimal_pod()
    pod["metadata"]["name"] = name
    pod["metadata"]["annotations"] = {"example.com/blob": "x" * 200_000}
    return pod


@pytest.mark.slow
async def test_large_bodies_are_admitted_in_a_worker_process(hook):
    """The real, spawned worker process: the answer is the one admit gives in this one."""
    hook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
    request = review(big_pod("decode-1"))
    expected = admission.admit(MUTATE_PATH, json.dumps(request).encode(), hook.caches, CTX)
    status, answer = await hook.post(MUTATE_PATH, request)
    assert status == 200 and "patch" in answer["response"]
    assert answer == json.loads(expected.body)


async def test_a_slow_large_admission_in_the_worker_process_holds_up_no_one(tmp_path,
                                                                           monkeypatch):
    spin = Spin(multiprocessing.get_context("fork"))
    monkeypatch.setattr(admission, "inject", spin)
    lanes = AdmissionLanes(bulk_pool=lambda n: ProcessPoolExecutor(
        n, mp_context=multiprocessing.get_context("fork")))  # fork: the child sees the patch
    runner, hook = await start(tmp_path, lanes)
    try:
        hook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
        slow = asyncio.create_task(timed_post(hook, MUTATE_PATH, review(big_pod("slow-1"))))
        await spin.until_started()
        for uid in ("a", "b", "c"):
            status, answer, took = await timed_post(hook, MUTATE_PATH,
                                                    review(copy.deepcopy(minimal_pod()), uid=uid))
            assert status == 200 and "patch" in answer["response"]
            assert took < 2.0, f"a valid admission waited {took:.2f} s behind a slow one"
        assert not slow.done(), "the valid admissions were answered only after the slow one"
        spin.release.set()
        status, answer, _ = await slow
        assert status == 200 and "patch" in answer["response"]
    finally:
        spin.release.set()
        await runner.cleanup()


async def test_bodies_in_progress_are_bounded_in_bytes(tmp_path, monkeypatch):
    """Many senders of large, slow bodies cannot grow the process: the bytes each request
    has sent are charged as they arrive, and past the budget the answer is 503."""
    from kvtier_operator.body_budget import MIB, BudgetLimits

    monkeypatch.setattr(webhook, "BODY_LIMITS", BudgetLimits(
        total=4 * MIB, reserve=1 * MIB, per_peer=3 * MIB, per_peer_reserve=1 * MIB))
    runner, hook = await start(tmp_path)
    try:
        _, writer = await tls_stream(hook)
        writer.write(f"POST {MUTATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     "application/json\r\nContent-Length: 3000000\r\n\r\n".encode()
                     + b"{" + b" " * 2_500_000)
        await writer.drain()
        await asyncio.sleep(0.5)  # the server holds 2.5 MB of its 3 MB shared pool for it
        big = json.dumps({"pad": "x" * 2_000_000}).encode()
        status, text = await hook.post(MUTATE_PATH, data=big)
        assert status == 503 and "busy" in text["error"]
        status, _ = await hook.post(MUTATE_PATH, review(minimal_pod()))
        assert status == 200  # small reviews still fit
        writer.close()
    finally:
        await runner.cleanup()


async def test_compressed_bodies_are_refused_cleanly(hook):
    import gzip

    status, text = await hook.post(MUTATE_PATH, data=gzip.compress(b"{}") + b"corrupt",
                                   headers={"Content-Encoding": "gzip"})
    assert status == 415 and "uncompressed" in text["error"]
