"""The engine/connector registry and the adapters beyond vLLM on GPU: TPU (single- and
multi-host), Mooncake Store and KVBM render offline, and invalid pairs are refused with
messages that name the field and what is allowed, by the models and by the CRD's CEL."""

from __future__ import annotations

import json

import pytest
import yaml

from kvtier_demo.samples import sample_workload
from kvtier_operator import names
from kvtier_operator.api.quantity import MIB, quantity_bytes
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.registry import ADAPTERS, adapter_for
from kvtier_operator.engines.sizing import PROCESS_HEADROOM_BYTES
from kvtier_operator.render.objects import render_objects
from kvtier_operator.render.pod import inject, inject_workload
from kvtier_operator.render.router import MODEL_SERVERS_FILE, PLUGINS_FILE
from kvtier_operator.validation import InvalidResource, parse_tpc
from tests.helpers import EXAMPLES, ROOT, example, tpc_doc
from tests.operator.unit.test_crd import _failed_messages, _schema_defaults

CTX = RenderContext()
TPU = {"engine": "vllm-tpu", "storage": None, "tpu": {"pageSize": 128},
       "cpu": {"size": "800000Mi"}}
MOONCAKE = {"connector": "mooncake-store", "storage": None,
            "mooncake": {"configMapName": "mooncake-config"}}
KVBM = {"connector": "kvbm", "storage": None, "cpu": {"size": "100G"}}


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def pods_of(workload: dict) -> list[dict]:
    out, _ = inject_workload(parse_tpc(example("vllm-tpu-multi-host.yaml")), workload, CTX)
    group = out["spec"]["leaderWorkerTemplate"]
    return [group["leaderTemplate"], group["workerTemplate"]]


# ---------------------------------------------------------------- registry


def test_every_adapter_is_documented_and_has_an_example():
    arch = (ROOT / "docs" / "architecture.md").read_text()
    crs = [yaml.safe_load(p.read_text()) for p in EXAMPLES.glob("*.yaml")]
    pairs = {(d["spec"].get("engine", "vllm"), d["spec"].get("connector", "native"))
             for d in crs if d["kind"] == "TieredPrefixCache"}
    for adapter in ADAPTERS:
        module = type(adapter).__module__.removeprefix("kvtier_operator.engines.")
        assert f"`{module}.{type(adapter).__name__}`" in arch, adapter
        assert (str(adapter.engine), str(adapter.connector)) in pairs, adapter


def test_existing_specs_keep_the_vllm_gpu_default():
    spec = parse_tpc(tpc_doc()).spec
    assert (spec.engine, spec.connector) == ("vllm", "native")
    assert type(adapter_for(spec)).__name__ == "VllmNative"


# ------------------------------------------------------------ vLLM on TPU


def test_tpu_single_host_renders_connector_env_and_host_memory():
    tpc = parse_tpc(example("vllm-tpu-single-host.yaml"))
    workload = yaml.safe_load((EXAMPLES / sample_workload(example(
        "vllm-tpu-single-host.yaml"))).read_text())
    out, conflicts = inject_workload(tpc, workload, CTX)
    assert conflicts == []
    c = out["spec"]["template"]["spec"]["containers"][0]
    env = env_of(c)
    assert json.loads(env[names.ENV_KV_TRANSFER_CONFIG]) == {
        "kv_connector": "TPUOffloadConnector",
        "kv_connector_module_path": "tpu_inference.offload.tpu_offload_connector",
        "kv_role": "kv_both"}
    # The llm-d guide's numbers: 25,000 chunks of 128 tokens, 1,000 HBM staging blocks.
    assert env["TPU_OFFLOAD_NUM_CPU_CHUNKS"] == "25000"
    assert env["TPU_OFFLOAD_NUM_STAGING_BLOCKS"] == "1000"
    assert "TPU_MULTIHOST_BACKEND" not in env
    assert '--kv-transfer-config "$KVTIER_KV_TRANSFER_CONFIG"' in c["args"][0]
    # The pinned host tier (the guide forgets it) plus headroom; no /dev/shm added.
    assert quantity_bytes(c["resources"]["requests"]["memory"]) == \
        25000 * 128 * 262144 + PROCESS_HEADROOM_BYTES
    assert "volumes" not in out["spec"]["template"]["spec"] or not any(
        v["name"] == names.VOLUME_SHM for v in out["spec"]["template"]["spec"]["volumes"])
    assert [o["kind"] for o in render_objects(tpc, CTX)] == ["ConfigMap"]  # no PVC/CronJob


