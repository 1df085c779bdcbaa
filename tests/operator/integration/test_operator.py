"""The operator end to end against kmock: real kopf, real HTTP, real client."""

from __future__ import annotations

import asyncio
import copy

import pytest
from kmock import resource

from kvtier_evictor.report import EvictionReport, Usage
from kvtier_operator import names
from kvtier_operator.render.pod import config_hash
from kvtier_operator.validation import parse_tpc
from tests.helpers import tpc_doc
from tests.operator.integration.harness import (
    CTX,
    TPC,
    condition,
    obj,
    operator,
    reconciles,
    setup,
    until,
)

pytestmark = pytest.mark.timeout(120)
NS = "ml"


def cache(spec=None, name="cache", uid="uid-1"):
    doc = tpc_doc(spec, name=name, namespace=NS)
    doc["metadata"]["uid"] = uid
    doc["metadata"]["generation"] = 1
    return doc


def seed(kmock, doc):
    kmock.objects[TPC, doc["metadata"]["namespace"], doc["metadata"]["name"]] = copy.deepcopy(doc)


def tpc_obj(kmock, name="cache"):
    return obj(kmock, TPC, NS, name)


def pvc(kmock, name="cache-kv-cache"):
    return obj(kmock, "v1/persistentvolumeclaims", NS, name)


def cronjob(kmock, name="cache-evictor"):
    return obj(kmock, "batch/v1/cronjobs", NS, name)


def configmap(kmock, name="cache-router"):
    return obj(kmock, "v1/configmaps", NS, name)


async def test_create_applies_objects_and_reports_status(kmock):
    setup(kmock)
    seed(kmock, cache({"router": {"enabled": True}}))
    async with operator(kmock):
        status = await until(lambda: tpc_obj(kmock)["status"]["conditions"], what="status")
        claim = await until(lambda: pvc(kmock), what="pvc")
        cj = await until(lambda: cronjob(kmock), what="cronjob")
        cm = await until(lambda: configmap(kmock), what="configmap")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "ownerReferences" not in claim["metadata"]  # Retain: the claim outlives the CR
    assert cj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert "lruCapacityPerServer: 25600" in cm["data"]["tiered-prefix-cache-plugins.yaml"]
    body = tpc_obj(kmock)
    st = body["status"]
    assert [c["type"] for c in status] == ["Ready", "StorageReady", "Injected", "EvictorHealthy",
                                         "PrerequisitesReady", "EngineVersion",
                                         "MetricsReadable", "TiersEffective"]
    # the observer runs, but no pod has an address yet: nothing read, no zeros written
    assert condition(body, "MetricsReadable")["status"] == "Unknown"
    assert "tiers" not in st or not st["tiers"]
    assert all(c["observedGeneration"] == 1 for c in st["conditions"])
    assert condition(body, "StorageReady")["reason"] == "ClaimPending"  # no binder in kmock
    assert condition(body, "Ready")["status"] == "False"
    assert condition(body, "EvictorHealthy")["reason"] == "NoRunYet"
    assert st["pvc"]["name"] == "cache-kv-cache"
    assert st["configHash"] == config_hash(parse_tpc(cache({"router": {"enabled": True}})), CTX)
    assert not any(k.startswith("kopf.zalando.org") for k in body["metadata"].get("annotations", {}))
    assert "finalizers" not in body["metadata"] or not body["metadata"]["finalizers"]


async def test_spec_update_changes_objects_and_removes_unwanted_ones(kmock):
    setup(kmock)
    seed(kmock, cache({"router": {"enabled": True}}))
    async with operator(kmock):
        await until(lambda: configmap(kmock), what="configmap")
        await until(lambda: cronjob(kmock), what="cronjob")
        updated = copy.deepcopy(tpc_obj(kmock))
        updated["spec"]["eviction"] = {"schedule": "*/9 * * * *"}
        updated["spec"]["router"] = {"enabled": False}
        updated["metadata"]["generation"] = 2
        await kmock.patch(f"/apis/{TPC}/".replace("/v1alpha1/", "/v1alpha1/namespaces/" + NS + "/") + "cache",
                          json={"spec": updated["spec"], "metadata": {"generation": 2}},
                          headers={"Content-Type": "application/merge-patch+json"})
        await until(lambda: cronjob(kmock)["spec"]["schedule"] == "*/9 * * * *", what="schedule")
        await until(lambda: configmap(kmock) is None, what="configmap deleted")
        await until(lambda: condition(tpc_obj(kmock), "Ready")["observedGeneration"] == 2,
                    what="generation 2 observed")


