"""reconcile(), status and the gateway as plain functions: the rules kmock cannot
enforce (owner references for garbage collection, delete-policy flips, resize refusal,
transition times, retry classification)."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client.rest import ApiException

from kvtier_demo import ssa
from kvtier_operator.api.v1alpha1 import TieredPrefixCacheStatus
from kvtier_operator.context import RenderContext
from kvtier_operator.gateway import (
    FIELD_MANAGER,
    ApiRejected,
    Gateway,
    RetryableError,
    contains,
    controlled_by,
)
from kvtier_operator.observe import pod_view as bare_pod_view
from kvtier_operator.reconcile import reconcile
from kvtier_operator.render.pod import config_hash
from kvtier_operator.status import Cond, conditions
from kvtier_operator.validation import parse_tpc
from tests.helpers import tpc_doc

CTX = RenderContext()
NOW = "2026-11-22T08:00:00Z"


class FakeGateway:
    """An in-memory API with the same surface as Gateway."""

    def __init__(self) -> None:
        self.store: dict[tuple[str, str, str], dict] = {}
        self.refuse: dict[tuple[str, str], ApiRejected] = {}  # (verb, kind) -> error
        self.calls: list[tuple[str, str, str]] = []

    def _check(self, verb: str, kind: str) -> None:
        if (verb, kind) in self.refuse:
            raise self.refuse[verb, kind]

    def get(self, kind, ns, name):
        self.calls.append(("get", kind, name))
        found = self.store.get((kind, ns, name))
        return copy.deepcopy(found) if found else None

    def create(self, obj):
        self._check("create", obj["kind"])
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        self.store[obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]] = \
            copy.deepcopy(obj)
        return copy.deepcopy(obj)

    def patch(self, kind, ns, name, body):
        self._check("patch", kind)
        self.calls.append(("patch", kind, name))
        merged = _merge(self.store[kind, ns, name], body)
        self.store[kind, ns, name] = merged
        return copy.deepcopy(merged)

    def delete(self, kind, ns, name):
        self.calls.append(("delete", kind, name))
        return self.store.pop((kind, ns, name), None) is not None

    def apply(self, obj):
        """Server-side apply, emulated as the sandbox does (kvtier_demo/ssa.py): a write
        only when something changes."""
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        live = self.store.get(key)
        self._check("create" if live is None else "patch", obj["kind"])
        result = ssa.apply(copy.deepcopy(live) if live else None, obj, FIELD_MANAGER)
        if result is None:
            return copy.deepcopy(live)
        self.calls.append(("create" if live is None else "patch", key[0], key[2]))
        self.store[key] = result
        return copy.deepcopy(result)

    def ensure(self, obj):
        return Gateway.ensure(self, obj)  # the real logic over this fake's CRUD

    def delete_owned(self, kind, ns, name, owner_uid):
        return Gateway.delete_owned(self, kind, ns, name, owner_uid)

    def events_for(self, ns, kind, name):
        return []

    def owned_names(self, kind, ns, labels, owner_uid):
        self._check("list", kind)
        self.calls.append(("list", kind, ",".join(sorted(labels))))
        return [name for (k, pns, name), o in self.store.items()
                if k == kind and pns == ns and controlled_by(o["metadata"], labels, owner_uid)]

    def pod_identities(self, ns, selector):
        self.calls.append(("list", "Pod", selector))
        return {(o["metadata"]["name"], o["metadata"].get("uid", ""))
                for (kind, pns, _), o in self.store.items() if kind == "Pod" and pns == ns}

    def collect_garbage(self, uid: str) -> list[str]:
        """What Kubernetes' garbage collector does once the owner is gone."""
        owned = [k for k, o in self.store.items()
                 if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences", []))]
        for k in owned:
            del self.store[k]
        return sorted(k[0] for k in owned)


def _merge(base, patch):
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def body(spec=None):
    doc = tpc_doc(spec)
    doc["metadata"].update(uid="u-1", generation=3)
    return doc


def run(gw, doc, pods=(), runs=()):
    return reconcile(doc, gw, CTX, list(pods), list(runs), NOW)


def test_garbage_collection_removes_exactly_the_owned_objects():
    gw = FakeGateway()
    run(gw, body({"router": {"enabled": True}}))
    assert gw.collect_garbage("u-1") == ["ConfigMap", "CronJob"]
    assert ("PersistentVolumeClaim", "ml", "cache-kv-cache") in gw.store  # retained


def router_maps(gw):
    return sorted(name for (kind, _, name) in gw.store if kind == "ConfigMap")


def test_renaming_the_router_configmap_deletes_the_old_one_and_nothing_else():
    gw = FakeGateway()
    run(gw, body({"router": {"enabled": True}}))
    old = gw.store["ConfigMap", "ml", "cache-router"]
    user_copy = copy.deepcopy(old)  # same labels, made by someone else: not ours to delete
    user_copy["metadata"].update(name="copy", ownerReferences=[])
    gw.store["ConfigMap", "ml", "copy"] = user_copy
    other = copy.deepcopy(old)  # another cache's, same labels after a delete and recreate
    other["metadata"].update(name="other", ownerReferences=[
        {**old["metadata"]["ownerReferences"][0], "uid": "u-0"}])
    gw.store["ConfigMap", "ml", "other"] = other

    outcome = run(gw, body({"router": {"enabled": True, "configMapName": "epp"}}))
    assert router_maps(gw) == ["copy", "epp", "other"]
    assert ("Normal", "Deleted", "deleted ConfigMap cache-router (renamed to epp)") in \
        outcome.events
    assert outcome.ok

    outcome = run(gw, body({"router": {"enabled": False, "configMapName": "epp"}}))
    assert router_maps(gw) == ["copy", "other"]
    outcome = run(gw, body({"router": {"enabled": True, "configMapName": "epp"}}))
    run(gw, body({"router": {"enabled": False}}))  # disabled and renamed back at once
    assert router_maps(gw) == ["copy", "other"]


def test_a_refused_search_for_old_router_configmaps_is_reported():
    gw = FakeGateway()
    run(gw, body({"router": {"enabled": True}}))
    gw.refuse["list", "ConfigMap"] = ApiRejected(
        403, "Forbidden", 'cannot list resource "configmaps"', "ConfigMaps in ml")
    outcome = run(gw, body({"router": {"enabled": True, "configMapName": "epp"}}))
    cond = next(c for c in outcome.status_doc["conditions"] if c["type"] == "Injected")
    assert cond["reason"] == "RouterConfigRejected"
    assert 'cannot list resource "configmaps"' in cond["message"]
    assert not outcome.ok
    assert router_maps(gw) == ["cache-router", "epp"]  # the new one is there all the same


def test_delete_policy_flip_adds_and_removes_the_claim_owner_reference():
    gw = FakeGateway()
    run(gw, body())
    key = ("PersistentVolumeClaim", "ml", "cache-kv-cache")
    foreign = {"apiVersion": "v1", "kind": "Thing", "name": "t", "uid": "other"}
    gw.store[key]["metadata"]["ownerReferences"] = [foreign]
    run(gw, body({"storage": {"pvc": {"deletePolicy": "Delete"}}}))
    refs = gw.store[key]["metadata"]["ownerReferences"]
    assert [r["uid"] for r in refs] == ["other", "u-1"]
    run(gw, body({"storage": {"pvc": {"deletePolicy": "Retain"}}}))
    assert gw.store[key]["metadata"]["ownerReferences"] == [foreign]


def test_reconcile_twice_writes_nothing_the_second_time():
    gw = FakeGateway()
    run(gw, body({"router": {"enabled": True}}))
    gw.calls.clear()
    outcome = run(gw, body({"router": {"enabled": True}}))
    assert [c for c in gw.calls if c[0] not in ("get", "list")] == []
    assert outcome.events == []


def test_resize_refused_is_reported_not_raised():
    gw = FakeGateway()
    run(gw, body())
    key = ("PersistentVolumeClaim", "ml", "cache-kv-cache")
    gw.store[key]["status"] = {"phase": "Bound", "capacity": {"storage": "1Ti"}}
    gw.refuse["patch", "PersistentVolumeClaim"] = ApiRejected(
        403, "Forbidden", "only dynamically provisioned pvc can be resized", "PVC ml/x")
    outcome = run(gw, body({"storage": {"pvc": {"size": "2Ti"}}}))
    cond = next(c for c in outcome.status_doc["conditions"] if c["type"] == "StorageReady")
    assert cond["status"] == "True" and cond["reason"] == "BoundWithWarnings"
    assert "only dynamically provisioned pvc can be resized" in cond["message"]
    assert any(e[1] == "ResizeRefused" for e in outcome.events)


def test_claim_rejected_on_create():
    gw = FakeGateway()
    gw.refuse["create", "PersistentVolumeClaim"] = ApiRejected(
        422, "Invalid", 'spec.storageClassName: Invalid value: "Lustre"', "PVC ml/cache-kv-cache")
    outcome = run(gw, body())
    cond = next(c for c in outcome.status_doc["conditions"] if c["type"] == "StorageReady")
    assert cond["reason"] == "ClaimRejected" and "Lustre" in cond["message"]
    assert not outcome.ok
    ready = outcome.status_doc["conditions"][0]
    assert ready["status"] == "False" and "StorageReady" in ready["message"]


def test_storage_removed_deletes_the_cronjob():
    gw = FakeGateway()
    run(gw, body())
    assert ("CronJob", "ml", "cache-evictor") in gw.store
    run(gw, body({"storage": None}))
    assert ("CronJob", "ml", "cache-evictor") not in gw.store


def _foreign(gw, kind, name):
    """An object someone else made, under a name a CR can ask for."""
    gw.store[kind, "ml", name] = {"kind": kind, "metadata": {
        "name": name, "namespace": "ml", "labels": {"app": "theirs"}}, "data": {"k": "v"}}


def test_a_cache_never_deletes_or_adopts_what_it_does_not_control():
    """A CR author must not get kvtier to delete or take over someone else's ConfigMap or
    CronJob by naming it (kvtier's role may patch and delete both)."""
    gw = FakeGateway()
    _foreign(gw, "ConfigMap", "app-config")
    _foreign(gw, "CronJob", "backup-evictor")
    before = copy.deepcopy(gw.store)
    # not wanted under that name: a foreign object is left alone
    run(gw, body({"router": {"enabled": False, "configMapName": "app-config"}}))
    doc = body({"storage": None})
    doc["metadata"]["name"] = "backup"
    run(gw, doc)
    assert gw.store["ConfigMap", "ml", "app-config"] == before["ConfigMap", "ml", "app-config"]
    assert gw.store["CronJob", "ml", "backup-evictor"] == before["CronJob", "ml", "backup-evictor"]
    # wanted under that name: refused and reported, never patched (nor owned, so deleting
    # the cache cannot garbage-collect it)
    outcome = run(gw, body({"router": {"enabled": True, "configMapName": "app-config"}}))
    assert gw.store["ConfigMap", "ml", "app-config"] == before["ConfigMap", "ml", "app-config"]
    cond = next(c for c in outcome.status_doc["conditions"] if c["reason"] == "RouterConfigRejected")
    assert "not controlled by this TieredPrefixCache" in cond["message"]
    assert not outcome.ok


def test_conditions_keep_transition_time_while_status_holds():
    first = conditions({t: Cond("False", "X") for t in ("Ready", "StorageReady", "Injected",
                                                          "EvictorHealthy")}, None, 1, "t1")
    # The live object's conditions, as the API returns them (camelCase JSON).
    live = [c.model_dump(mode="json", by_alias=True, exclude_unset=True) for c in first]
    second = conditions({"Ready": Cond("False", "Y"), "StorageReady": Cond("True", "Bound"),
                         "Injected": Cond("False", "X"), "EvictorHealthy": Cond("False", "X")},
                        live, 2, "t2")
    by = {c.type: c for c in second}
    assert by["Ready"].last_transition_time == "t1"  # reason changed, status did not
    assert by["StorageReady"].last_transition_time == "t2"
    assert all(c.observed_generation == 2 for c in second)


def test_the_status_is_the_typed_model_the_crd_is_generated_from():
    outcome = run(FakeGateway(), body())
    assert isinstance(outcome.status, TieredPrefixCacheStatus)
    written = outcome.status_doc
    # What is written round-trips through the model that defines the CRD's status schema.
    assert TieredPrefixCacheStatus.model_validate(written).model_dump(
        mode="json", by_alias=True, exclude_unset=True) == written
    assert set(written) == {"observedGeneration", "conditions", "configHash", "injectedPods",
                            "pendingPods", "pvc", "usage", "lastEviction", "hitPercent",
                            "tiers", "recompute", "observation", "routerCapacity"}
    assert written["usage"] is None  # kept: a merge patch clears a stale value


def test_pod_view_reads_what_counting_needs():
    view = pod_view({"metadata": {"name": "p", "namespace": "ml", "labels": {"a": "b"},
                                  "annotations": {"kvtier.dev/config-hash": "h"},
                                  "ownerReferences": [{"kind": "ReplicaSet", "name": "rs",
                                                       "controller": True}],
                                  "deletionTimestamp": "now"},
                     "status": {"phase": "Running"}})
    assert view.config_hash == "h" and view.owner_kind == "ReplicaSet" and not view.active


def pod_view(body):
    """The view the operator's pod index keeps: with the engines its containers run."""
    from dataclasses import replace

    from kvtier_operator.engines.registry import engines_in

    return replace(bare_pod_view(body), engines=engines_in(body.get("spec")))


def decode_pod(name, uid, config_hash=None):
    annotations = {"kvtier.dev/cache": "cache", "kvtier.dev/config-hash": config_hash} \
        if config_hash else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "uid": uid,
                         "labels": {"llm-d.ai/role": "decode"}, "annotations": annotations},
            "spec": {"containers": [{"name": "vllm", "command": ["vllm", "serve", "m"]}]},
            "status": {"phase": "Running"}}


