"""rollout: Auto restarts workloads of stale pods one at a time; Manual only reports."""

from __future__ import annotations

import pytest

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
DECODE = {"llm-d.ai/role": "decode"}
# The workload owner's opt-in to the cache's restarts, on the pod template and so the pods.
OPTED_IN = {**DECODE, names.LABEL_CACHE: "cache"}
VLLM = [{"name": "vllm", "image": "x", "command": ["vllm", "serve", "m"]}]
POSTGRES = [{"name": "db", "image": "postgres:16"}]


def doc(rollout):
    d = tpc_doc({"rollout": rollout, "storage": None}, name="cache", namespace=NS)
    d["metadata"].update(uid="u-1", generation=1)
    return d


def workload(kind, name, replicas=1, labels=OPTED_IN, containers=VLLM):
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": name, "namespace": NS, "generation": 1},
            "spec": {"replicas": replicas, "selector": {"matchLabels": DECODE},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": containers}}},
            "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": replicas,
                       "updatedReplicas": replicas, "currentRevision": "r1",
                       "updateRevision": "r1"}}


def pod(name, owner_kind, owner_name, annotations=None, labels=OPTED_IN, containers=VLLM):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels,
                         "annotations": annotations or {},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": owner_kind,
                                              "name": owner_name, "uid": f"{owner_name}-uid",
                                              "controller": True}]},
            "spec": {"containers": containers},
            "status": {"phase": "Running"}}


def restarted(kmock, resource, name):
    o = obj(kmock, resource, NS, name) or {}
    if resource.endswith("leaderworkersets"):
        t = o["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    else:
        t = o["spec"]["template"]
    return (t.get("metadata") or {}).get("annotations", {}).get(names.ANNOTATION_RESTARTED_AT)


def seed_world(kmock, rollout):
    setup(kmock)
    kmock.objects[TPC, NS, "cache"] = doc(rollout)
    for name in ("alpha", "beta"):
        kmock.objects["apps/v1/deployments", NS, name] = workload("Deployment", name)
        rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
              "metadata": {"name": f"{name}-5d8f", "namespace": NS,
                           "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                "name": name, "uid": f"{name}-uid",
                                                "controller": True}]},
              "spec": {"selector": {"matchLabels": DECODE}}}
        kmock.objects["apps/v1/replicasets", NS, f"{name}-5d8f"] = rs
        kmock.objects["v1/pods", NS, f"{name}-5d8f-0"] = pod(f"{name}-5d8f-0", "ReplicaSet",
                                                             f"{name}-5d8f")
    lws = workload("LeaderWorkerSet", "gamma")
    lws["apiVersion"] = "leaderworkerset.x-k8s.io/v1"
    lws["spec"] = {"replicas": 1, "leaderWorkerTemplate": {
        "workerTemplate": lws["spec"]["template"]}}
    kmock.objects["leaderworkerset.x-k8s.io/v1/leaderworkersets", NS, "gamma"] = lws
    sts = workload("StatefulSet", "gamma-0")
    sts["metadata"]["ownerReferences"] = [{"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                           "kind": "LeaderWorkerSet", "name": "gamma",
                                           "uid": "g", "controller": True}]
    kmock.objects["apps/v1/statefulsets", NS, "gamma-0"] = sts
    kmock.objects["v1/pods", NS, "gamma-0-0"] = pod("gamma-0-0", "StatefulSet", "gamma-0")


async def finish(kmock, old_pod, digest):
    """What the workload's controller would do: replace the pod with an injected one."""
    await kmock.delete(f"/api/v1/namespaces/{NS}/pods/{old_pod}")
    new = pod(old_pod + "-new", "ReplicaSet", "x",
              {names.ANNOTATION_CACHE: "cache", names.ANNOTATION_CONFIG_HASH: digest})
    kmock.objects["v1/pods", NS, old_pod + "-new"] = new