async def test_renamed_router_configmap_replaces_the_old_one(kmock):
    setup(kmock)
    seed(kmock, cache({"router": {"enabled": True}}))
    async with operator(kmock):
        ours = await until(lambda: configmap(kmock), what="configmap")
        foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": "hand-made", "namespace": NS, "labels": ours["metadata"]["labels"]}}
        kmock.objects["v1/configmaps", NS, "hand-made"] = foreign
        await kmock.patch(f"/apis/kvtier.dev/v1alpha1/namespaces/{NS}/tieredprefixcaches/cache",
                          json={"spec": {"router": {"enabled": True, "configMapName": "epp"}},
                                "metadata": {"generation": 2}},
                          headers={"Content-Type": "application/merge-patch+json"})
        await until(lambda: configmap(kmock, "epp"), what="the new configmap")
        await until(lambda: configmap(kmock) is None, what="the old one deleted")
    assert configmap(kmock, "hand-made") == foreign  # labelled as ours, owned by no cache


async def test_drift_is_repaired_and_claims_never_shrink(kmock):
    setup(kmock)
    seed(kmock, cache())
    async with operator(kmock, drift_interval=0.3):
        await until(lambda: cronjob(kmock), what="cronjob")
        claim = await until(lambda: pvc(kmock), what="pvc")
        await kmock.delete(f"/apis/batch/v1/namespaces/{NS}/cronjobs/cache-evictor")
        await until(lambda: cronjob(kmock) is None, what="cronjob gone")
        await until(lambda: cronjob(kmock), what="cronjob recreated by the drift loop")
        # someone grew the claim beyond the spec: kvtier must not shrink it back
        claim["spec"]["resources"]["requests"]["storage"] = "2Ti"
        await kmock.patch(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/cache-kv-cache",
                          json={"spec": {"resources": {"requests": {"storage": "2Ti"}}}},
                          headers={"Content-Type": "application/merge-patch+json"})
        await until(lambda: "kvtier never shrinks a claim" in condition(
            tpc_obj(kmock), "StorageReady")["message"], what="note")
        await reconciles(kmock)
        assert pvc(kmock)["spec"]["resources"]["requests"]["storage"] == "2Ti"


async def test_claim_grows_with_the_spec(kmock):
    setup(kmock)
    seed(kmock, cache())
    async with operator(kmock, drift_interval=0.3):
        await until(lambda: pvc(kmock), what="pvc")
        await kmock.patch(f"/apis/kvtier.dev/v1alpha1/namespaces/{NS}/tieredprefixcaches/cache",
                          json={"spec": {"storage": {"pvc": {"size": "3Ti"}}}},
                          headers={"Content-Type": "application/merge-patch+json"})
        await until(lambda: pvc(kmock)["spec"]["resources"]["requests"]["storage"] == "3Ti",
                    what="claim grown")


async def test_pvc_pending_then_bound(kmock):
    setup(kmock)
    seed(kmock, cache())
    kmock.objects["v1/events", NS, "pvc-event"] = {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": "pvc-event", "namespace": NS},
        "involvedObject": {"kind": "PersistentVolumeClaim", "name": "cache-kv-cache"},
        "reason": "ProvisioningFailed", "message": "storageclass.storage.k8s.io \"lustre\" not found",
        "lastTimestamp": "2026-11-22T00:00:00Z", "type": "Warning"}
    async with operator(kmock, drift_interval=0.3):
        await until(lambda: pvc(kmock), what="pvc")
        pending = await until(lambda: condition(tpc_obj(kmock), "StorageReady"), what="cond")
        assert pending["status"] == "False"
        assert "ProvisioningFailed" in pending["message"] and "lustre" in pending["message"]
        await kmock.patch(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/cache-kv-cache",
                          json={"status": {"phase": "Bound", "capacity": {"storage": "1Ti"}}},
                          headers={"Content-Type": "application/merge-patch+json"})
        bound = await until(lambda: condition(tpc_obj(kmock), "StorageReady")["status"] == "True"
                            and condition(tpc_obj(kmock), "StorageReady"), what="bound")
        assert bound["reason"] == "Bound"
        assert bound["lastTransitionTime"] >= pending["lastTransitionTime"]
        st = tpc_obj(kmock)["status"]
        assert st["pvc"] == {"name": "cache-kv-cache", "phase": "Bound", "capacity": "1Ti"}
        await until(lambda: condition(tpc_obj(kmock), "Ready")["status"] == "True", what="ready")


