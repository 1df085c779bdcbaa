"""Admission webhooks over HTTPS: inject selected model-server pods, validate
TieredPrefixCaches.

Thin on purpose: read the request, hand its body to an admission lane (admission_lanes:
never on the event loop, bounded per lane and per request), answer. The review logic is in
admission, the caches it reads in cache_registry, the conflicts it records in conflict_log.

Every answer is JSON. Malformed reviews get a 400, oversized ones a 413, a full lane or an
admission past its deadline a 503, and anything unforeseen a 500 whose body says to look in
the operator log; never a traceback. The pod webhook runs with failurePolicy Ignore, so a
pod it cannot understand is answered "allowed, unchanged" and reported.

Slow clients are bounded too: a request (headers and body) must arrive within
REQUEST_READ_TIMEOUT of its first byte, a connection with no request in progress is closed
after IDLE_TIMEOUT, and a TLS handshake must finish within TLS_HANDSHAKE_TIMEOUT. A client
that goes away, or is closed for being slow, is logged once, at INFO, without a traceback.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web

from kvtier_operator.admission import (
    MUTATE_PATH,
    VALIDATE_PATH,
    BadReview,
    diff_patch,
    mutate_pod,
    selectors_may_overlap,
    validate_tpc,
)
from kvtier_operator.admission_lanes import AdmissionLanes
from kvtier_operator.body_budget import BodyBudget, BodyClaim, BudgetLimits
from kvtier_operator.cache_registry import CacheRegistry
from kvtier_operator.conflict_log import ConflictLog
from kvtier_operator.context import RenderContext

__all__ = ["MUTATE_PATH", "VALIDATE_PATH", "BadReview", "CacheRegistry", "ConflictLog",
           "diff_patch", "make_app", "mutate_pod", "register_server", "selectors_may_overlap",
           "serve", "tls_context", "validate_tpc", "watch_certificates"]

log = logging.getLogger("kvtier_operator.webhook")
MAX_BODY = 3 * 1024 * 1024  # the API server's own request limit for admission objects
# Request bodies held at once, over all connections (being read or being admitted), so
# many slow senders cannot grow the process (the chart's memory limit is 512Mi): charged
# for bytes received, capped per peer, with a reserve for small bodies and a read deadline
# in proportion to the body's size (body_budget.py). Past it the answer is 503.
BODY_LIMITS = BudgetLimits()
REQUEST_READ_TIMEOUT = 10.0  # seconds from a request's first byte to its last
IDLE_TIMEOUT = 60.0  # seconds a connection may wait, with no request in progress
TLS_HANDSHAKE_TIMEOUT = 10.0

# ------------------------------------------------------------------ server


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


async def watch_certificates(ctx: ssl.SSLContext, certfile: str, keyfile: str,
                             interval: float = 10.0) -> None:
    """Reload a rotated certificate into the live context: new handshakes use it.
    Rotation is told by the files' content (a digest, as kopf does), not their mtimes:
    a copy that keeps mtimes still rotates, a touch alone does not reload."""

    def stamp() -> bytes:
        digest = hashlib.sha256()
        for path in (certfile, keyfile):
            with open(path, "rb") as file:
                digest.update(hashlib.sha256(file.read()).digest())
        return digest.digest()

    last = stamp()
    while True:
        await asyncio.sleep(interval)
        try:
            now = stamp()
            if now != last:
                ctx.load_cert_chain(certfile, keyfile)
                last = now
                log.info("reloaded the webhook certificate from %s", certfile)
        except (OSError, ssl.SSLError) as err:
            log.warning("cannot reload the webhook certificate yet: %s", err)


class _Deadlines(asyncio.Protocol):
    """aiohttp's protocol for one connection, wrapped to enforce the read deadlines.

    idle (waiting for a request) --first byte--> reading (REQUEST_READ_TIMEOUT from that
    byte) --request_read()--> busy (no deadline: the admission lane bounds it)
    --request_done()--> idle (IDLE_TIMEOUT)."""

    def __init__(self, inner: asyncio.Protocol, watched: dict[Any, _Deadlines],
                 read_timeout: float, idle_timeout: float) -> None:
        self._inner, self._watched = inner, watched
        self._read_timeout, self._idle_timeout = read_timeout, idle_timeout
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.state = "idle"
        self.expired = False

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._transport is None or self._transport.is_closing():
            return
        self.expired = True
        peer = self._transport.get_extra_info("peername")
        if self.state == "reading":
            log.info("closed the connection from %s: no complete request within %g s",
                     peer, self._read_timeout)
            self._transport.abort()
        else:
            log.debug("closed the connection from %s: idle for %g s", peer, self._idle_timeout)
            self._transport.close()

    def request_read(self) -> None:
        self.state = "busy"
        self._disarm()

    def request_done(self) -> None:
        self.state = "idle"
        self._arm(self._idle_timeout)

    # asyncio.Protocol, forwarded to aiohttp's
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport has abort(); uvloop's TCPTransport is no
        # asyncio.Transport subclass (so no isinstance check) but has the same methods.
        self._transport = cast(asyncio.Transport, transport)
        self._watched[transport] = self
        self._arm(self._idle_timeout)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.state == "idle":
            self.state = "reading"
            self._arm(self._read_timeout)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._watched.pop(self._transport, None)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


_WATCHED = web.AppKey("kvtier_deadlines", dict)
MAX_FAILURES_REMEMBERED = 100  # distinct failure sites whose traceback was logged


class _FailureLog:
    """A failed admission's traceback goes to the log once per place it failed (its
    stack); later failures there are one line at DEBUG, so a client cannot flood the
    log by repeating a request."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def report(self, path: str, problem: str) -> None:
        lines = problem.rstrip().splitlines()
        site = "\n".join(line for line in lines if line.lstrip().startswith("File "))
        site += "\n" + (lines[-1].split(":", 1)[0] if lines else "")
        if site in self._seen:
            log.debug("admission to %s failed again at a known place: %s", path,
                      lines[-1][:200] if lines else "")
            return
        if len(self._seen) < MAX_FAILURES_REMEMBERED:
            self._seen.add(site)
        log.error("admission to %s failed (answered without a change or denied; further "
                  "failures at this place are logged at DEBUG):\n%s", path, problem)