def test_tpu_multi_host_injects_leader_and_worker_and_routes_to_leaders():
    workload = yaml.safe_load((EXAMPLES / "tpu-leaderworkerset.yaml").read_text())
    leader, worker = pods_of(workload)
    lc, wc = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    assert "--kv-transfer-config" in lc["args"][0]
    assert wc["args"] == workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"][
        "containers"][0]["args"]  # the worker's command is left alone
    for c in (lc, wc):
        env = env_of(c)
        assert env["TPU_OFFLOAD_NUM_CPU_CHUNKS"] == "10000"
        assert env["TPU_MULTIHOST_BACKEND"] == "ray"
        # Each of the 2 hosts pins half of every chunk.
        assert quantity_bytes(c["resources"]["requests"]["memory"]) == \
            10000 * 128 * 253952 // 2 + PROCESS_HEADROOM_BYTES
    assert names.ENV_KV_TRANSFER_CONFIG not in env_of(wc)
    assert leader["metadata"]["annotations"] == worker["metadata"]["annotations"]
    tpc = parse_tpc(example("vllm-tpu-multi-host.yaml"))
    (router,) = render_objects(tpc, CTX)
    assert "lruCapacityPerServer: 80000" in router["data"][PLUGINS_FILE]  # 10k x 128 / 16
    assert yaml.safe_load(router["data"][MODEL_SERVERS_FILE]) == {"modelServers": {
        "matchLabels": {"llm-d.ai/model": "Qwen3-Coder-480B-A35B-Instruct",
                        "leaderworkerset.sigs.k8s.io/worker-index": "0"}}}


def test_tpu_worker_pod_alone_is_found_by_its_ray_command():
    tpc = parse_tpc(tpc_doc({**TPU, "tpu": {"pageSize": 128, "hosts": 4}}))
    pod = {"metadata": {"name": "w", "annotations": {"leaderworkerset.sigs.k8s.io/size": "4"}},
           "spec": {"containers": [
        {"name": "sidecar", "image": "x", "command": ["sleep", "inf"]},
        {"name": "ray", "image": "x", "command": ["sh", "-c",
                                                  "ray start --block --address=$(LEADER):6379"]}]}}
    result = inject(tpc, pod, CTX)
    assert result.conflicts == [] and result.container == "ray"
    assert "TPU_OFFLOAD_NUM_CPU_CHUNKS" in env_of(result.pod["spec"]["containers"][1])


def test_tpu_router_capacity_counts_router_blocks_not_tpu_pages():
    spec = parse_tpc(tpc_doc({**TPU, "router": {"enabled": True, "blockSize": 64}})).spec
    assert adapter_for(spec).router_cpu_blocks(spec) == 25000 * 128 // 64


def test_tpu_user_multihost_backend_other_than_ray_is_a_conflict():
    tpc = parse_tpc(example("vllm-tpu-multi-host.yaml"))
    workload = yaml.safe_load((EXAMPLES / "tpu-leaderworkerset.yaml").read_text())
    c = workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    c["env"].append({"name": "TPU_MULTIHOST_BACKEND", "value": "mp"})
    _, conflicts = inject_workload(tpc, workload, CTX)
    assert any("TPU_MULTIHOST_BACKEND=mp" in c for c in conflicts)