async def test_existing_claim_is_never_touched(kmock):
    setup(kmock)
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "mine", "namespace": NS, "labels": {"team": "a"}},
             "spec": {"accessModes": ["ReadWriteMany"],
                      "resources": {"requests": {"storage": "5Ti"}}},
             "status": {"phase": "Bound", "capacity": {"storage": "5Ti"}}}
    kmock.objects["v1/persistentvolumeclaims", NS, "mine"] = copy.deepcopy(claim)
    seed(kmock, cache({"storage": {"pvc": None, "existingClaim": "mine"}}))
    async with operator(kmock):
        await until(lambda: condition(tpc_obj(kmock), "StorageReady")["status"] == "True",
                    what="bound")
        assert cronjob(kmock)["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"][0][
            "persistentVolumeClaim"]["claimName"] == "mine"
    assert pvc(kmock, "mine") == claim
    writes = [r for r in kmock._requests if "persistentvolumeclaims" in str(r.url)
              and r.method.upper() in ("POST", "PATCH", "PUT", "DELETE")]
    assert writes == []


async def test_missing_existing_claim_is_reported(kmock):
    setup(kmock)
    seed(kmock, cache({"storage": {"pvc": None, "existingClaim": "nope"}}))
    async with operator(kmock):
        cond = await until(lambda: condition(tpc_obj(kmock), "StorageReady"), what="cond")
    assert cond["reason"] == "ClaimNotFound" and "nope" in cond["message"]


VLLM = {"name": "vllm", "image": "x", "command": ["vllm", "serve", "m"]}


def _pod(name, labels, annotations=None, phase="Running", container=VLLM):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels,
                         "annotations": annotations or {}},
            "spec": {"containers": [container]}, "status": {"phase": phase}}


async def test_injected_and_pending_pods_are_counted(kmock):
    setup(kmock)
    doc = cache()
    seed(kmock, doc)
    digest = config_hash(parse_tpc(doc), CTX)
    decode = {"llm-d.ai/role": "decode"}
    current = {names.ANNOTATION_CACHE: "cache", names.ANNOTATION_CONFIG_HASH: digest}
    stale = {names.ANNOTATION_CACHE: "cache", names.ANNOTATION_CONFIG_HASH: "0000"}
    pods = [_pod("a", decode, current), _pod("b", decode, current), _pod("c", decode, stale),
            _pod("d", decode), _pod("e", {"llm-d.ai/role": "prefill"}),
            _pod("f", {**decode, names.LABEL_OPT_OUT: "false"}),
            _pod("g", decode, current, phase="Succeeded"),
            # selected, but no engine runs in it (audit v2 N2): not the cache's to count
            _pod("h", decode, container={"name": "db", "image": "postgres:16"})]
    for p in pods:
        kmock.objects["v1/pods", NS, p["metadata"]["name"]] = p
    async with operator(kmock):
        st = await until(lambda: tpc_obj(kmock)["status"].get("injectedPods") is not None
                         and tpc_obj(kmock)["status"], what="status")
    assert (st["injectedPods"], st["pendingPods"]) == (2, 2)
    injected = condition(tpc_obj(kmock), "Injected")
    assert injected["reason"] == "PodsPending" and "c, d" in injected["message"]