def _deadlines(request: web.Request) -> _Deadlines | None:
    return request.app[_WATCHED].get(request.transport)


@web.middleware
async def _every_answer_is_json(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                ) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response({"error": exc.reason}, status=exc.status, headers=headers)
    except Exception:  # a bug of ours: its traceback goes to the log, not to the client
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return web.json_response({"error": "internal error; see the kvtier operator log"},
                                 status=500)
    finally:
        deadlines = _deadlines(request)
        if deadlines is not None:
            deadlines.request_done()


def path_of(request: web.Request) -> str:
    return request.path[:100]


def make_app(caches: CacheRegistry, conflicts: ConflictLog, ctx: RenderContext,
             lanes: AdmissionLanes | None = None) -> web.Application:
    lanes = lanes or AdmissionLanes()

    budget = BodyBudget(BODY_LIMITS)
    failures = _FailureLog()

    async def review(request: web.Request, path: str) -> web.Response:
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return web.json_response({"error": f"Content-Encoding {encoding[:40]!r} is not "
                                      "accepted: send the review uncompressed"}, status=415)
        size = request.content_length if request.content_length is not None else MAX_BODY
        if size > MAX_BODY:
            return web.json_response({"error": f"body over {MAX_BODY} bytes"}, status=413)
        claim = budget.claim(request.remote or "", size)
        try:
            return await _review(request, path, claim, budget.body_deadline(size))
        finally:
            claim.release()

    async def _read_body(request: web.Request, claim: BodyClaim,
                         deadline: float) -> bytes | web.Response:
        """The body, charged to `claim` as it arrives; or the answer refusing it."""
        chunks: list[bytes] = []
        got = 0
        try:
            async with asyncio.timeout(deadline):
                while chunk := await request.content.readany():
                    got += len(chunk)
                    if got > MAX_BODY:
                        refusal = web.json_response({"error": f"body over {MAX_BODY} bytes"},
                                                    status=413)
                        break
                    if not claim.charge(len(chunk)):
                        refusal = web.json_response(
                            {"error": "the kvtier webhook is busy (request bodies in "
                             "progress); retry later"}, status=503)
                        break
                    chunks.append(chunk)
                else:
                    return b"".join(chunks)
        except TimeoutError:
            log.info("closed the connection from %s: its %s body did not arrive within "
                     "%.1f s", request.remote, path_of(request), deadline)
            refusal = web.json_response({"error": f"the body did not arrive within "
                                         f"{deadline:.1f} s"}, status=408)
        refusal.force_close()  # the rest of the body is not read
        return refusal

    async def _review(request: web.Request, path: str, claim: BodyClaim,
                      deadline: float) -> web.Response:
        started = time.perf_counter()
        try:
            body = await _read_body(request, claim, deadline)
        except ConnectionError:
            deadlines = _deadlines(request)
            if deadlines is None or not deadlines.expired:
                log.info("client %s went away before sending its whole request to %s",
                         request.remote, path)
            return web.json_response({"error": "incomplete request"}, status=400)
        if isinstance(body, web.Response):
            return body
        deadlines = _deadlines(request)
        if deadlines is not None:
            deadlines.request_read()
        outcome = await lanes.admit(path, body, caches, ctx)
        # The log keeps one reason per pod: a pod left alone for several has them all.
        reasons: dict[tuple[str, str, str], list[str]] = {}
        for c in outcome.conflicts:
            reasons.setdefault((c.namespace, c.cache, c.pod), []).append(c.reason)
        for (namespace, cache, pod), why in reasons.items():
            conflicts.record(namespace, cache, pod, "; ".join(why))
        if outcome.problem:
            failures.report(path, outcome.problem)
        log.debug("%s answered %d in %.1f ms", path, outcome.status,
                  (time.perf_counter() - started) * 1e3)
        return web.Response(body=outcome.body, status=outcome.status,
                            content_type="application/json")

    async def mutate(request: web.Request) -> web.Response:
        return await review(request, MUTATE_PATH)

    async def validate(request: web.Request) -> web.Response:
        return await review(request, VALIDATE_PATH)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def close_lanes(_: web.Application) -> None:
        lanes.close()

    app = web.Application(client_max_size=MAX_BODY, middlewares=[_every_answer_is_json])
    app[_WATCHED] = {}
    app.on_cleanup.append(close_lanes)
    app.router.add_post(MUTATE_PATH, mutate)
    app.router.add_post(VALIDATE_PATH, validate)
    app.router.add_get("/healthz", healthz)
    return app


