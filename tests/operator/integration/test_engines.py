"""Each engine/connector beyond vLLM on GPU reconciled by the real operator against kmock:
the objects it owns (router only: no claim, no evictor), the router numbers, an injected
pod counted, and the PrerequisitesReady condition turning True when the Mooncake
ConfigMap and master Service appear."""

from __future__ import annotations

import pytest
import yaml

from kvtier_operator import names
from kvtier_operator.render.pod import config_hash
from kvtier_operator.render.router import MODEL_SERVERS_FILE, PLUGINS_FILE
from kvtier_operator.validation import parse_tpc
from tests.helpers import EXAMPLES, example
from tests.operator.integration.harness import CTX, TPC, condition, obj, operator, setup, until

pytestmark = pytest.mark.timeout(120)
NS = "llm-d"


def seed(kmock, name: str) -> dict:
    doc = example(name)
    doc["metadata"].update(uid=f"uid-{doc['metadata']['name']}", generation=1)
    kmock.objects[TPC, NS, doc["metadata"]["name"]] = doc
    return doc


def injected_pod(doc: dict, labels: dict[str, str]) -> dict:
    digest = config_hash(parse_tpc(doc), CTX)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "decode-0", "namespace": NS, "labels": labels,
                         "annotations": {names.ANNOTATION_CACHE: doc["metadata"]["name"],
                                         names.ANNOTATION_CONFIG_HASH: digest}},
            "spec": {"containers": [{"name": "m", "image": "x"}]},
            "status": {"phase": "Running"}}


@pytest.mark.parametrize(("name", "capacity", "leaders_only"), [
    ("vllm-tpu-single-host.yaml", 200000, False),  # 25,000 chunks x 128 / 16
    ("vllm-tpu-multi-host.yaml", 80000, True),
    ("kvbm.yaml", 100 * 10**9 // (262144 * 16), False),
])
async def test_reconcile_renders_router_only_and_counts_injected_pods(kmock, name, capacity,
                                                                      leaders_only):
    setup(kmock)
    doc = seed(kmock, name)
    cr = doc["metadata"]["name"]
    labels = dict(doc["spec"]["selector"]["matchLabels"])
    kmock.objects["v1/pods", NS, "decode-0"] = injected_pod(doc, labels)
    async with operator(kmock):
        body = await until(lambda: (b := obj(kmock, TPC, NS, cr)) and
                           (b.get("status") or {}).get("injectedPods") == 1 and b,
                           what="status")
        router = await until(lambda: obj(kmock, "v1/configmaps", NS, f"{cr}-router"),
                             what="router")
    assert obj(kmock, "batch/v1/cronjobs", NS, f"{cr}-evictor") is None
    assert obj(kmock, "v1/persistentvolumeclaims", NS, f"{cr}-kv-cache") is None
    assert f"lruCapacityPerServer: {capacity}" in router["data"][PLUGINS_FILE]
    assert (MODEL_SERVERS_FILE in router["data"]) == leaders_only
    assert condition(body, "Ready")["status"] == "True", body["status"]
    assert condition(body, "PrerequisitesReady")["reason"] == "NoPrerequisites"
    assert condition(body, "EvictorHealthy")["reason"] == "NoStorageTier"


async def test_mooncake_prerequisites_are_reported_until_they_exist(kmock):
    setup(kmock)
    doc = seed(kmock, "mooncake-store.yaml")
    cr = doc["metadata"]["name"]

    def prerequisites():
        return condition(obj(kmock, TPC, NS, cr), "PrerequisitesReady")

    async with operator(kmock, drift_interval=0.2):
        missing = await until(lambda: (c := prerequisites()) and c["status"] == "False" and c,
                              what="missing prerequisites")
        assert "ConfigMap llm-d/mooncake-store-config (spec.mooncake.configMapName) does " \
            "not exist" in missing["message"]
        assert "Service mooncake/mooncake-master-store (spec.mooncake.masterService)" in \
            missing["message"]
        ready = condition(obj(kmock, TPC, NS, cr), "Ready")
        assert ready["status"] == "False" and ready["reason"] == "PrerequisitesMissing"
        config = yaml.safe_load((EXAMPLES / "mooncake-config.yaml")
                                .read_text())
        config["data"] = {"other.json": "{}"}  # the wrong key first
        kmock.objects["v1/configmaps", NS, "mooncake-store-config"] = config
        await until(lambda: "has no key 'mooncake_config.json'" in prerequisites()["message"],
                    what="missing key")
        config["data"] = {"mooncake_config.json": "{}"}
        kmock.objects["v1/configmaps", NS, "mooncake-store-config"] = config
        kmock.objects["v1/services", "mooncake", "mooncake-master-store"] = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "mooncake-master-store", "namespace": "mooncake"},
            "spec": {"ports": [{"port": 50051}]}}
        found = await until(lambda: (c := prerequisites()) and c["status"] == "True" and c,
                            what="prerequisites found")
    assert found["reason"] == "Found"
    assert obj(kmock, "batch/v1/cronjobs", NS, f"{cr}-evictor") is None


async def test_mooncake_ssd_variant_needs_its_client_and_a_standalone_config(kmock):
    # The SSD variant (spec.mooncake.offload): the client DaemonSet is a prerequisite, and
    # a ConfigMap in embedded mode is named as wrong until it says standalone-store.
    setup(kmock)
    doc = seed(kmock, "mooncake-offload.yaml")
    cr = doc["metadata"]["name"]
    kmock.objects["v1/services", "mooncake", "mooncake-master-store"] = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "mooncake-master-store", "namespace": "mooncake"},
        "spec": {"ports": [{"port": 50051}]}}
    config = example("mooncake-offload-config.yaml")
    embedded = example("mooncake-config.yaml")["data"]["mooncake_config.json"]
    kmock.objects["v1/configmaps", NS, "mooncake-offload-config"] = {
        **config, "data": {"mooncake_config.json": embedded}}

    def prerequisites():
        return condition(obj(kmock, TPC, NS, cr), "PrerequisitesReady")

    async with operator(kmock, drift_interval=0.2):
        missing = await until(lambda: (c := prerequisites()) and c["status"] == "False" and c,
                              what="missing prerequisites")
        assert "DaemonSet mooncake/mooncake-client (spec.mooncake.offload.clientDaemonSet) " \
            "does not exist" in missing["message"]
        assert "spec.mooncake.offload needs mode standalone-store" in missing["message"]
        kmock.objects["v1/configmaps", NS, "mooncake-offload-config"] = config
        kmock.objects["apps/v1/daemonsets", "mooncake", "mooncake-client"] = {
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "mooncake-client", "namespace": "mooncake"},
            "spec": {"selector": {"matchLabels": {"app": "mooncake-client"}}}}
        found = await until(lambda: (c := prerequisites()) and c["status"] == "True" and c,
                            what="prerequisites found")
    assert found["message"] == "3 prerequisite object(s) exist"