def test_tpu_container_name_of_the_leader_also_finds_the_worker():
    """llm-d's LeaderWorkerSet names them modelserver-leader and modelserver-worker: with
    containerName the leader's, a worker pod has no such container, and its Ray worker
    container (found by its command) is injected instead of every worker conflicting."""
    doc = example("vllm-tpu-multi-host.yaml")
    doc["spec"]["containerName"] = "modelserver-leader"
    workload = yaml.safe_load((EXAMPLES / "tpu-leaderworkerset.yaml").read_text())
    out, conflicts = inject_workload(parse_tpc(doc), workload, CTX)
    assert conflicts == []
    group = out["spec"]["leaderWorkerTemplate"]
    (lc,), (wc,) = (group[t]["spec"]["containers"] for t in ("leaderTemplate", "workerTemplate"))
    assert "--kv-transfer-config" in lc["args"][0]
    assert env_of(wc)["TPU_MULTIHOST_BACKEND"] == "ray"
    assert names.ENV_KV_TRANSFER_CONFIG not in env_of(wc)


def test_container_name_missing_without_a_worker_is_still_a_conflict():
    doc = example("vllm-tpu-multi-host.yaml")
    doc["spec"]["containerName"] = "modelserver-typo"
    workload = yaml.safe_load((EXAMPLES / "tpu-leaderworkerset.yaml").read_text())
    _, conflicts = inject_workload(parse_tpc(doc), workload, CTX)
    assert len(conflicts) == 1  # the leader: its container runs vllm serve, no worker
    assert "no container named 'modelserver-typo'" in conflicts[0]


LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"


def lws_pod(size: str | None, where: str = "annotations") -> dict:
    """A multi-host leader pod as LeaderWorkerSet creates it (size: its group size)."""
    workload = yaml.safe_load((EXAMPLES / "tpu-leaderworkerset.yaml").read_text())
    template = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    meta = {"name": "decode-0", "labels": {**template["metadata"]["labels"],
                                           "leaderworkerset.sigs.k8s.io/worker-index": "0"}}
    if size is not None:
        meta.setdefault(where, {})[LWS_SIZE] = size
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def multi_host(hosts: int):
    doc = example("vllm-tpu-multi-host.yaml")
    doc["spec"]["tpu"]["hosts"] = hosts
    return parse_tpc(doc)


@pytest.mark.parametrize("where", ["annotations", "labels"])
def test_tpu_pod_of_the_leaderworkerset_size_in_hosts_is_injected(where):
    result = inject(multi_host(2), lws_pod("2", where), CTX)
    assert result.conflicts == [] and result.changed


@pytest.mark.parametrize(("hosts", "size"), [(4, "2"), (1, "2"), (2, "3")])
def test_tpu_hosts_other_than_the_pods_leaderworkerset_size_is_a_conflict(hosts, size):
    result = inject(multi_host(hosts), lws_pod(size), CTX)
    assert not result.changed
    assert any(f"spec.tpu.hosts is {hosts} but the pod's {LWS_SIZE} annotation is {size}" in c
               and f"set spec.tpu.hosts to {size}" in c for c in result.conflicts), \
        result.conflicts


@pytest.mark.parametrize("size", [None, "two", "0"])
def test_tpu_multi_host_pod_without_a_leaderworkerset_size_is_a_conflict(size):
    result = inject(multi_host(2), lws_pod(size), CTX)
    assert not result.changed
    assert any("spec.tpu.hosts is 2" in c and LWS_SIZE in c for c in result.conflicts), \
        result.conflicts


def test_tpu_single_host_pod_of_a_leaderworkerset_of_one_is_injected():
    assert inject(multi_host(1), lws_pod("1"), CTX).conflicts == []
    assert inject(multi_host(1), lws_pod(None), CTX).conflicts == []


@pytest.mark.parametrize("hosts", [1, 4])
def test_tpu_render_compares_hosts_with_the_leaderworkerset_size(hosts):
    workload = yaml.safe_load((EXAMPLES / "tpu-leaderworkerset.yaml").read_text())
    out, conflicts = inject_workload(multi_host(hosts), workload, CTX)
    assert conflicts and all(f"spec.tpu.hosts is {hosts}" in c and
                             "spec.leaderWorkerTemplate.size is 2" in c for c in conflicts), conflicts
    assert out == workload