def test_pods_the_server_no_longer_has_are_neither_pending_nor_restarted():
    gw = FakeGateway()
    doc = body({"rollout": "Auto", "storage": None})
    digest = config_hash(parse_tpc(doc), CTX)
    live = decode_pod("decode-1", "uid-b", digest)
    recreated = decode_pod("decode-0", "uid-new", digest)  # same name, new pod
    for p in (live, recreated):
        gw.store["Pod", "ml", p["metadata"]["name"]] = p
    # The index still holds decode-0's old, stale incarnation and a pod deleted unseen.
    index = [pod_view(p) for p in (decode_pod("decode-0", "uid-old"), decode_pod("gone", "g"),
                                   live, recreated)]
    outcome = run(gw, doc, index)
    injected = next(c for c in outcome.status_doc["conditions"] if c["type"] == "Injected")
    assert (injected["status"], injected["reason"]) == ("True", "AllInjected")
    assert outcome.status_doc["pendingPods"] == 0 and outcome.status_doc["injectedPods"] == 2
    assert ("list", "Pod", "llm-d.ai/role=decode") in gw.calls


def test_conflicts_of_pods_the_server_no_longer_has_are_dropped():
    gw = FakeGateway()
    doc = body({"storage": None})
    digest = config_hash(parse_tpc(doc), CTX)
    kept = decode_pod("decode-1", "uid-b")  # left alone by the webhook: no annotations
    gw.store["Pod", "ml", "decode-1"] = kept
    index = [pod_view(p) for p in (kept, decode_pod("gone", "g"),
                                   decode_pod("decode-2", "uid-c", digest))]
    gw.store["Pod", "ml", "decode-2"] = decode_pod("decode-2", "uid-c", digest)
    why = "container 'vllm' already passes --kv-transfer-config"
    outcome = reconcile(doc, gw, CTX, index, [], NOW, {"decode-1": why, "gone": why})
    injected = next(c for c in outcome.status_doc["conditions"] if c["type"] == "Injected")
    assert (injected["status"], injected["reason"]) == ("False", "Conflict")
    assert injected["message"] == f"pod decode-1: {why}"  # not the pod deleted unseen

    del gw.store["Pod", "ml", "decode-1"]  # its deletion missed by the index too
    outcome = reconcile(doc, gw, CTX, index, [], NOW, {"decode-1": why, "gone": why})
    injected = next(c for c in outcome.status_doc["conditions"] if c["type"] == "Injected")
    assert (injected["status"], injected["reason"]) == ("True", "AllInjected")