class _Site(web.BaseSite):
    """A TCP site like aiohttp's TCPSite, serving each connection through _Deadlines and
    bounding the TLS handshake."""

    __slots__ = ("_host", "_port", "_protocol")

    def __init__(self, runner: web.AppRunner, host: str, port: int,
                 tls: ssl.SSLContext | None, protocol: Callable[[], asyncio.Protocol]) -> None:
        super().__init__(runner, ssl_context=tls)
        self._host, self._port, self._protocol = host, port, protocol

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, ssl=self._ssl_context,
            ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT if self._ssl_context else None,
            backlog=self._backlog, reuse_address=True)


async def serve(app: web.Application, host: str, port: int,
                tls: ssl.SSLContext | None) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    server = runner.server
    assert server is not None
    watched = app.get(_WATCHED)
    if watched is None:  # an app not made by make_app: deadlines, but no one to tell them
        watched = {}
    read_timeout, idle_timeout = REQUEST_READ_TIMEOUT, IDLE_TIMEOUT
    await _Site(runner, host, port, tls,
                lambda: _Deadlines(server(), watched, read_timeout, idle_timeout)).start()
    return runner


def register_server(registry: Any, caches: CacheRegistry, conflicts: ConflictLog,
                    ctx: RenderContext, host: str, port: int, cert_dir: str) -> None:
    """Run the webhook server inside the operator process for its lifetime."""
    import kopf

    certfile, keyfile = os.path.join(cert_dir, "tls.crt"), os.path.join(cert_dir, "tls.key")

    @kopf.on.startup(registry=registry)
    async def start_webhook(memo: Any, **_: Any) -> None:
        tls = tls_context(certfile, keyfile)
        lanes = AdmissionLanes()
        memo.webhook = await serve(make_app(caches, conflicts, ctx, lanes), host, port, tls)
        memo.webhook_warm = asyncio.create_task(lanes.warm())
        memo.webhook_certs = asyncio.create_task(watch_certificates(tls, certfile, keyfile))
        log.info("admission webhooks listening on https://%s:%d", host, port)

    @kopf.on.cleanup(registry=registry)
    async def stop_webhook(memo: Any, **_: Any) -> None:
        for task in ("webhook_certs", "webhook_warm"):
            if memo.get(task) is not None:
                memo[task].cancel()
        if memo.get("webhook") is not None:
            await memo.webhook.cleanup()
