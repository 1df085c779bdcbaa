"""The thin API gateway: every Kubernetes call the operator makes, through the official
client, with plain dicts in and out.

Owned objects (the evictor CronJob, the router ConfigMap) are applied with server-side
apply: the render is the apply configuration of field manager `kvtier-operator`, forced,
so the object converges to it, a field kvtier stops rendering leaves, and fields other
parties own stay (the API server keeps the record, in metadata.managedFields).

Hand-over: kvtier before 0.2 wrote these objects with create and merge patches, as
manager `kvtier-operator` with operation Update, and kept its own record in the
kvtier.dev/applied-fields annotation. Fields an Update entry owns would never leave under
an apply, so on first sight of such an object `handed_over()` moves them into the apply
entry (as client-go's csaupgrade does), the annotation included; the next apply then
drops whatever the render no longer has, the annotation with it.

Conflicts and 429/5xx are retried here with backoff and then surface as RetryableError;
any other 4xx is ApiRejected carrying the server's message, which the reconciler turns
into a condition.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvtier_operator import GROUP, PLURAL, VERSION
from kvtier_operator.names import ANNOTATION_APPLIED_FIELDS

log = logging.getLogger("kvtier_operator")
FIELD_MANAGER = "kvtier-operator"
RETRYABLE = {409, 429, 500, 502, 503, 504}
APPLY = "application/apply-patch+yaml"


class ApiRejected(Exception):
    """A 4xx the server will repeat: the object or request itself is wrong."""

    def __init__(self, status: int, reason: str, message: str, what: str) -> None:
        self.status, self.reason, self.message, self.what = status, reason, message, what
        super().__init__(f"{what}: {status} {reason}: {message}")


class RetryableError(Exception):
    """Conflicts, throttling and server errors that outlasted the retries here."""


def _decode(err: ApiException) -> tuple[str, str]:
    try:
        body = json.loads(err.body or "{}")
        return str(body.get("reason") or err.reason), str(body.get("message") or err.reason)
    except ValueError:
        return str(err.reason), str(err.body or err.reason)


class Gateway:
    def __init__(self, api_client: client.ApiClient, retries: int = 3,
                 backoff: float = 0.2, sleep: Callable[[float], None] = time.sleep) -> None:
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.retries, self.backoff, self.sleep = retries, backoff, sleep
        # Per kind: (read, create, patch, delete), namespaced, by name; None: not done.
        self._ops: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None,
                                   Callable[..., Any] | None, Callable[..., Any] | None]] = {
            "PersistentVolumeClaim": (
                self.core.read_namespaced_persistent_volume_claim,
                self.core.create_namespaced_persistent_volume_claim,
                self.core.patch_namespaced_persistent_volume_claim,
                self.core.delete_namespaced_persistent_volume_claim),
            "CronJob": (self.batch.read_namespaced_cron_job,
                        self.batch.create_namespaced_cron_job,
                        self.batch.patch_namespaced_cron_job,
                        self.batch.delete_namespaced_cron_job),
            "ConfigMap": (self.core.read_namespaced_config_map,
                          self.core.create_namespaced_config_map,
                          self.core.patch_namespaced_config_map,
                          self.core.delete_namespaced_config_map),
            "Deployment": (self.apps.read_namespaced_deployment, None,
                           self.apps.patch_namespaced_deployment, None),
            "StatefulSet": (self.apps.read_namespaced_stateful_set, None,
                            self.apps.patch_namespaced_stateful_set, None),
            "ReplicaSet": (self.apps.read_namespaced_replica_set, None, None, None),
            # Engines' prerequisites (the mooncake master, its client DaemonSet) are only
            # checked to exist.
            "Service": (self.core.read_namespaced_service, None, None, None),
            "DaemonSet": (self.apps.read_namespaced_daemon_set, None, None, None),
        }
        # Listed only to find what the operator owns under an old name.
        self._lists: dict[str, Callable[..., Any]] = {
            "ConfigMap": self.core.list_namespaced_config_map}

    # ------------------------------------------------------------- plumbing

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, creating: bool = False,
              **kwargs: Any) -> Any:
        # A 409 on create means "already exists" (perhaps by our own earlier attempt whose
        # response was lost): the caller handles it; elsewhere 409 is a conflict to retry.
        retryable = RETRYABLE - {409} if creating else RETRYABLE
        for attempt in range(self.retries + 1):
            try:
                response = fn(*args, _preload_content=False, **kwargs)
                data = response.data
                return json.loads(data) if data else {}
            except ApiException as err:
                reason, message = _decode(err)
                if err.status in retryable and attempt < self.retries:
                    delay = self.backoff * 2**attempt
                    log.info("%s: %s %s, retrying in %.1fs", what, err.status, reason, delay)
                    self.sleep(delay)
                    continue
                if err.status in retryable:
                    raise RetryableError(f"{what}: {err.status} {reason}: {message}") from None
                raise ApiRejected(int(err.status or 0), reason, message, what) from None
        raise AssertionError("unreachable")

    @staticmethod
    def _what(kind: str, namespace: str, name: str) -> str:
        return f"{kind} {namespace}/{name}"

    # ---------------------------------------------------------------- CRUD

    def _op(self, kind: str, verb: int) -> Callable[..., Any]:
        fn = self._ops[kind][verb]
        if fn is None:
            action = ("read", "create", "patch", "delete")[verb]
            raise ValueError(f"the gateway does not {action} {kind} objects (the operator "
                             f"never {action}s them)")
        return fn

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = self._op(kind, 0)
        try:
            return self._call(self._what(kind, namespace, name), read, name, namespace)
        except ApiRejected as err:
            if err.status == 404:
                return None
            raise

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        create = self._op(obj["kind"], 1)
        return self._call(self._what(obj["kind"], meta["namespace"], meta["name"]), create,
                          meta["namespace"], obj, field_manager=FIELD_MANAGER, creating=True)

    def patch(self, kind: str, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        patch = self._op(kind, 2)
        return self._call(self._what(kind, namespace, name), patch, name, namespace, body,
                          field_manager=FIELD_MANAGER,
                          _content_type="application/merge-patch+json")

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of obj (apiVersion, kind, metadata and the fields kvtier
        owns) as FIELD_MANAGER, forced: the object is created if absent."""
        meta = obj["metadata"]
        kind, ns, name = obj["kind"], meta["namespace"], meta["name"]
        return self._call(self._what(kind, ns, name), self._op(kind, 2), name, ns, obj,
                          field_manager=FIELD_MANAGER, force=True, _content_type=APPLY)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        delete = self._op(kind, 3)
        try:
            self._call(self._what(kind, namespace, name), delete, name, namespace,
                       propagation_policy="Background")
            return True
        except ApiRejected as err:
            if err.status == 404:
                return False
            raise

    def delete_owned(self, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the object only if owner_uid controls it (a CR that stops wanting a
        ConfigMap or CronJob must not delete someone else's under that name)."""
        live = self.get(kind, namespace, name)
        if live is None or controller_uid(live.get("metadata") or {}) != owner_uid:
            return False
        return self.delete(kind, namespace, name)

    def ensure(self, obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Make the live object match obj, the render, by server-side apply (after the
        one-time hand-over of fields older kvtier wrote with merge patches).
        Returns ("created" | "updated" | "unchanged", live object)."""
        meta = obj["metadata"]
        kind, ns, name = obj["kind"], meta["namespace"], meta["name"]
        live = self.get(kind, ns, name)
        if live is None:
            return "created", self.apply(obj)
        owner = controller_uid(obj["metadata"])
        if owner is not None and controller_uid(live.get("metadata") or {}) != owner:
            # Anyone may have made an object under the name a CR asks for: kvtier patches
            # (and so adopts) only what it controls.
            raise ApiRejected(409, "NotOwned", "it exists and is not controlled by this "
                              "TieredPrefixCache; kvtier takes over only objects it created: "
                              "delete it or choose another name", Gateway._what(kind, ns, name))
        managed = handed_over(live)
        if managed is not None:
            # resourceVersion makes it conditional: a 409 (someone wrote meanwhile) is
            # retried, and the next reconcile hands over what it then finds.
            version = (live.get("metadata") or {}).get("resourceVersion")
            live = self.patch(kind, ns, name, {"metadata": {
                "managedFields": managed, "resourceVersion": version}})
            log.info("%s: fields of kvtier's merge patches handed over to server-side apply",
                     self._what(kind, ns, name))
        before = (live.get("metadata") or {}).get("resourceVersion")
        result = self.apply(obj)
        after = (result.get("metadata") or {}).get("resourceVersion")
        return ("unchanged" if after == before else "updated"), result

    # ---------------------------------------------------------------- reads

    def owned_names(self, kind: str, namespace: str, labels: dict[str, str],
                    owner_uid: str) -> list[str]:
        """Names of the objects of kind in namespace that carry all these labels and
        are controlled by the owner with this uid (anyone can set a label: the owner
        reference is the proof)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = self._call(f"{kind}s in {namespace}", self._lists[kind], namespace,
                          label_selector=selector)
        return [meta.get("name", "") for meta in
                (item.get("metadata") or {} for item in data.get("items", []))
                if controlled_by(meta, labels, owner_uid)]

    def events_for(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        data = self._call(f"events of {kind} {namespace}/{name}", self.core.list_namespaced_event,
                          namespace, field_selector=selector)
        items = [e for e in data.get("items", [])
                 if (e.get("involvedObject") or {}).get("name") == name]
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def pod_identities(self, namespace: str, selector: str) -> set[tuple[str, str]]:
        """(name, uid) of every pod the server has in namespace matching selector."""
        data = self._call(f"pods in {namespace}", self.core.list_namespaced_pod, namespace,
                          label_selector=selector)
        metas = [item.get("metadata") or {} for item in data.get("items", [])]
        return {(m.get("name", ""), m.get("uid", "")) for m in metas}

    def get_custom(self, group: str, version: str, plural: str, namespace: str,
                   name: str) -> dict[str, Any] | None:
        try:
            return self._call(f"{plural}.{group} {namespace}/{name}",
                              self.custom.get_namespaced_custom_object, group, version,
                              namespace, plural, name)
        except ApiRejected as err:
            if err.status == 404:
                return None
            raise

    def patch_custom(self, group: str, version: str, plural: str, namespace: str, name: str,
                     body: dict[str, Any]) -> dict[str, Any]:
        return self._call(f"{plural}.{group} {namespace}/{name}",
                          self.custom.patch_namespaced_custom_object, group, version, namespace,
                          plural, name, body, field_manager=FIELD_MANAGER,
                          _content_type="application/merge-patch+json")

    def get_cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get_custom(GROUP, VERSION, PLURAL, namespace, name)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._call(f"status of {name}", self.custom.patch_namespaced_custom_object_status,
                   GROUP, VERSION, namespace, PLURAL, name, {"status": status},
                   field_manager=FIELD_MANAGER,
                   _content_type="application/merge-patch+json")


def controller_uid(meta: dict[str, Any]) -> str | None:
    """The uid of the object's controlling owner, if it has one."""
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller"):
            uid = ref.get("uid")
            return uid if isinstance(uid, str) else None
    return None


def controlled_by(meta: dict[str, Any], labels: dict[str, str], owner_uid: str) -> bool:
    """Whether an object's metadata carries these labels and names owner_uid as its
    controlling owner."""
    have = meta.get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items()) and any(
        ref.get("uid") == owner_uid and ref.get("controller")
        for ref in meta.get("ownerReferences") or [])


def contains(live: Any, want: Any) -> bool:
    """Whether every field of want is present, equal, in live (lists compared whole)."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(contains(live.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return (isinstance(live, list) and len(live) == len(want)
                and all(contains(a, b) for a, b in zip(live, want, strict=True)))
    return bool(live == want)


# ------------------------------------------------------------ the hand-over


def _union(a: Any, b: Any) -> Any:
    """The union of two fieldsV1 sets (nested maps of field keys)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a if isinstance(a, dict) else b
    out = dict(a)
    for key, value in b.items():
        out[key] = _union(out.get(key), value)
    return out


_ANNOTATION_FIELDS: dict[str, Any] = {
    "f:metadata": {"f:annotations": {f"f:{ANNOTATION_APPLIED_FIELDS}": {}}}}


def handed_over(live: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The managedFields live should carry so that server-side apply owns what kvtier's
    merge patches wrote, or None when there is nothing to hand over: the fields of every
    FIELD_MANAGER entry with operation Update (no subresource) join its Apply entry
    (made if missing), and so does the kvtier.dev/applied-fields annotation."""
    meta = live.get("metadata") or {}
    entries = [e for e in meta.get("managedFields") or [] if isinstance(e, dict)]
    old = [e for e in entries if e.get("manager") == FIELD_MANAGER
           and e.get("operation") == "Update" and not e.get("subresource")]
    annotated = ANNOTATION_APPLIED_FIELDS in (meta.get("annotations") or {})
    if not old and not annotated:
        return None
    apply = next((e for e in entries if e.get("manager") == FIELD_MANAGER
                  and e.get("operation") == "Apply" and not e.get("subresource")), None)
    fields: Any = dict(apply.get("fieldsV1") or {}) if apply else {}
    for entry in old:
        fields = _union(fields, entry.get("fieldsV1") or {})
    if annotated:
        fields = _union(fields, _ANNOTATION_FIELDS)
    merged = {**(apply or {"manager": FIELD_MANAGER, "operation": "Apply",
                           "apiVersion": (old[0].get("apiVersion") if old else None)
                           or live.get("apiVersion"), "fieldsType": "FieldsV1"}),
              "fieldsV1": fields}
    if annotated and not old and apply is not None and apply.get("fieldsV1") == fields:
        return None  # handed over already; the next apply removes the annotation
    kept = [e for e in entries if e is not apply and not any(e is o for o in old)]
    return [*kept, merged]

