"""The real operator (kopf, kmock) keeps the cache's <name>-event-pods ConfigMap, the
pods the evictor publishes its removals to (#33, router #2586), in step with the pods:
a pod that starts is listed at the next reconcile, one that goes is dropped."""

from __future__ import annotations

import pytest

from kvtier_operator import names
from tests.helpers import tpc_doc
from tests.operator.integration.harness import TPC, obj, operator, setup, until
from tests.operator.integration.test_rollout import NS, pod

pytestmark = pytest.mark.timeout(60)
ROUTER = {"enabled": True, "scoring": "precise", "evictionEventsEndpoint": "tcp://epp:5590"}


def injected(name, ip):
    p = pod(name, "ReplicaSet", "decode", {names.ANNOTATION_CACHE: "cache",
                                           names.ANNOTATION_CONFIG_HASH: "h"})
    p["status"]["podIP"] = ip
    return p


def listed(kmock):
    cm = obj(kmock, "v1/configmaps", NS, "cache-event-pods") or {}
    return (cm.get("data") or {}).get(names.EVENT_PODS_KEY)


async def test_the_event_pods_follow_the_pods(kmock):
    setup(kmock)
    doc = tpc_doc({"router": ROUTER}, name="cache", namespace=NS)
    doc["metadata"].update(uid="u-1", generation=1)
    kmock.objects[TPC, NS, "cache"] = doc
    kmock.objects["v1/pods", NS, "decode-a"] = injected("decode-a", "10.0.0.5")
    async with operator(kmock, drift_interval=0.2):
        await until(lambda: listed(kmock) == "10.0.0.5:8000\n", what="first pod listed")
        kmock.objects["v1/pods", NS, "decode-b"] = injected("decode-b", "10.0.0.4")
        await until(lambda: listed(kmock) == "10.0.0.4:8000\n10.0.0.5:8000\n",
                    what="second pod listed")
        await kmock.delete(f"/api/v1/namespaces/{NS}/pods/decode-a")
        await until(lambda: listed(kmock) == "10.0.0.4:8000\n", what="gone pod dropped")
        cron = obj(kmock, "batch/v1/cronjobs", NS, "cache-evictor")
        assert "--events-pods-file" in cron["spec"]["jobTemplate"]["spec"]["template"][
            "spec"]["containers"][0]["args"]
