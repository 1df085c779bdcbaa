"""Owned objects converge to the render over real HTTP: a field the spec drops leaves the
live object, while what other parties wrote stays."""

from __future__ import annotations

import asyncio
import copy

import pytest

from tests.helpers import tpc_doc
from tests.operator.integration.harness import TPC, gateway_for, obj, operator, setup, until

pytestmark = pytest.mark.timeout(120)
NS = "ml"
MERGE = {"Content-Type": "application/merge-patch+json"}


def cache(spec):
    doc = tpc_doc(spec, name="cache", namespace=NS)
    doc["metadata"].update(uid="uid-1", generation=1)
    return doc


def pod_security(kmock):
    cj = obj(kmock, "batch/v1/cronjobs", NS, "cache-evictor")
    return cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["securityContext"]


async def patch_cache(kmock, spec, generation):
    await kmock.patch(f"/apis/kvtier.dev/v1alpha1/namespaces/{NS}/tieredprefixcaches/cache",
                      json={"spec": spec, "metadata": {"generation": generation}}, headers=MERGE)


async def test_removed_fs_group_leaves_the_cronjob_and_foreign_fields_stay(kmock):
    setup(kmock)
    kmock.objects[TPC, NS, "cache"] = copy.deepcopy(cache({"eviction": {"fsGroup": 2000}}))
    async with operator(kmock):
        await until(lambda: pod_security(kmock).get("fsGroup") == 2000, what="fsGroup")
        # another party labels and annotates kvtier's CronJob
        await kmock.patch(f"/apis/batch/v1/namespaces/{NS}/cronjobs/cache-evictor", headers=MERGE,
                          json={"metadata": {"labels": {"team": "infra"},
                                             "annotations": {"audit": "ok"}}})
        await patch_cache(kmock, {"eviction": {"fsGroup": None, "schedule": "*/7 * * * *"}}, 2)
        await until(lambda: "fsGroup" not in pod_security(kmock), what="fsGroup removed")
    security = pod_security(kmock)
    assert "fsGroupChangePolicy" not in security
    assert security["runAsUser"] == 65532
    meta = obj(kmock, "batch/v1/cronjobs", NS, "cache-evictor")["metadata"]
    assert meta["labels"]["team"] == "infra"
    assert meta["annotations"]["audit"] == "ok"


async def test_gateway_removes_a_configmap_key_it_no_longer_renders(kmock):
    setup(kmock)
    gw = gateway_for(kmock)
    first = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "cm", "namespace": NS, "labels": {"app": "kvtier"}},
             "data": {"plugins.yaml": "a", "old.yaml": "b"}}
    action, _ = await asyncio.to_thread(gw.ensure, first)
    assert action == "created"
    await kmock.patch(f"/api/v1/namespaces/{NS}/configmaps/cm", headers=MERGE,
                      json={"metadata": {"labels": {"team": "infra"}}, "data": {"theirs": "c"}})
    second = copy.deepcopy(first)
    del second["data"]["old.yaml"]
    action, _ = await asyncio.to_thread(gw.ensure, second)
    assert action == "updated"
    live = obj(kmock, "v1/configmaps", NS, "cm")
    assert live["data"] == {"plugins.yaml": "a", "theirs": "c"}
    assert live["metadata"]["labels"] == {"app": "kvtier", "team": "infra"}
    action, _ = await asyncio.to_thread(gw.ensure, second)
    assert action == "unchanged"


async def test_an_object_kvtier_merge_patched_is_handed_over_to_server_side_apply(kmock):
    """The one-time hand-over over HTTP: a ConfigMap as kvtier before server-side apply left
    it (created and merge-patched by manager kvtier-operator, operation Update, its record
    in the kvtier.dev/applied-fields annotation) converges to the render: the key it no
    longer renders and the annotation leave, the key someone else wrote stays."""
    setup(kmock)
    gw = gateway_for(kmock)
    old_fields = {"f:metadata": {"f:labels": {"f:app": {}}, "f:annotations": {
        "f:kvtier.dev/applied-fields": {}}}, "f:data": {"f:plugins.yaml": {}, "f:old.yaml": {}}}
    kmock.objects["v1/configmaps", NS, "cm"] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "cm", "namespace": NS, "resourceVersion": "7",
                     "labels": {"app": "kvtier"},
                     "annotations": {"kvtier.dev/applied-fields": '{"data": {}}'},
                     "managedFields": [
                         {"manager": "kvtier-operator", "operation": "Update",
                          "apiVersion": "v1", "fieldsType": "FieldsV1", "fieldsV1": old_fields},
                         {"manager": "someone", "operation": "Update", "apiVersion": "v1",
                          "fieldsType": "FieldsV1", "fieldsV1": {"f:data": {"f:theirs": {}}}}]},
        "data": {"plugins.yaml": "a", "old.yaml": "b", "theirs": "c"}}
    render = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "cm", "namespace": NS, "labels": {"app": "kvtier"}},
              "data": {"plugins.yaml": "a"}}
    action, _ = await asyncio.to_thread(gw.ensure, render)
    assert action == "updated"
    live = obj(kmock, "v1/configmaps", NS, "cm")
    assert live["data"] == {"plugins.yaml": "a", "theirs": "c"}
    assert "kvtier.dev/applied-fields" not in (live["metadata"].get("annotations") or {})
    ours = [(e["manager"], e["operation"]) for e in live["metadata"]["managedFields"]]
    assert sorted(ours) == [("kvtier-operator", "Apply"), ("someone", "Update")]
    action, _ = await asyncio.to_thread(gw.ensure, render)
    assert action == "unchanged"