async def test_evictor_report_becomes_status(kmock):
    setup(kmock)
    seed(kmock, cache())
    report = EvictionReport(outcome="freed", files_deleted=1200, bytes_freed=5 << 30,
                            usage_before=Usage(90, 100, 0, 0), usage_after=Usage(68, 100, 0, 0),
                            duration_seconds=4.2, temp_files_reaped=3)
    kmock.objects["v1/pods", NS, "cache-evictor-29000-x"] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cache-evictor-29000-x", "namespace": NS,
                     "labels": {names.LABEL_CACHE: "cache", names.LABEL_COMPONENT: "evictor",
                                "job-name": "cache-evictor-29000"}},
        "spec": {"containers": [{"name": "evictor", "image": "x"}]},
        "status": {"phase": "Succeeded", "containerStatuses": [{
            "name": "evictor", "state": {"terminated": {
                "exitCode": 0, "finishedAt": "2026-11-22T07:00:00Z",
                "message": report.to_json()}}}]}}
    async with operator(kmock):
        st = await until(lambda: tpc_obj(kmock)["status"].get("lastEviction"), what="eviction")
    assert st["outcome"] == "freed" and st["filesDeleted"] == 1200
    assert st["job"] == "cache-evictor-29000" and st["time"] == "2026-11-22T07:00:00Z"
    body = tpc_obj(kmock)
    assert body["status"]["usage"]["percent"] == 68.0
    assert condition(body, "EvictorHealthy")["status"] == "True"


async def test_unreadable_evictor_report_is_a_condition(kmock):
    setup(kmock)
    seed(kmock, cache())
    kmock.objects["v1/pods", NS, "cache-evictor-1-y"] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cache-evictor-1-y", "namespace": NS,
                     "labels": {names.LABEL_CACHE: "cache", names.LABEL_COMPONENT: "evictor"}},
        "spec": {"containers": [{"name": "evictor", "image": "x"}]},
        "status": {"phase": "Failed", "containerStatuses": [{"name": "evictor", "state": {
            "terminated": {"exitCode": 137, "finishedAt": "2026-11-22T07:00:00Z",
                           "message": "Traceback (most recent call last): OOMKilled"}}}]}}
    async with operator(kmock):
        cond = await until(lambda: condition(tpc_obj(kmock), "EvictorHealthy"), what="cond")
    assert cond["status"] == "False" and cond["reason"] == "ReportUnreadable"


def collect_garbage(kmock, uid):
    """What the garbage collector does (kmock has none): delete every object owned by uid."""
    gone = []
    for resource_name in ("v1/persistentvolumeclaims", "v1/configmaps", "batch/v1/cronjobs"):
        for name in ("cache-kv-cache", "cache-router", "cache-evictor"):
            found = obj(kmock, resource_name, NS, name)
            refs = (found or {}).get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                gone.append((resource_name, name))
    return gone


async def test_delete_leaves_cleanup_to_owner_references(kmock):
    setup(kmock)
    seed(kmock, cache({"router": {"enabled": True}}))
    async with operator(kmock, drift_interval=0.3):
        await until(lambda: configmap(kmock) and cronjob(kmock) and pvc(kmock), what="objects")
        await kmock.delete(f"/apis/kvtier.dev/v1alpha1/namespaces/{NS}/tieredprefixcaches/cache")
        await until(lambda: tpc_obj(kmock) is None, what="gone at once: no finalizer holds it")
        await asyncio.sleep(1.0)  # a reconcile in flight at deletion may still apply objects
        owned = collect_garbage(kmock, "uid-1")
        for resource_name, name in owned:
            await kmock.delete(f"/api{'s/batch' if 'batch' in resource_name else ''}/v1/"
                               f"namespaces/{NS}/{resource_name.rsplit('/', 1)[1]}/{name}")
        await asyncio.sleep(1.0)  # the drift loop must not bring anything back
    assert sorted(n for _, n in owned) == ["cache-evictor", "cache-router"]
    assert cronjob(kmock) is None and configmap(kmock) is None
    assert pvc(kmock) is not None  # Retain: the cached KV survives the resource


async def test_server_errors_are_retried(kmock):
    setup(kmock)
    kmock["post", resource("batch/v1/cronjobs")][:2] << 500
    kmock["get", resource("v1/persistentvolumeclaims")][:3] << 503
    seed(kmock, cache())
    async with operator(kmock):
        await until(lambda: cronjob(kmock), what="cronjob after 500s")
        await until(lambda: condition(tpc_obj(kmock), "StorageReady"), what="status after 503s")