def test_pending_pods_the_server_has_stay_pending():
    gw = FakeGateway()
    doc = body({"storage": None})
    stale = decode_pod("decode-0", "uid-a")
    gw.store["Pod", "ml", "decode-0"] = stale
    outcome = run(gw, doc, [pod_view(stale)])
    assert outcome.status_doc["pendingPods"] == 1


def test_no_pod_listing_when_nothing_is_pending():
    gw = FakeGateway()
    doc = body({"storage": None})
    ok = decode_pod("decode-0", "uid-a", config_hash(parse_tpc(doc), CTX))
    run(gw, doc, [pod_view(ok)])
    assert not [c for c in gw.calls if c[:2] == ("list", "Pod")]


# ----------------------------------------------------------- the gateway

class FlakyApi:
    def __init__(self, statuses):
        self.statuses = list(statuses)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        status = self.statuses.pop(0)
        if status == 200:
            class Response:
                data = b'{"ok": true}'
            return Response()
        raise ApiException(status=status, reason="X")


def make_gateway():
    from kubernetes import client

    return Gateway(client.ApiClient(client.Configuration(host="http://127.0.0.1:1")),
                   retries=3, backoff=0, sleep=lambda s: None)


# The gateway tests build the kubernetes client's API classes: seconds of imports a worker.
@pytest.mark.parametrize("status", [409, 429, 500, 503])
@pytest.mark.slow
def test_gateway_retries_conflicts_and_server_errors(status):
    api = FlakyApi([status, status, 200])
    assert make_gateway()._call("x", api) == {"ok": True}
    assert api.calls == 3


