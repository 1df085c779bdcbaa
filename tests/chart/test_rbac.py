"""The chart's ClusterRole grants every API call the operator makes, and nothing is
guessed: the calls are recorded from the real operator driven through all its paths
(create, update, drift, growth, removal, rollout, evictor reports) against kmock."""

from __future__ import annotations

import asyncio
import copy
import subprocess

import pytest
import yaml

from kvtier_operator.render.pod import config_hash
from kvtier_operator.validation import parse_tpc
from tests.chart.test_chart import CHART, HELM
from tests.helpers import tpc_doc
from tests.operator.integration.harness import CTX, TPC, obj, operator, setup, until
from tests.operator.integration.test_rollout import finish, restarted, seed_world

pytestmark = [pytest.mark.helm, pytest.mark.timeout(180),
              pytest.mark.skipif(not HELM.exists(), reason="run `make test` to unpack helm")]
NS = "ml"


def api_call(method: str, path: str, query: dict) -> tuple[str, str, str] | None:
    """(verb, apiGroup, resource[/subresource]) of a request, or None for discovery."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 1:
        group, rest = parts[1], parts[3:]
    else:
        return None  # /version and other non-resource URLs
    if not rest:
        return None  # discovery
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, \
        rest[2] if len(rest) > 2 else None
    method = method.upper()
    if method == "GET":
        verb = "get" if name else "watch" if query.get("watch") in ("true", "1") else "list"
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update",
                "DELETE": "delete" if name else "deletecollection"}[method]
    return verb, group, f"{resource}/{sub}" if sub else resource


def granted() -> set[tuple[str, str, str]]:
    out = subprocess.run([str(HELM), "template", "rel", str(CHART), "-s",
                          "templates/rbac.yaml"], capture_output=True, text=True, check=True)
    role = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ClusterRole")
    return {(verb, group, resource) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def namespace_of(path: str) -> str | None:
    parts = [p for p in path.split("/") if p]
    return parts[parts.index("namespaces") + 1] if "namespaces" in parts[:-1] else None


def rendered_rules(*sets: str) -> dict[str | None, set[tuple[str, str, str]]]:
    """The chart's grants per namespace (None: cluster-wide), as (verb, group, resource)."""
    args = [str(HELM), "template", "rel", str(CHART), "-s", "templates/rbac.yaml"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    grants: dict[str | None, set[tuple[str, str, str]]] = {}
    for doc in yaml.safe_load_all(out.stdout):
        if doc and doc["kind"] in ("ClusterRole", "Role"):
            where = doc["metadata"].get("namespace") if doc["kind"] == "Role" else None
            grants.setdefault(where, set()).update(
                (verb, group, resource) for rule in doc["rules"] for group in rule["apiGroups"]
                for resource in rule["resources"] for verb in rule["verbs"])
    return grants


async def drive(kmock, namespaces: list[str] | None = None) -> None:
    """Every operator path that talks to the API."""
    seed_world(kmock, "Auto")  # deployments, replicasets, statefulsets, a leaderworkerset
    doc = tpc_doc({"router": {"enabled": True}, "rollout": "Auto"}, name="cache", namespace=NS)
    doc["metadata"].update(uid="u-1", generation=1)
    kmock.objects[TPC, NS, "cache"] = doc
    kmock.objects["v1/pods", NS, "cache-evictor-1-x"] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cache-evictor-1-x", "namespace": NS,
                     "labels": {"kvtier.dev/cache": "cache", "kvtier.dev/component": "evictor"}},
        "spec": {"containers": [{"name": "evictor", "image": "x"}]},
        "status": {"phase": "Succeeded", "containerStatuses": [{"name": "evictor", "state": {
            "terminated": {"exitCode": 0, "finishedAt": "2026-11-22T07:00:00Z",
                           "message": '{"outcome": "freed"}'}}}]}}
    sts = copy.deepcopy(obj(kmock, "apps/v1/statefulsets", NS, "gamma-0"))
    sts["metadata"]["name"] = "delta"
    sts["metadata"].pop("ownerReferences")
    kmock.objects["apps/v1/statefulsets", NS, "delta"] = sts
    stale = copy.deepcopy(obj(kmock, "v1/pods", NS, "gamma-0-0"))
    stale["metadata"]["name"] = "delta-0"
    stale["metadata"]["ownerReferences"][0]["name"] = "delta"
    kmock.objects["v1/pods", NS, "delta-0"] = stale
    digest = config_hash(parse_tpc(doc), CTX)
    # A Mooncake cache: the operator checks its ConfigMap and master Service exist.
    # (Its SSD variant: the client DaemonSet too.)
    moon = tpc_doc({"selector": {"matchLabels": {"app": "moon"}}, "storage": None,
                    "connector": "mooncake-store", "mooncake": {
                        "configMapName": "mooncake-config",
                        "masterService": {"name": "mooncake-master", "namespace": "mooncake"},
                        "offload": {"clientDaemonSet": {"name": "mooncake-client",
                                                        "namespace": "mooncake"}}}},
                   name="moon", namespace=NS)
    moon["metadata"].update(uid="u-2", generation=1)
    kmock.objects[TPC, NS, "moon"] = moon
    async with operator(kmock, drift_interval=0.2, namespaces=namespaces):
        await until(lambda: any(c["reason"] == "PrerequisitesMissing" for c in (
            obj(kmock, TPC, NS, "moon").get("status") or {}).get("conditions", [])),
            what="moon prerequisites checked")
        await until(lambda: obj(kmock, "v1/configmaps", NS, "cache-router"), what="router")
        for name, pod in (("alpha", "alpha-5d8f-0"), ("beta", "beta-5d8f-0")):
            await until(lambda n=name: restarted(kmock, "apps/v1/deployments", n) == digest,
                        what=f"{name} restarted")
            await finish(kmock, pod, digest)
        await until(lambda: restarted(kmock, "leaderworkerset.x-k8s.io/v1/leaderworkersets",
                                      "gamma") == digest, what="gamma restarted")
        await finish(kmock, "gamma-0-0", digest)
        await until(lambda: restarted(kmock, "apps/v1/statefulsets", "delta") == digest,
                    what="delta restarted")
        path = f"/apis/kvtier.dev/v1alpha1/namespaces/{NS}/tieredprefixcaches/cache"
        headers = {"Content-Type": "application/merge-patch+json"}
        await kmock.patch(path, json={"spec": {"storage": {"pvc": {"size": "2Ti"}}}},
                          headers=headers)
        await until(lambda: obj(kmock, "v1/persistentvolumeclaims", NS, "cache-kv-cache")[
            "spec"]["resources"]["requests"]["storage"] == "2Ti", what="growth")
        await kmock.patch(path, json={"spec": {"eviction": {"schedule": "*/7 * * * *"},
                                               "router": {"blockSize": 32}}}, headers=headers)
        await until(lambda: obj(kmock, "batch/v1/cronjobs", NS, "cache-evictor")["spec"][
            "schedule"] == "*/7 * * * *", what="cronjob updated")
        await until(lambda: "blockSizeTokens: 32" in obj(kmock, "v1/configmaps", NS,
                                                          "cache-router")["data"][
            "tiered-prefix-cache-plugins.yaml"], what="router config updated")
        await kmock.patch(path, json={"spec": {"storage": None, "router": {"enabled": False}}},
                          headers=headers)
        await until(lambda: obj(kmock, "batch/v1/cronjobs", NS, "cache-evictor") is None
                    and obj(kmock, "v1/configmaps", NS, "cache-router") is None, what="removal")
        await asyncio.sleep(0.5)