async def test_rejected_object_becomes_a_condition_and_others_go_on(kmock):
    setup(kmock)
    message = 'CronJob.batch "cache-evictor" is invalid: spec.schedule: Invalid value'
    kmock["post", resource("batch/v1/cronjobs")] << 422 << {
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 422,
        "reason": "Invalid", "message": message}
    seed(kmock, cache())
    seed(kmock, cache({"storage": None}, name="other", uid="uid-2"))

    def reported() -> list[dict]:
        # Every EvictorHealthy the operator wrote, from the requests themselves: kmock
        # stores a POSTed object even when a reaction refuses it, so a later reconcile
        # finds the CronJob and moves on (NoRunYet) before a poll of the object may look.
        return [c for r in kmock if r.method == "PATCH" and isinstance(r.data, dict)
                and "/tieredprefixcaches/cache" in str(r.url)
                for c in ((r.data.get("status") or {}).get("conditions") or [])
                if c.get("type") == "EvictorHealthy"]

    async with operator(kmock):
        cond = (await until(reported, what="cond"))[0]
        other = await until(lambda: condition(tpc_obj(kmock, "other"), "Ready"), what="other")
    assert cond["status"] == "False" and cond["reason"] == "CronJobRejected"
    assert message in cond["message"]
    assert pvc(kmock) is not None  # the rest of the reconcile still happened
    assert other["status"] == "True"


async def test_invalid_spec_becomes_a_condition(kmock):
    setup(kmock)
    doc = cache()
    doc["spec"]["eviction"] = {"highWatermark": 50, "lowWatermark": 60}
    seed(kmock, doc)
    async with operator(kmock):
        cond = await until(lambda: condition(tpc_obj(kmock), "Ready"), what="cond")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.eviction: lowWatermark 60 must be below highWatermark 50" in cond["message"]
    assert cronjob(kmock) is None and pvc(kmock) is None


async def test_webhook_conflicts_become_the_injected_condition(kmock):
    from kvtier_demo import sandbox
    from kvtier_operator.handlers import OperatorConfig
    from kvtier_operator.webhook import mutate_pod

    setup(kmock)
    doc = cache({"storage": None})
    seed(kmock, doc)
    pod = _pod("decode-0", {"llm-d.ai/role": "decode"})
    pod["spec"]["containers"][0]["command"] = ["vllm", "serve", "m", "--kv-transfer-config", "{}"]
    kmock.objects["v1/pods", NS, "decode-0"] = pod
    config = OperatorConfig(render=CTX, drift_interval=0.2)
    async with sandbox.operator(kmock, CTX, config=config):
        await until(lambda: config.caches.in_namespace(NS), what="the webhook's view")
        review = {"kind": "AdmissionReview", "request": {"uid": "u", "operation": "CREATE",
                                                         "namespace": NS, "object": pod}}
        answer = mutate_pod(review, config.caches, config.conflicts, CTX)
        assert "patch" not in answer["response"]
        cond = await until(lambda: (lambda c: c if c and c["reason"] == "Conflict" else None)(
            condition(tpc_obj(kmock), "Injected")), what="Conflict condition")
    assert cond["status"] == "False"
    assert "pod decode-0: container 'vllm' already passes --kv-transfer-config" in cond["message"]
    assert condition(tpc_obj(kmock), "Ready")["reason"] == "Conflict"


async def test_drift_loop_runs_from_startup_before_any_cache_event(kmock):
    """The drift loop starts with the operator, not with the first handled resource: a
    cache the registry knows is repaired even when no handler has run yet."""
    from kvtier_demo import sandbox
    from kvtier_operator.handlers import OperatorConfig

    setup(kmock)
    config = OperatorConfig(render=CTX, drift_interval=0.1)
    config.caches.observe("ADDED", cache(name="known"))  # no such object on the server

    def drift_reads():
        return [r for r in list(kmock._requests) if r.method.upper() == "GET"
                and str(r.url).endswith("/tieredprefixcaches/known")]

    async with sandbox.operator(kmock, CTX, config=config):
        await until(drift_reads, what="the drift loop reading the known cache")