def test_tpu_multi_host_render_of_a_deployment_is_a_conflict():
    workload = yaml.safe_load((EXAMPLES / "tpu-deployment.yaml").read_text())
    _, conflicts = inject_workload(multi_host(2), workload, CTX)
    assert any("spec.tpu.hosts is 2" in c and "LeaderWorkerSet" in c for c in conflicts)


# ----------------------------------------------------------- Mooncake, KVBM


def test_mooncake_store_mounts_its_configmap_and_names_prerequisites():
    tpc = parse_tpc(example("mooncake-store.yaml"))
    out, conflicts = inject_workload(tpc, example("vllm-deployment.yaml"), CTX)
    assert conflicts == []
    spec = out["spec"]["template"]["spec"]
    c = spec["containers"][0]
    env = env_of(c)
    assert json.loads(env[names.ENV_KV_TRANSFER_CONFIG]) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    assert env["MOONCAKE_CONFIG_PATH"] == "/etc/kvtier/mooncake/mooncake_config.json"
    volume = next(v for v in spec["volumes"] if v["name"] == "kvtier-mooncake-config")
    assert volume["configMap"]["name"] == "mooncake-store-config"
    assert {"name": "kvtier-mooncake-config", "mountPath": "/etc/kvtier/mooncake",
            "readOnly": True} in c["volumeMounts"]
    # 84 GiB lent to the store (segment and local buffer, as vLLM reads "80GB" and "4GB"),
    # on top of the pod's own request; /dev/shm untouched.
    assert quantity_bytes(c["resources"]["requests"]["memory"]) == 100 * 1024**3 + \
        84 * 1024**3 + PROCESS_HEADROOM_BYTES
    # protocol rdma: one RDMA device, requested and limited.
    assert c["resources"]["requests"]["rdma/ib"] == c["resources"]["limits"]["rdma/ib"] == "1"
    assert next(v for v in spec["volumes"] if v["name"] == "shm")["emptyDir"][
        "sizeLimit"] == "20Gi"
    assert "initContainers" not in spec
    needs = adapter_for(tpc.spec).prerequisites(tpc)
    assert [(p.kind, p.namespace, p.name, p.field) for p in needs] == [
        ("ConfigMap", "llm-d", "mooncake-store-config", "spec.mooncake.configMapName"),
        ("Service", "mooncake", "mooncake-master-store", "spec.mooncake.masterService")]
    assert [o["kind"] for o in render_objects(tpc, CTX)] == ["ConfigMap"]  # router only
    config = example("mooncake-config.yaml")["data"]["mooncake_config.json"]
    assert needs[0].check is not None and needs[0].check(config) == []