async def test_auto_restarts_one_workload_at_a_time(kmock):
    seed_world(kmock, "Auto")
    digest = config_hash(parse_tpc(doc("Auto")), CTX)
    deploy, lws = "apps/v1/deployments", "leaderworkerset.x-k8s.io/v1/leaderworkersets"
    async with operator(kmock, drift_interval=0.2):
        await until(lambda: restarted(kmock, deploy, "alpha") == digest, what="alpha restarted")
        await reconciles(kmock)  # several more: nothing else may start meanwhile
        assert restarted(kmock, deploy, "beta") is None
        assert restarted(kmock, lws, "gamma") is None
        cond = condition(obj(kmock, TPC, NS, "cache"), "Injected")
        assert cond["reason"] == "RollingOut" and "Deployment alpha" in cond["message"]
        await finish(kmock, "alpha-5d8f-0", digest)
        await until(lambda: restarted(kmock, deploy, "beta") == digest, what="beta restarted")
        await reconciles(kmock)
        assert restarted(kmock, lws, "gamma") is None
        await finish(kmock, "beta-5d8f-0", digest)
        await until(lambda: restarted(kmock, lws, "gamma") == digest, what="gamma restarted")
        leader = obj(kmock, lws, NS, "gamma")["spec"]["leaderWorkerTemplate"]
        assert leader["leaderTemplate"]["metadata"]["annotations"][
            names.ANNOTATION_RESTARTED_AT] == digest
        await finish(kmock, "gamma-0-0", digest)
        await until(lambda: condition(obj(kmock, TPC, NS, "cache"), "Injected")["status"]
                    == "True", what="all injected")


async def test_a_workload_still_rolling_blocks_restarts(kmock):
    seed_world(kmock, "Auto")
    busy = workload("Deployment", "alpha")
    busy["status"]["updatedReplicas"] = 0  # its own rollout is in progress
    kmock.objects["apps/v1/deployments", NS, "alpha"] = busy
    async with operator(kmock, drift_interval=0.2):
        cond = await until(lambda: condition(obj(kmock, TPC, NS, "cache"), "Injected"),
                           what="cond")
        await reconciles(kmock)
    assert "waiting for Deployment alpha" in cond["message"]
    assert restarted(kmock, "apps/v1/deployments", "beta") is None
    assert restarted(kmock, "apps/v1/deployments", "alpha") is None


async def test_manual_only_reports(kmock):
    seed_world(kmock, "Manual")
    async with operator(kmock, drift_interval=0.2):
        cond = await until(lambda: condition(obj(kmock, TPC, NS, "cache"), "Injected"),
                           what="cond")
        await reconciles(kmock)
    assert cond["reason"] == "PodsPending" and "3 selected pod(s)" in cond["message"]
    for resource, name in (("apps/v1/deployments", "alpha"), ("apps/v1/deployments", "beta"),
                           ("leaderworkerset.x-k8s.io/v1/leaderworkersets", "gamma")):
        assert restarted(kmock, resource, name) is None


async def test_a_deletion_the_watch_missed_does_not_hold_the_rollout(kmock):
    """kmock (like a real watch restarted across a deletion) can drop a DELETED event;
    kopf's index then keeps the pod. The server's own list decides."""
    seed_world(kmock, "Auto")
    for name in ("alpha", "beta"):
        del kmock.objects["apps/v1/deployments", NS, name]
        del kmock.objects["v1/pods", NS, f"{name}-5d8f-0"]
    digest = config_hash(parse_tpc(doc("Auto")), CTX)
    lws = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
    async with operator(kmock, drift_interval=0.2):
        await until(lambda: restarted(kmock, lws, "gamma") == digest, what="gamma restarted")
        kmock.objects["v1/pods", NS, "gamma-0-0"].delete()  # gone, and no event says so
        new = pod("gamma-0-0-new", "StatefulSet", "gamma-0",
                  {names.ANNOTATION_CACHE: "cache", names.ANNOTATION_CONFIG_HASH: digest})
        kmock.objects["v1/pods", NS, "gamma-0-0-new"] = new
        await until(lambda: condition(obj(kmock, TPC, NS, "cache"), "Injected")["reason"]
                    == "AllInjected", what="all injected")
    assert obj(kmock, TPC, NS, "cache")["status"]["pendingPods"] == 0


