"""Real kopf + the real official client + real HTTP, against kmock's in-process API server.

kmock has no schema validation, defaulting, SSA, label selectors, garbage collection or
controllers; tests/operator/unit covers those rules (owner references, field ownership) directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvtier_demo import sandbox
from kvtier_demo.sandbox import TPC, gateway_for, setup
from kvtier_operator.context import RenderContext

__all__ = ["CTX", "TPC", "condition", "gateway_for", "obj", "operator", "reconciles", "setup",
           "until"]

CTX = RenderContext(offload_image="reg/kvtier-offload:test", evictor_image="reg/kvtier:test")


def operator(kmock: Any, drift_interval: float = 3600.0, retry_delay: float = 0.2,
             namespaces: list[str] | None = None):
    return sandbox.operator(kmock, CTX, drift_interval=drift_interval, retry_delay=retry_delay,
                            namespaces=namespaces)


obj = sandbox.stored


async def until(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (KeyError, TypeError, IndexError):
            value = None
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check}")


def condition(body: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def _cache_writes(kmock: Any) -> int:
    return sum(1 for r in list(kmock._requests)
               if r.method.upper() == "PATCH" and "/tieredprefixcaches/" in str(r.url))


async def reconciles(kmock: Any, count: int = 3, timeout: float = 10.0) -> None:
    """Wait until the operator has written the caches' status count more times (each
    reconcile writes it once): a window in which something must not happen."""
    start = _cache_writes(kmock)
    await until(lambda: _cache_writes(kmock) >= start + count, timeout,
                f"{count} more reconciles")
