"""Admission webhooks: inject selected model-server pods, validate TieredPrefixCaches.

Thin on purpose: parse the AdmissionReview, call the pure renderer (`inject`) or the
models, answer. The pod webhook runs with failurePolicy Ignore, so it must never fail a
pod it cannot understand: anything unexpected is answered "allowed, unchanged" and
reported. Malformed reviews get a 400, oversized ones a 413, never a crash.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvtier_operator import KIND
from kvtier_operator.loading import InvalidResource, parse_tpc
from kvtier_operator.models import LabelSelector, TieredPrefixCache
from kvtier_operator.render import names
from kvtier_operator.render.context import RenderContext
from kvtier_operator.render.pod import inject

log = logging.getLogger("kvtier_operator.webhook")
MAX_BODY = 3 * 1024 * 1024  # the API server's own request limit for admission objects
MUTATE_PATH = "/mutate-pods"
VALIDATE_PATH = "/validate-tieredprefixcaches"


class CacheRegistry:
    """The TieredPrefixCaches the operator watches, by namespace (fed by watch events),
    parsed once per event rather than once per admission request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, dict[str, TieredPrefixCache]] = {}

    def observe(self, event_type: str, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        parsed = None
        if event_type != "DELETED" and not meta.get("deletionTimestamp"):
            try:
                parsed = parse_tpc(body)
            except InvalidResource:
                pass  # an invalid resource injects nothing; its status says why
        with self._lock:
            if parsed is None:
                self._caches.get(ns, {}).pop(name, None)
            else:
                self._caches.setdefault(ns, {})[name] = parsed

    def names(self) -> list[tuple[str, str]]:
        """(namespace, name) of every valid resource watched."""
        with self._lock:
            return sorted((ns, name) for ns, caches in self._caches.items() for name in caches)

    def in_namespace(self, namespace: str) -> list[TieredPrefixCache]:
        with self._lock:
            found = list(self._caches.get(namespace, {}).values())
        return sorted(found, key=lambda t: t.name)


@dataclass
class ConflictLog:
    """Pods the webhook left alone, by cache, for the reconciler's Injected condition."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _by_cache: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)

    def record(self, namespace: str, cache: str, pod: str, reason: str) -> None:
        with self._lock:
            self._by_cache.setdefault((namespace, cache), {})[pod] = reason

    def for_cache(self, namespace: str, cache: str, live_pods: Iterable[str]) -> dict[str, str]:
        """Conflicts (pod: reason) of pods that still exist (forgetting the rest)."""
        live = set(live_pods)
        with self._lock:
            entries = self._by_cache.get((namespace, cache), {})
            for gone in [p for p in entries if p not in live]:
                del entries[gone]
            return dict(sorted(entries.items()))


def _pointer(parts: list[str]) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def diff_patch(src: Any, dst: Any, path: list[str] | None = None) -> list[dict[str, Any]]:
    """An RFC 6902 patch turning src into dst: keys added, removed or replaced, lists
    replaced whole. jsonpatch.make_patch gives the same result but diffs lists item by
    item, which took 80% of an admission; the patch applies to exactly the object the
    API server sent, so replacing a whole list loses nothing."""
    path = path or []
    if isinstance(src, dict) and isinstance(dst, dict):
        ops: list[dict[str, Any]] = []
        for key in src:
            if key not in dst:
                ops.append({"op": "remove", "path": _pointer([*path, key])})
        for key, value in dst.items():
            if key not in src:
                ops.append({"op": "add", "path": _pointer([*path, key]), "value": value})
            elif src[key] != value:
                ops += diff_patch(src[key], value, [*path, key])
        return ops
    if src == dst:
        return []
    return [{"op": "replace", "path": _pointer(path), "value": dst}]


def _response(uid: str, allowed: bool = True, patch: list[dict[str, Any]] | None = None,
              message: str | None = None, code: int = 200,
              warnings: list[str] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    if message is not None:
        response["status"] = {"code": code, "message": message}
    if warnings:
        response["warnings"] = [w[:512] for w in warnings[:10]]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": response}


class BadReview(ValueError):
    pass


def _request(review: Any) -> dict[str, Any]:
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise BadReview("not an AdmissionReview")
    request = review.get("request")
    if not isinstance(request, dict) or not request.get("uid"):
        raise BadReview("AdmissionReview without request.uid")
    return request


def mutate_pod(review: Any, caches: CacheRegistry, conflicts: ConflictLog,
               ctx: RenderContext) -> dict[str, Any]:
    request = _request(review)
    uid = request["uid"]
    pod = request.get("object")
    if request.get("operation") != "CREATE" or not isinstance(pod, dict):
        return _response(uid)
    meta = pod.get("metadata") or {}
    namespace = request.get("namespace") or meta.get("namespace") or ""
    name = meta.get("name") or meta.get("generateName", "") + "<generated>"
    labels = meta.get("labels") or {}
    if labels.get(names.LABEL_OPT_OUT) == "false":
        return _response(uid)
    selecting = [t for t in caches.in_namespace(namespace) if t.spec.selector.matches(labels)]
    if not selecting:
        return _response(uid)
    if len(selecting) > 1:
        listed = ", ".join(t.name for t in selecting)
        reason = (f"selected by several TieredPrefixCaches ({listed}); only one may inject a "
                  "pod: narrow their selectors")
        for tpc in selecting:
            conflicts.record(namespace, tpc.name, name, reason)
        return _response(uid, warnings=[f"kvtier: pod {name} {reason}"])
    tpc = selecting[0]
    result = inject(tpc, pod, ctx)
    if result.conflicts:
        for reason in result.conflicts:
            conflicts.record(namespace, tpc.name, name, reason)
        return _response(uid, warnings=[f"kvtier: not injected: {c}" for c in result.conflicts])
    if not result.changed:
        return _response(uid)
    return _response(uid, patch=diff_patch(pod, result.pod))


@dataclass
class _KeyRule:
    """What a selector demands of one label key."""

    present: bool = False  # must exist
    absent: bool = False  # must not exist
    allowed: set[str] | None = None  # one of these values (None: any value)
    forbidden: set[str] = field(default_factory=set)  # none of these values

    def both(self, other: _KeyRule) -> _KeyRule:
        allowed = (other.allowed if self.allowed is None else self.allowed
                   if other.allowed is None else self.allowed & other.allowed)
        return _KeyRule(self.present or other.present, self.absent or other.absent, allowed,
                        self.forbidden | other.forbidden)

    def satisfiable(self) -> bool:
        if self.present and self.absent:
            return False
        if not self.present:
            return True  # leaving the label off satisfies everything else
        return self.allowed is None or bool(self.allowed - self.forbidden)


def _rules(sel: LabelSelector) -> dict[str, _KeyRule]:
    rules: dict[str, _KeyRule] = {}
    for key, value in (sel.match_labels or {}).items():
        rules[key] = rules.get(key, _KeyRule()).both(_KeyRule(present=True, allowed={value}))
    for req in sel.match_expressions or []:
        values = set(req.values or [])
        rule = {"In": _KeyRule(present=True, allowed=values),
                "NotIn": _KeyRule(forbidden=values),
                "Exists": _KeyRule(present=True),
                "DoesNotExist": _KeyRule(absent=True)}[req.operator]
        rules[req.key] = rules.get(req.key, _KeyRule()).both(rule)
    return rules


def selectors_may_overlap(a: LabelSelector, b: LabelSelector) -> bool:
    """Whether some set of pod labels satisfies both selectors."""
    ra, rb = _rules(a), _rules(b)
    for key in set(ra) | set(rb):
        if not ra.get(key, _KeyRule()).both(rb.get(key, _KeyRule())).satisfiable():
            return False
    return True


def validate_tpc(review: Any, caches: CacheRegistry) -> dict[str, Any]:
    request = _request(review)
    uid = request["uid"]
    if request.get("operation") not in ("CREATE", "UPDATE"):
        return _response(uid)
    body = request.get("object")
    if not isinstance(body, dict) or body.get("kind") != KIND:
        return _response(uid, allowed=False, code=400,
                         message=f"expected a {KIND} in request.object")
    try:
        tpc = parse_tpc(body)
    except InvalidResource as err:
        return _response(uid, allowed=False, code=422,
                         message=f"{KIND} {err.name} is invalid: " + "; ".join(err.messages))
    others = [t for t in caches.in_namespace(tpc.namespace) if t.name != tpc.name]
    overlapping = [t.name for t in others
                   if selectors_may_overlap(tpc.spec.selector, t.spec.selector)]
    if overlapping:
        return _response(uid, allowed=False, code=422, message=(
            f"spec.selector may select the same pods as {', '.join(overlapping)} in namespace "
            f"{tpc.namespace}; a pod can belong to one TieredPrefixCache only: add a label "
            "that tells them apart (e.g. llm-d.ai/role) to both selectors"))
    return _response(uid)


# ------------------------------------------------------------------ server


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


async def watch_certificates(ctx: ssl.SSLContext, certfile: str, keyfile: str,
                             interval: float = 10.0) -> None:
    """Reload a rotated certificate into the live context: new handshakes use it."""

    def stamp() -> tuple[float, float]:
        return os.stat(certfile).st_mtime, os.stat(keyfile).st_mtime

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


def make_app(caches: CacheRegistry, conflicts: ConflictLog, ctx: RenderContext) -> web.Application:
    async def review(request: web.Request, handler: Any) -> web.Response:
        started = time.perf_counter()
        try:
            payload = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            raise
        except (ValueError, UnicodeDecodeError) as err:
            return web.json_response({"error": f"body is not JSON: {err}"}, status=400)
        try:
            answer = handler(payload)
        except BadReview as err:
            return web.json_response({"error": str(err)}, status=400)
        log.debug("%s answered in %.1f ms", request.path, (time.perf_counter() - started) * 1e3)
        return web.json_response(answer)

    async def mutate(request: web.Request) -> web.Response:
        def handler(payload: Any) -> dict[str, Any]:
            try:
                return mutate_pod(payload, caches, conflicts, ctx)
            except BadReview:
                raise
            except Exception:  # failurePolicy Ignore: never block a pod on our bug
                log.exception("pod mutation failed; admitting the pod unchanged")
                return _response(_request(payload)["uid"])
        return await review(request, handler)

    async def validate(request: web.Request) -> web.Response:
        return await review(request, lambda payload: validate_tpc(payload, caches))

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post(MUTATE_PATH, mutate)
    app.router.add_post(VALIDATE_PATH, validate)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(app: web.Application, host: str, port: int,
                tls: ssl.SSLContext | None) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=tls).start()
    return runner


def register_server(registry: Any, caches: CacheRegistry, conflicts: ConflictLog,
                    ctx: RenderContext, host: str, port: int, cert_dir: str) -> None:
    """Run the webhook server inside the operator process for its lifetime."""
    import kopf

    certfile, keyfile = os.path.join(cert_dir, "tls.crt"), os.path.join(cert_dir, "tls.key")

    @kopf.on.startup(registry=registry)
    async def start_webhook(memo: Any, **_: Any) -> None:
        tls = tls_context(certfile, keyfile)
        memo.webhook = await serve(make_app(caches, conflicts, ctx), host, port, tls)
        memo.webhook_certs = asyncio.create_task(watch_certificates(tls, certfile, keyfile))
        log.info("admission webhooks listening on https://%s:%d", host, port)

    @kopf.on.cleanup(registry=registry)
    async def stop_webhook(memo: Any, **_: Any) -> None:
        if memo.get("webhook_certs") is not None:
            memo.webhook_certs.cancel()
        if memo.get("webhook") is not None:
            await memo.webhook.cleanup()
