"""Admission reviews in, answers out: pure, no I/O, so they can run in a worker thread or a
worker process (see admission_lanes).

`admit` takes the raw request body and always returns an answer: malformed reviews get a
400 with a JSON error (bad JSON, NaN or infinite numbers, nesting too deep for the parser,
no request.uid), a pod the webhook cannot understand is admitted unchanged (the pod webhook
runs with failurePolicy Ignore), and a TieredPrefixCache it cannot check is denied with a
message. No traceback ever goes to the client; `Outcome.problem` carries it to the log.
"""

from __future__ import annotations

import base64
import json
import math
import traceback
from dataclasses import dataclass, field
from typing import Any

from kvtier_operator import KIND, names
from kvtier_operator.api.v1alpha1 import LabelSelector
from kvtier_operator.cache_registry import CacheLookup
from kvtier_operator.conflict_log import ConflictLog
from kvtier_operator.context import RenderContext
from kvtier_operator.render.pod import inject
from kvtier_operator.validation import InvalidResource, deprecations, immutable, parse_tpc
from kvtier_operator.validation.host_paths import host_path_refusal
from kvtier_operator.validation.object_endpoints import object_endpoint_refusal

MUTATE_PATH = "/mutate-pods"
VALIDATE_PATH = "/validate-tieredprefixcaches"
MAX_MESSAGE = 512  # characters of a warning or denial message echoed to the API server


@dataclass(frozen=True)
class Conflict:
    namespace: str
    cache: str
    pod: str
    reason: str


@dataclass(frozen=True)
class Outcome:
    """What to answer (HTTP status, JSON body), what to record, what to log."""

    status: int
    body: bytes
    conflicts: tuple[Conflict, ...] = ()
    problem: str | None = None  # a traceback for the operator log, never for the client

    @staticmethod
    def error(status: int, message: str) -> Outcome:
        return Outcome(status, encode({"error": message}))


def encode(document: Any) -> bytes:
    return json.dumps(document, allow_nan=False, separators=(",", ":")).encode()


class BadReview(ValueError):
    pass


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