def test_mooncake_offload_loads_async_mounts_the_root_dir_and_needs_the_client():
    tpc = parse_tpc(example("mooncake-offload.yaml"))
    out, conflicts = inject_workload(tpc, example("vllm-deployment.yaml"), CTX)
    assert conflicts == []
    spec = out["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert json.loads(env_of(c)[names.ENV_KV_TRANSFER_CONFIG]) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"load_async": True}}
    assert {"name": "kvtier-mooncake-offload", "mountPath": "/data/mooncake-offload"} in \
        c["volumeMounts"]
    assert {"name": "kvtier-mooncake-offload", "emptyDir": {}} in spec["volumes"]
    needs = adapter_for(tpc.spec).prerequisites(tpc)
    assert ("DaemonSet", "mooncake", "mooncake-client",
            "spec.mooncake.offload.clientDaemonSet") in [
        (p.kind, p.namespace, p.name, p.field) for p in needs]
    check = needs[0].check
    assert check is not None
    assert check(example("mooncake-offload-config.yaml")["data"]["mooncake_config.json"]) == []
    # The embedded config of the other example is refused here, naming what to change.
    (problem,) = [p for p in check(example("mooncake-config.yaml")["data"][
        "mooncake_config.json"]) if "offload" in p]
    assert "standalone-store" in problem and "global_segment_size 0" in problem


@pytest.mark.parametrize(("config", "spec", "wanted"), [
    # vLLM reads GB as GiB: an 80 GB segment and a 4 GB buffer need 84Gi, not 84G.
    ('{"global_segment_size": "80GB", "local_buffer_size": "4GB"}', {"cpu": {"size": "84G"}},
     "more than spec.cpu.size"),
    ('{"global_segment_size": "80GB", "local_buffer_size": "4GB"}', {"cpu": {"size": "84Gi"}},
     None),
    ('{"protocol": "tcp"}', {}, "its protocol is 'tcp' but spec.mooncake.protocol is rdma"),
    ('{}', {"mooncake": {"configMapName": "m", "protocol": "tcp"}}, "its protocol is 'rdma'"),
    ('{"mode": "standalone-store", "global_segment_size": 0}', {},
     "set spec.mooncake.offload"),
    ('{"global_segment_size": "eighty"}', {}, "cannot read it as Mooncake's client config"),
    ('[1]', {}, "not a JSON object"),
    ('{"x": "' + "a" * 70000 + '"}', {}, "not a client config"),
])
def test_mooncake_client_config_is_checked_against_the_spec(config, spec, wanted):
    tpc = parse_tpc(tpc_doc({**MOONCAKE, **spec}))
    check = adapter_for(tpc.spec).prerequisites(tpc)[0].check
    assert check is not None
    found = check(config)
    if wanted is None:
        assert found == []
    else:
        assert any(wanted in p for p in found), found


def test_mooncake_tcp_asks_for_no_rdma_device_and_a_pod_keeps_its_own_count():
    tcp = parse_tpc(tpc_doc({**MOONCAKE, "mooncake": {"configMapName": "m",
                                                      "protocol": "tcp"}}))
    out, _ = inject_workload(tcp, example("vllm-deployment.yaml"), CTX)
    resources = out["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert "rdma/ib" not in resources["limits"] and "rdma/ib" not in resources["requests"]
    rdma = parse_tpc(tpc_doc({**MOONCAKE, "mooncake": {
        "configMapName": "m", "rdmaResource": "rdma/hca_shared_devices_a"}}))
    workload = example("vllm-deployment.yaml")
    own = workload["spec"]["template"]["spec"]["containers"][0]["resources"]
    own["limits"]["rdma/hca_shared_devices_a"] = own["requests"][
        "rdma/hca_shared_devices_a"] = "2"
    out, conflicts = inject_workload(rdma, workload, CTX)
    assert conflicts == []
    resources = out["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["rdma/hca_shared_devices_a"] == "2"
    assert "rdma/ib" not in resources["limits"]


def test_kvbm_sets_its_cpu_cache_in_whole_gb_and_pins_it():
    tpc = parse_tpc(tpc_doc({**KVBM, "cpu": {"size": "100Gi"}}))
    out, conflicts = inject_workload(tpc, example("vllm-deployment.yaml"), CTX)
    assert conflicts == []
    c = out["spec"]["template"]["spec"]["containers"][0]
    env = env_of(c)
    assert env["DYN_KVBM_CPU_CACHE_GB"] == "107"  # 100 GiB = 107.37 GB, whole GB
    assert json.loads(env[names.ENV_KV_TRANSFER_CONFIG])["kv_connector_module_path"] == \
        "kvbm.vllm_integration.connector"
    assert quantity_bytes(c["resources"]["requests"]["memory"]) == 100 * 1024**3 + \
        -(-(107 * 10**9 + PROCESS_HEADROOM_BYTES) // MIB) * MIB
    assert not any(o["kind"] == "CronJob" for o in render_objects(tpc, CTX))


# ------------------------------------------------------------------ refusals

REFUSED = [
    ({**TPU, "storage": {"pvc": {"size": "1Ti"}}}, "spec.storage: engine vllm-tpu and "
     "connector native has no shared file tier"),
    ({**TPU, "connector": "lmcache"}, "spec.connector: engine vllm-tpu takes connector native"),
    ({**TPU, "tpu": None}, "spec.tpu is required with engine vllm-tpu"),
    ({"tpu": {"pageSize": 16}}, "spec.tpu applies only to engine vllm-tpu"),
    ({**TPU, "cpu": None}, "spec.cpu is required with engine vllm-tpu"),
    ({**TPU, "cpu": {"size": "16Mi"}}, "spec.cpu.size 16Mi holds no TPU chunk"),
    ({**TPU, "tpu": {"pageSize": 128, "stagingSize": "16Mi"}}, "spec.tpu.hbmStagingSize"),
    ({**MOONCAKE, "mooncake": None}, "spec.mooncake is required with engine vllm and "
     "connector mooncake-store"),
    ({**MOONCAKE, "storage": {"pvc": {"size": "1Ti"}}}, "spec.storage: engine vllm and "
     "connector mooncake-store has no shared file tier"),
    ({"mooncake": {"configMapName": "x"}}, "spec.mooncake applies only to engine vllm with "
     "connector mooncake-store"),
    ({**KVBM, "storage": {"pvc": {"size": "1Ti"}}}, "spec.storage: engine vllm and connector "
     "kvbm has no shared file tier"),
    ({**KVBM, "cpu": {"size": "900M"}}, "spec.cpu.size must be at least 1G"),
    ({"connector": "lmcache", "storage": {"pvc": {"size": "1Ti"}, "backend": "vllm-fs"}},
     "storage.backend must be unset with connector lmcache"),
    ({"storage": {"pvc": {"size": "1Ti"}, "backend": "vllm-fs", "storeNice": 5}},
     "spec.storage.storeNice applies to kvtier's backend only (storage.backend kvtier); "
     "remove it with engine vllm and connector native and backend vllm-fs"),
    ({"connector": "lmcache", "storage": {"pvc": {"size": "1Ti"}, "storeNice": 5,
                                          "maxSizePerReplica": "1Gi"}},
     "spec.storage.storeNice applies to kvtier's backend only"),
    ({"storage": {"pvc": {"size": "1Ti"}, "storeNice": 20}}, "storeNice"),
]


@pytest.mark.parametrize(("patch", "needle"), REFUSED)
def test_invalid_pairs_are_refused_naming_the_field(patch, needle):
    with pytest.raises(InvalidResource) as err:
        parse_tpc(tpc_doc(patch))
    assert any(needle in m for m in err.value.messages), err.value.messages


CEL_REFUSED = [
    ({**TPU, "storage": {"pvc": {"size": "1Ti"}}}, "spec.storage: a shared file tier"),
    ({**TPU, "connector": "kvbm"}, "spec.connector is not possible with this spec.engine"),
    ({**TPU, "tpu": None}, "spec.tpu is required with, and applies only to, engine vllm-tpu"),
    ({"tpu": {"pageSize": 16}}, "spec.tpu is required with, and applies only to"),
    ({**MOONCAKE, "mooncake": None}, "spec.mooncake is required with"),
    ({**KVBM, "storage": {"pvc": {"size": "1Ti"}}}, "spec.storage: a shared file tier"),
    ({"connector": "lmcache", "storage": {"pvc": {"size": "1Ti"}, "backend": "kvtier"}},
     "spec.storage.backend is not possible with this engine and connector"),
]


@pytest.mark.parametrize(("patch", "needle"), CEL_REFUSED)
def test_the_api_server_refuses_the_same_pairs_first(patch, needle):
    doc = _schema_defaults(tpc_doc(patch))
    assert any(needle in m for m in _failed_messages(doc))


@pytest.mark.parametrize("patch", [TPU, MOONCAKE, KVBM, {}])
def test_the_api_server_accepts_valid_pairs(patch):
    assert _failed_messages(_schema_defaults(tpc_doc(patch))) == []