async def test_role_grants_every_call_the_operator_makes(kmock):
    setup(kmock)
    await drive(kmock)
    calls = set()
    for request in kmock._requests:
        if request.headers.get("User-Agent", "").startswith("kmock/"):
            continue  # the test playing controllers, not the operator
        call = api_call(str(request.method.value if hasattr(request.method, "value")
                            else request.method), request.url.path, dict(request.url.query))
        if call:
            calls.add(call)
    # the driver really exercised the paths the role is about
    for expected in [("create", "", "persistentvolumeclaims"), ("patch", "apps", "deployments"),
                     ("patch", "leaderworkerset.x-k8s.io", "leaderworkersets"),
                     ("delete", "batch", "cronjobs"), ("patch", "kvtier.dev",
                                                       "tieredprefixcaches/status"),
                     ("watch", "", "pods"), ("get", "apps", "replicasets"),
                     ("get", "apps", "daemonsets")]:
        assert expected in calls, expected
    missing = sorted(calls - granted())
    assert missing == [], f"the chart's ClusterRole lacks: {missing}"
    unused = sorted(granted() - calls)
    assert unused == [], f"the chart's ClusterRole grants what the operator never uses: {unused}"


def test_role_grants_nothing_on_secrets_or_writes_to_pods():
    role = granted()
    assert not [r for r in role if r[2] == "secrets"]
    assert not [r for r in role if r[2] == "pods" and r[0] not in ("list", "watch")]
    assert copy.deepcopy(role) == role


async def test_per_namespace_roles_grant_every_call_of_a_namespaced_operator(kmock):
    """watchNamespaces: the operator runs for its namespaces only, and every call it makes
    is granted where it makes it: in the watched namespace by its Role, in a reference
    namespace by the references Role, cluster-wide only by the CRD read (audit v2, N3)."""
    setup(kmock)
    await drive(kmock, namespaces=[NS])
    grants = rendered_rules(f"watchNamespaces={{{NS}}}", "referenceNamespaces={mooncake}")
    assert set(grants) == {NS, "mooncake"}  # nothing cluster-wide
    denied, seen = [], set()
    for request in kmock._requests:
        if request.headers.get("User-Agent", "").startswith("kmock/"):
            continue
        method = str(request.method.value if hasattr(request.method, "value")
                     else request.method)
        call = api_call(method, request.url.path, dict(request.url.query))
        if not call:
            continue
        where = namespace_of(request.url.path)
        seen.add((where, *call))
        if call not in grants.get(where, set()):
            denied.append((where, *call))
    assert ("mooncake", "get", "", "services") in seen  # the reference was looked up
    assert (NS, "patch", "apps", "deployments") in seen  # and the rollout ran
    assert denied == [], f"calls no Role or ClusterRole of this install grants: {denied}"
    cluster_scoped = sorted(c for c in seen if c[0] is None)
    assert cluster_scoped == [], f"a namespaced operator made cluster-wide calls: {cluster_scoped}"