# Deeper than any pod or TieredPrefixCache (managedFields included) ever nests. Checked
# explicitly: the parser's own limit is the interpreter's recursion limit, which other
# libraries in the process raise (cel-python sets 2500).
MAX_DEPTH = 100


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether any value in `doc` sits more than `limit` arrays/objects deep (iterative)."""
    level: list[Any] = [doc]
    for _ in range(limit + 1):
        nested: list[Any] = []
        for value in level:
            if isinstance(value, dict):
                nested.extend(v for v in value.values() if isinstance(v, dict | list))
            elif isinstance(value, list):
                nested.extend(v for v in value if isinstance(v, dict | list))
        if not nested:
            return False
        level = nested
    return True


def parse_review(body: bytes) -> Any:
    """The JSON document in `body` (UTF-8, finite numbers only, at most MAX_DEPTH arrays
    and objects deep), or BadReview."""
    try:
        doc = json.loads(body.decode("utf-8"), parse_float=_finite, parse_constant=_not_json)
    except RecursionError:
        raise BadReview("body is not acceptable JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise BadReview(f"body is not acceptable JSON: {str(err)[:200]}") from None
    # Only a body with that many brackets can be that deep: most skip the walk.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _deeper_than(doc, MAX_DEPTH):
        raise BadReview(f"body is not acceptable JSON: nested more than {MAX_DEPTH} deep")
    return doc


def _request(review: Any) -> dict[str, Any]:
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise BadReview("not an AdmissionReview")
    request = review.get("request")
    if not isinstance(request, dict) or not request.get("uid"):
        raise BadReview("AdmissionReview without request.uid")
    if not isinstance(request["uid"], str):
        raise BadReview("request.uid must be a string")
    return request


def _response(uid: str, allowed: bool = True, patch: list[dict[str, Any]] | None = None,
              message: str | None = None, code: int = 200,
              warnings: list[str] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(encode(patch)).decode()
    if message is not None:
        response["status"] = {"code": code, "message": message[:4 * MAX_MESSAGE]}
    if warnings:
        response["warnings"] = [w[:MAX_MESSAGE] for w in warnings[:10]]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": response}


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


# ------------------------------------------------------------------ pods


def admit_pod(request: dict[str, Any], caches: CacheLookup,
              ctx: RenderContext) -> tuple[dict[str, Any], list[Conflict]]:
    """The answer to one pod admission request, and the conflicts to record."""
    uid = request["uid"]
    pod = request.get("object")
    if request.get("operation") != "CREATE" or not isinstance(pod, dict):
        return _response(uid), []
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {} if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(labels, dict):
        return _response(uid), []  # not a pod: leave it to the API server's validation
    namespace = request.get("namespace") or meta.get("namespace") or ""
    name = meta.get("name") or f"{meta.get('generateName') or ''}<generated>"
    if not isinstance(namespace, str) or not isinstance(name, str):
        return _response(uid), []
    if labels.get(names.LABEL_OPT_OUT) == "false":
        return _response(uid), []
    selecting = [t for t in caches.in_namespace(namespace) if t.spec.selector.matches(labels)]
    if not selecting:
        return _response(uid), []
    if len(selecting) > 1:
        listed = ", ".join(t.name for t in selecting)
        reason = (f"selected by several TieredPrefixCaches ({listed}); only one may inject a "
                  "pod: narrow their selectors")
        return (_response(uid, warnings=[f"kvtier: pod {name} {reason}"]),
                [Conflict(namespace, t.name, name, reason) for t in selecting])
    tpc = selecting[0]
    result = inject(tpc, pod, ctx)
    if result.conflicts:
        return (_response(uid, warnings=[f"kvtier: not injected: {c}" for c in result.conflicts]),
                [Conflict(namespace, tpc.name, name, c) for c in result.conflicts])
    if not result.changed:
        return _response(uid), []
    return _response(uid, patch=diff_patch(pod, result.pod)), []


def mutate_pod(review: Any, caches: CacheLookup, conflicts: ConflictLog,
               ctx: RenderContext) -> dict[str, Any]:
    """admit_pod on a parsed review, recording its conflicts (BadReview if malformed)."""
    answer, found = admit_pod(_request(review), caches, ctx)
    for c in found:
        conflicts.record(c.namespace, c.cache, c.pod, c.reason)
    return answer


# ------------------------------------------------------------------ TieredPrefixCaches


@dataclass
class _KeyRule:
    """What a selector demands of one label key."""

    present: bool = False  # must exist
    absent: bool = False  # must not exist
    allowed: set[str] | None = None  # one of these values (None: any value)
    forbidden: set[str] = field(default_factory=set)  # none of these values

    def add(self, present: bool = False, absent: bool = False,
            allowed: set[str] | None = None, forbidden: set[str] | None = None) -> None:
        """Demand this too (in place: linear in the selector's size, however many
        requirements name the same key)."""
        self.present |= present
        self.absent |= absent
        if allowed is not None:
            self.allowed = set(allowed) if self.allowed is None else self.allowed & allowed
        if forbidden:
            self.forbidden |= forbidden

    def both(self, other: _KeyRule) -> _KeyRule:
        rule = _KeyRule(self.present, self.absent, self.allowed, set(self.forbidden))
        rule.add(other.present, other.absent, other.allowed, other.forbidden)
        return rule

    def satisfiable(self) -> bool:
        if self.present and self.absent:
            return False
        if not self.present:
            return True  # leaving the label off satisfies everything else
        return self.allowed is None or bool(self.allowed - self.forbidden)


SelectorRules = dict[str, _KeyRule]


def selector_rules(sel: LabelSelector) -> SelectorRules:
    """What `sel` demands, key by key."""
    rules: SelectorRules = {}
    for key, value in (sel.match_labels or {}).items():
        rules.setdefault(key, _KeyRule()).add(present=True, allowed={value})
    for req in sel.match_expressions or []:
        rule = rules.setdefault(req.key, _KeyRule())
        values = set(req.values or [])
        if req.operator == "In":
            rule.add(present=True, allowed=values)
        elif req.operator == "NotIn":
            rule.add(forbidden=values)
        elif req.operator == "Exists":
            rule.add(present=True)
        else:
            rule.add(absent=True)
    return rules


def rules_may_overlap(ra: SelectorRules, rb: SelectorRules) -> bool:
    """Whether some set of pod labels satisfies both selectors' rules. Only keys both
    name can conflict (a selector alone is satisfiable): cost bounded by the smaller one,
    plus the set operations on its values."""
    if len(rb) < len(ra):
        ra, rb = rb, ra
    return all(ra[key].both(rb[key]).satisfiable() for key in ra if key in rb)


def selectors_may_overlap(a: LabelSelector, b: LabelSelector) -> bool:
    """Whether some set of pod labels satisfies both selectors."""
    return rules_may_overlap(selector_rules(a), selector_rules(b))


def validate_request(request: dict[str, Any], caches: CacheLookup,
                     allowed_host_paths: tuple[str, ...] = (),
                     allowed_object_endpoints: tuple[str, ...] = ()) -> dict[str, Any]:
    uid = request["uid"]
    if request.get("operation") not in ("CREATE", "UPDATE"):
        return _response(uid)
    body = request.get("object")
    if not isinstance(body, dict) or body.get("kind") != KIND:
        return _response(uid, allowed=False, code=400,
                         message=f"expected a {KIND} in request.object")
    if not isinstance(body.get("metadata"), dict):
        return _response(uid, allowed=False, code=400,
                         message=f"request.object.metadata of a {KIND} must be an object")
    try:
        tpc = parse_tpc(body)
    except InvalidResource as err:
        return _response(uid, allowed=False, code=422,
                         message=f"{KIND} {err.name} is invalid: " + "; ".join(err.messages))
    host_path = host_path_refusal(tpc.spec, allowed_host_paths) or object_endpoint_refusal(
        tpc.spec, allowed_object_endpoints)
    if host_path:
        return _response(uid, allowed=False, code=422,
                         message=f"{KIND} {tpc.name} is invalid: {host_path}")
    if request.get("operation") == "UPDATE":
        old = request.get("oldObject")
        changed = immutable.changed_fields(old.get("spec") if isinstance(old, dict) else None,
                                           body.get("spec"))
        if changed:
            return _response(uid, allowed=False, code=422,
                             message="; ".join(immutable.message(f) for f in changed))
    mine = selector_rules(tpc.spec.selector)
    others = [t for t in caches.in_namespace(tpc.namespace) if t.name != tpc.name]
    overlapping = [t.name for t in others
                   if rules_may_overlap(mine, selector_rules(t.spec.selector))]
    if overlapping:
        return _response(uid, allowed=False, code=422, message=(
            f"spec.selector may select the same pods as {', '.join(overlapping)} in namespace "
            f"{tpc.namespace}; a pod can belong to one TieredPrefixCache only: add a label "
            "that tells them apart (e.g. llm-d.ai/role) to both selectors"))
    return _response(uid, warnings=[f"kvtier: {w}" for w in deprecations(tpc)])


def validate_tpc(review: Any, caches: CacheLookup,
                 allowed_host_paths: tuple[str, ...] = ()) -> dict[str, Any]:
    """validate_request on a parsed review (BadReview if malformed)."""
    return validate_request(_request(review), caches, allowed_host_paths)


# ------------------------------------------------------------------ one request, end to end


def admit(path: str, body: bytes, caches: CacheLookup, ctx: RenderContext) -> Outcome:
    """The answer to the raw body of one request to `path` (MUTATE_PATH or VALIDATE_PATH).
    Never raises for anything a client can send."""
    try:
        request = _request(parse_review(body))
    except BadReview as err:
        return Outcome.error(400, str(err))
    uid = request["uid"]
    try:
        if path == MUTATE_PATH:
            answer, conflicts = admit_pod(request, caches, ctx)
            return Outcome(200, encode(answer), tuple(conflicts))
        return Outcome(200, encode(validate_request(request, caches, ctx.allowed_host_paths,
                                                    ctx.allowed_object_endpoints)))
    except Exception as err:
        failure, problem = f"{type(err).__name__}: {err}", traceback.format_exc()
    if path == MUTATE_PATH:  # failurePolicy Ignore: never block a pod on our bug
        answer = _response(uid, warnings=["kvtier: not injected: the webhook failed on this pod "
                                          "(see the kvtier operator log)"])
    else:
        answer = _response(uid, allowed=False, code=422, message=(
            f"kvtier could not validate this {KIND}: {failure}"))
    return Outcome(200, encode(answer), (), problem)