@pytest.mark.slow
def test_gateway_gives_up_as_retryable():
    with pytest.raises(RetryableError):
        make_gateway()._call("x", FlakyApi([500] * 4))


@pytest.mark.slow
def test_gateway_does_not_retry_a_client_error():
    api = FlakyApi([422, 200])
    with pytest.raises(ApiRejected) as err:
        make_gateway()._call("x", api)
    assert err.value.status == 422 and api.calls == 1


@pytest.mark.slow
def test_gateway_create_conflict_is_not_retried():
    api = FlakyApi([409, 200])
    with pytest.raises(ApiRejected):
        make_gateway()._call("x", api, creating=True)
    assert api.calls == 1


def test_contains_compares_what_we_own():
    live = {"a": 1, "b": {"c": [1, {"d": 2, "server": 3}]}, "status": {}}
    assert contains(live, {"b": {"c": [1, {"d": 2}]}})
    assert not contains(live, {"b": {"c": [1]}})
    assert not contains(live, {"a": 2})


def test_operator_config_from_env():
    from kvtier_operator.app import config_from_env

    old_name = config_from_env({"KVTIER_SIDECAR_IMAGE": "r/old:1"})
    assert old_name.render.offload_image == "r/old:1"  # the deprecated name still works
    cfg = config_from_env({"KVTIER_OFFLOAD_IMAGE": "r/s:1", "KVTIER_OPERATOR_IMAGE": "r/o:1",
                           "KVTIER_DRIFT_INTERVAL_SECONDS": "30"})
    assert (cfg.render.offload_image, cfg.render.evictor_image) == ("r/s:1", "r/o:1")
    assert cfg.drift_interval == 30.0
    assert parse_tpc(tpc_doc())  # sanity: the fixtures parse


def test_a_deprecated_field_name_is_reconciled_alike_and_reported_as_a_warning_event():
    old = run(FakeGateway(), body({"cpu": None, "storage": {"stagingSize": "2Gi"}}))
    new = run(FakeGateway(), body({"cpu": None, "storage": {"hostStagingSize": "2Gi"}}))
    assert old.status_doc["configHash"] == new.status_doc["configHash"]
    assert ("Warning", "DeprecatedField", "spec.storage.stagingSize is deprecated: rename it "
            "hostStagingSize (the same setting)") in old.events
    assert not [e for e in new.events if e[1] == "DeprecatedField"]
