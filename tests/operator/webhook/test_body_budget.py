"""The webhook's body budget cannot be held hostage (audit v2, N1): bytes are charged as
they arrive, one peer holds at most its share, small bodies keep a reserve, and a body
must arrive within a deadline in proportion to its size. The siege test holds the budget
with real connections, reconnecting as the server closes them, while honest pods keep
being admitted and injected."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvtier_operator import webhook
from kvtier_operator.body_budget import MIB, BodyBudget, BudgetLimits
from kvtier_operator.webhook import MUTATE_PATH
from tests.operator.webhook.test_hostile import start
from tests.operator.webhook.test_webhook import load_example, minimal_pod, review

LIMITS = BudgetLimits(total=10 * MIB, reserve=2 * MIB, small_body=64 * 1024,
                      per_peer=3 * MIB, per_peer_reserve=512 * 1024)


def test_a_declared_length_costs_nothing_until_its_bytes_arrive():
    budget = BodyBudget(LIMITS)
    claims = [budget.claim(f"10.0.0.{i}", 3 * MIB) for i in range(100)]
    assert budget.shared_free == 8 * MIB and budget.reserve_free == 2 * MIB
    assert claims[0].charge(1000) and budget.held_by("10.0.0.0") == 1000
    for claim in claims:
        claim.release()
    assert budget.shared_free == 8 * MIB and budget.held_by("10.0.0.0") == 0


def test_one_peer_holds_at_most_its_share():
    budget = BodyBudget(LIMITS)
    a, b = budget.claim("10.0.0.1", 3 * MIB), budget.claim("10.0.0.1", 3 * MIB)
    assert a.charge(2 * MIB)
    assert not b.charge(2 * MIB), "one peer went past per_peer"
    assert budget.claim("10.0.0.2", 3 * MIB).charge(2 * MIB), "another peer was refused"
    a.release()
    assert b.charge(2 * MIB)


def test_small_bodies_keep_a_reserve_large_ones_cannot_touch():
    budget = BodyBudget(LIMITS)
    for i in range(3):  # three peers fill the shared pool
        assert budget.claim(f"10.0.0.{i}", 3 * MIB).charge(min(3 * MIB, budget.shared_free))
    assert budget.shared_free == 0
    assert not budget.claim("10.0.1.1", 3 * MIB).charge(1), "a large body used the reserve"
    small = budget.claim("10.0.1.1", 4096)
    assert small.charge(4096), "a small body found no room"
    # one peer cannot take the whole reserve with small bodies either
    flood = [budget.claim("10.0.2.1", 60 * 1024) for _ in range(20)]
    held = sum(c.charge(60 * 1024) for c in flood)
    assert held * 60 * 1024 <= LIMITS.per_peer_reserve
    assert budget.claim("10.0.1.2", 4096).charge(4096), "the reserve was taken by one peer"
    small.release()
    assert budget.reserve_free == 2 * MIB - held * 60 * 1024 - 4096


def test_the_read_deadline_grows_with_the_body():
    budget = BodyBudget(BudgetLimits(deadline_base=2.0, deadline_rate=MIB))
    assert budget.body_deadline(4096) == pytest.approx(2.0, abs=0.01)
    assert budget.body_deadline(3 * MIB) == pytest.approx(5.0)


# ------------------------------------------------------------------ the siege, live

# Five source addresses, one peer each: fewer than reserve / per_peer_reserve (8), the
# number it would take to drain the reserve (docs/security.md says so).
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 7)]
SIEGE_S = 15.0  # with these deadlines, each hog reconnects ~20 times: minutes at 10 s


async def _hog(port, ssl_ctx, source, declared, send, stop, stats):
    """Hold one request open: declare `declared` bytes, send `send` of them, then stall
    until the server closes the connection; reconnect, until `stop`."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=ssl_ctx, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.05)
            continue
        stats["connections"] += 1
        head = (f"POST {MUTATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                f"\r\nContent-Length: {declared}\r\n\r\n").encode()
        try:
            writer.write(head + b"{" + b" " * max(send - 1, 0))
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(200), SIEGE_S)
            stats["answers"] += 1
            if b" 503 " in answer[:20]:
                stats["refused"] += 1
        except (TimeoutError, OSError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.slow
async def test_honest_pods_are_injected_while_the_budget_is_under_siege(tmp_path, monkeypatch):
    # Short deadlines compress time: a hog is cut after ~0.6 s instead of up to 10 s.
    monkeypatch.setattr(webhook, "BODY_LIMITS", BudgetLimits(
        total=10 * MIB, reserve=2 * MIB, per_peer=3 * MIB, per_peer_reserve=256 * 1024,
        deadline_base=0.5, deadline_rate=30 * MIB))
    monkeypatch.setattr(webhook, "REQUEST_READ_TIMEOUT", 1.0)
    runner, hook = await start(tmp_path)
    hook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
    port = int(hook.url.rsplit(":", 1)[1])
    stop = asyncio.Event()
    stats = {"connections": 0, "answers": 0, "refused": 0}
    hogs = []
    for source in ATTACKERS:
        # the audit's attack (header only, 3 MiB and pod-sized declared, filling what a
        # declared length reserves to the last byte), bodies sent and held, and small
        # bodies held open to drain the reserve
        hogs += [_hog(port, hook.client_ssl, source, 3 * MIB, 0, stop, stats)
                 for _ in range(2)]
        hogs += [_hog(port, hook.client_ssl, source, 300, 0, stop, stats) for _ in range(6)]
        hogs += [_hog(port, hook.client_ssl, source, 3 * MIB, int(2.9 * MIB), stop, stats)]
        hogs += [_hog(port, hook.client_ssl, source, 60 * 1024, 60 * 1024 - 10, stop, stats)
                 for _ in range(6)]
    tasks = [asyncio.create_task(h) for h in hogs]
    honest, failures, latencies = 0, [], []
    try:
        await asyncio.sleep(1.0)  # let the siege take hold
        end = time.monotonic() + SIEGE_S
        while time.monotonic() < end:
            pod = minimal_pod()
            pod["metadata"]["name"] = f"decode-{honest}"
            started = time.perf_counter()
            status, answer = await hook.post(MUTATE_PATH, review(pod, uid=f"u-{honest}"))
            latencies.append(time.perf_counter() - started)
            honest += 1
            if status != 200 or "patch" not in answer.get("response", {}):
                failures.append((status, json.dumps(answer)[:200]))
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()
    assert stats["connections"] >= 5 * len(hogs), stats  # they really kept reconnecting
    assert stats["refused"] > 0, stats  # and really hit the budget
    # The hogs and the honest client share this process's event loop with the server, so
    # the count and the latency measure this machine as much as the webhook.
    latencies.sort()
    assert honest >= 5 and not failures, (honest, failures[:3], stats, latencies[-3:])
    assert latencies[-1] < 4.0, latencies[-3:]  # under the API server's 5 s timeout
