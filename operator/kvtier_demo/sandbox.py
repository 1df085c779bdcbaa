"""An in-process Kubernetes API (kmock) with the real operator: for `make demo` and tests.

kmock has no schema validation, defaulting, server-side apply, label selectors, garbage
collection or controllers; the tests cover those rules directly. Server-side apply is
emulated here (SandboxGateway, kvtier_demo/ssa.py): kmock 0.8 treats every PATCH body,
an apply configuration included, as a JSON merge patch, so a field kvtier stops
rendering would never leave. The emulation lives in the harness only; the operator's
gateway sends real server-side apply requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import kopf
from kmock import ResourceInfo
from kubernetes import client

from kvtier_demo import ssa
from kvtier_operator.context import RenderContext
from kvtier_operator.gateway import FIELD_MANAGER, Gateway
from kvtier_operator.handlers import OperatorConfig, register

CRUD = {"list", "watch", "get", "patch", "create", "delete", "update"}
RESOURCES = {
    "v1/namespaces": ResourceInfo(kind="Namespace", namespaced=False, verbs=CRUD),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=CRUD),
    "kvtier.dev/v1alpha1/tieredprefixcaches": ResourceInfo(
        kind="TieredPrefixCache", namespaced=True, verbs=CRUD, subresources={"status"}),
    "v1/pods": ResourceInfo(kind="Pod", namespaced=True, verbs=CRUD),
    "v1/persistentvolumeclaims": ResourceInfo(kind="PersistentVolumeClaim", namespaced=True,
                                              verbs=CRUD, subresources={"status"}),
    "v1/configmaps": ResourceInfo(kind="ConfigMap", namespaced=True, verbs=CRUD),
    "v1/events": ResourceInfo(kind="Event", namespaced=True, verbs=CRUD),
    "batch/v1/cronjobs": ResourceInfo(kind="CronJob", namespaced=True, verbs=CRUD),
    "batch/v1/jobs": ResourceInfo(kind="Job", namespaced=True, verbs=CRUD),
    "apps/v1/deployments": ResourceInfo(kind="Deployment", namespaced=True, verbs=CRUD),
    "apps/v1/statefulsets": ResourceInfo(kind="StatefulSet", namespaced=True, verbs=CRUD),
    "apps/v1/replicasets": ResourceInfo(kind="ReplicaSet", namespaced=True, verbs=CRUD),
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, verbs=CRUD),
}
TPC = "kvtier.dev/v1alpha1/tieredprefixcaches"


def setup(kmock: Any) -> None:
    for key, info in RESOURCES.items():
        kmock.resources[key] = info


class SandboxGateway(Gateway):
    """The operator's gateway, with server-side apply emulated over kmock's merge patch
    (see the module's docstring): everything else is the product's code."""

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        kind, ns, name = obj["kind"], meta["namespace"], meta["name"]
        live = self.get(kind, ns, name)
        result = ssa.apply(live, obj, FIELD_MANAGER)
        if result is None:
            assert live is not None
            return live
        if live is None:
            return self.create(result)
        return self.patch(kind, ns, name, ssa.as_merge_patch(live, result))


def gateway_for(kmock: Any) -> Gateway:
    api = client.ApiClient(client.Configuration(host=str(kmock.url).rstrip("/")))
    return SandboxGateway(api, retries=2, backoff=0.01)


DEMO_REFERENCE_NAMESPACES = frozenset({"mooncake"})
# The S3 endpoint of examples/native-object-store.yaml, which an install lists in the
# chart's objectStore.allowedEndpoints.
DEMO_OBJECT_ENDPOINTS = ("http://rook-ceph-rgw-objects.rook-ceph.svc:80",)


@contextlib.asynccontextmanager
async def operator(kmock: Any, render: RenderContext, drift_interval: float = 3600.0,
                   retry_delay: float = 0.2,
                   config: OperatorConfig | None = None,
                   namespaces: list[str] | None = None) -> AsyncIterator[OperatorConfig]:
    """Run the real operator (kopf, standalone; cluster-wide, or only `namespaces` as the
    chart's watchNamespaces runs it) for the duration, on its
    own thread and event loop, as it runs in its own process in a cluster. Sharing the
    API server's loop would make kopf's shutdown wait out its watch streams (seconds)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(kmock.url))

    gw = gateway_for(kmock)
    # The examples' Mooncake master lives in namespace mooncake, which an install lists
    # in the chart's referenceNamespaces.
    config = config or OperatorConfig(render=render, drift_interval=drift_interval,
                                      retry_delay=retry_delay,
                                      reference_namespaces=DEMO_REFERENCE_NAMESPACES,
                                      namespaced=bool(namespaces))
    register(registry, config, lambda: gw)

    @kopf.on.startup(registry=registry)
    def quick_watches(settings: kopf.OperatorSettings, **_: Any) -> None:
        # After register()'s own startup handler: kmock emits no watch events for objects
        # a test puts straight into its store, so watches restart (and re-list) often.
        settings.watching.server_timeout = 1
        settings.watching.client_timeout = 2
        settings.watching.connect_timeout = 2

    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(registry=registry, clusterwide=not namespaces,
                                      namespaces=namespaces or [], standalone=True,
                                      stop_flag=stop))
        except BaseException as err:  # reported to the caller when it leaves
            failure.append(err)

    thread = threading.Thread(target=run, name="kvtier-operator", daemon=True)
    thread.start()
    try:
        yield config
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 60)
        if thread.is_alive():
            raise RuntimeError("the sandboxed operator did not stop within 60 s")
        if failure:
            raise RuntimeError("the sandboxed operator failed") from failure[0]


def stored(kmock: Any, resource: str, ns: str, name: str) -> dict[str, Any] | None:
    """The stored object, or None when absent or deleted."""
    key = (kmock.resource(resource), ns, name)
    if key not in kmock.objects:
        return None
    found = kmock.objects[resource, ns, name]
    return None if found.deleted else found.raw