def add_deployment(kmock, name, labels, containers):
    """A Deployment with one ReplicaSet and one running pod, none of it injected."""
    kmock.objects["apps/v1/deployments", NS, name] = workload(
        "Deployment", name, labels=labels, containers=containers)
    kmock.objects["apps/v1/replicasets", NS, f"{name}-5d8f"] = {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": f"{name}-5d8f", "namespace": NS,
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                          "name": name, "uid": f"{name}-uid",
                                          "controller": True}]},
        "spec": {"selector": {"matchLabels": DECODE}}}
    kmock.objects["v1/pods", NS, f"{name}-5d8f-0"] = pod(
        f"{name}-5d8f-0", "ReplicaSet", f"{name}-5d8f", labels=labels, containers=containers)


async def test_auto_restarts_only_engine_workloads_whose_owner_opted_in(kmock):
    """Audit v2 N2: a cache author selecting a postgres Deployment, or a vLLM Deployment
    whose owner did not add the label, restarts neither; the postgres pod is not even
    counted, and the status names the label the vLLM workload's owner must add."""
    seed_world(kmock, "Auto")
    for name in ("beta",):
        del kmock.objects["apps/v1/deployments", NS, name]
        del kmock.objects["v1/pods", NS, f"{name}-5d8f-0"]
    del kmock.objects["leaderworkerset.x-k8s.io/v1/leaderworkersets", NS, "gamma"]
    del kmock.objects["v1/pods", NS, "gamma-0-0"]
    add_deployment(kmock, "db", OPTED_IN, POSTGRES)  # selected and labelled: no engine
    add_deployment(kmock, "legacy", DECODE, VLLM)  # an engine, but no opt-in
    # A pod labelled by hand, whose workload's template is not: still not restarted.
    add_deployment(kmock, "relabelled", DECODE, VLLM)
    kmock.objects["v1/pods", NS, "relabelled-5d8f-0"] = pod(
        "relabelled-5d8f-0", "ReplicaSet", "relabelled-5d8f", labels=OPTED_IN)
    digest = config_hash(parse_tpc(doc("Auto")), CTX)
    deploy = "apps/v1/deployments"
    async with operator(kmock, drift_interval=0.2):
        await until(lambda: restarted(kmock, deploy, "alpha") == digest, what="alpha restarted")
        await finish(kmock, "alpha-5d8f-0", digest)
        status = await until(lambda: (s := obj(kmock, TPC, NS, "cache")["status"])
                             and s.get("injectedPods") == 1 and s, what="alpha injected")
        await reconciles(kmock)
        cond = condition(obj(kmock, TPC, NS, "cache"), "Injected")
    assert cond["reason"] == "RollingOut", cond  # the hand-labelled pod's workload
    assert "Deployment relabelled" in cond["message"] and "are not restarted" in cond["message"]
    assert f"1 more lack the opt-in label {names.LABEL_CACHE}: cache" in cond["message"]
    for name in ("db", "legacy", "relabelled"):
        assert restarted(kmock, deploy, name) is None, name
    assert status["pendingPods"] == 2  # legacy and relabelled; db runs no engine


async def test_the_status_names_the_label_to_add(kmock):
    """The upgrade path: workloads from before the opt-in label are named, with the fix."""
    seed_world(kmock, "Auto")
    for name in ("alpha", "beta"):
        kmock.objects["apps/v1/deployments", NS, name] = workload("Deployment", name,
                                                                  labels=DECODE)
        kmock.objects["v1/pods", NS, f"{name}-5d8f-0"] = pod(
            f"{name}-5d8f-0", "ReplicaSet", f"{name}-5d8f", labels=DECODE)
    del kmock.objects["leaderworkerset.x-k8s.io/v1/leaderworkersets", NS, "gamma"]
    del kmock.objects["v1/pods", NS, "gamma-0-0"]
    async with operator(kmock, drift_interval=0.2):
        cond = await until(lambda: (c := condition(obj(kmock, TPC, NS, "cache"), "Injected"))
                           and c["reason"] == "RolloutNotOptedIn" and c, what="opt-in named")
        await reconciles(kmock)
    assert f"label {names.LABEL_CACHE}: cache" in cond["message"]
    assert "alpha-5d8f-0" in cond["message"] and "beta-5d8f-0" in cond["message"]
    for name in ("alpha", "beta"):
        assert restarted(kmock, "apps/v1/deployments", name) is None
