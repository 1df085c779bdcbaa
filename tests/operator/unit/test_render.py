"""Pure renderers, field by field, for every connector/storage variant."""

from __future__ import annotations

import copy
import json

import pytest

from kvtier_operator import names
from kvtier_operator.api.quantity import GIB, quantity_bytes
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.engines.vllm import sizing
from kvtier_operator.engines.vllm.gpu import (
    KVTIER_CONNECTOR,
    KVTIER_CONNECTOR_MODULE,
    KVTIER_SPEC_MODULE,
    KVTIER_SPEC_NAME,
    KVTIER_TIER_MODULE,
    KVTIER_TIER_TYPE,
)
from kvtier_operator.engines.vllm.launch import runs_vllm
from kvtier_operator.render.connector import connector_env, kv_transfer_config
from kvtier_operator.render.cronjob import render_cronjob
from kvtier_operator.render.objects import render_objects
from kvtier_operator.render.pod import config_hash, inject, inject_workload
from kvtier_operator.render.pvc import render_pvc
from kvtier_operator.render.router import endpoint_picker_config, render_router_configmap
from kvtier_operator.validation import InvalidResource, deprecations, parse_tpc
from tests.helpers import example, tpc_doc, vllm_pod

CTX = RenderContext(offload_image="reg/kvtier-offload:1", evictor_image="reg/kvtier:1")


def tpc(spec=None, **meta):
    return parse_tpc(tpc_doc(spec, **meta))


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def kv_flag(container) -> dict:
    args = container["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


# --------------------------------------------------------------------- PVC

def test_pvc_defaults_and_retain():
    pvc = render_pvc(tpc(uid="u1"))
    assert pvc["metadata"]["name"] == "cache-kv-cache"
    assert pvc["metadata"]["namespace"] == "ml"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Ti"
    assert "storageClassName" not in pvc["spec"]  # cluster default class
    assert "ownerReferences" not in pvc["metadata"]  # Retain: survives the CR


def test_pvc_delete_policy_owns_claim_and_class_is_passed():
    pvc = render_pvc(tpc({"storage": {"pvc": {"deletePolicy": "Delete",
                                              "storageClassName": "lustre"}}}, uid="u1"))
    assert pvc["spec"]["storageClassName"] == "lustre"
    ref = pvc["metadata"]["ownerReferences"][0]
    assert ref == {"apiVersion": "kvtier.dev/v1alpha1", "kind": "TieredPrefixCache",
                   "name": "cache", "uid": "u1", "controller": True, "blockOwnerDeletion": True}


def test_no_pvc_for_existing_claim_or_no_storage():
    assert render_pvc(tpc({"storage": {"pvc": None, "existingClaim": "mine"}})) is None
    assert render_pvc(tpc({"storage": None})) is None


# ------------------------------------------------------- connector config

def test_native_cpu_only():
    t = tpc({"storage": None})
    assert kv_transfer_config(t) == {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 100 * GIB},
    }
    assert connector_env(t) == {"PYTHONHASHSEED": str(t.hash_seed)}


def test_native_cpu_plus_vllm_fs():
    t = tpc({"storage": {"backend": "vllm-fs", "readThreads": 8, "writeThreads": 4,
                         "blockSize": 512, "mountPath": "/cache/kv"}})
    extra = kv_transfer_config(t)["kv_connector_extra_config"]
    assert extra == {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 100 * GIB, "block_size": 512,
        "secondary_tiers": [{"type": "fs", "root_dir": "/cache/kv", "n_read_threads": 8,
                             "n_write_threads": 4}],
    }


def test_native_cpu_plus_kvtier():
    extra = kv_transfer_config(tpc())["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["secondary_tiers"] == [{
        "type": KVTIER_TIER_TYPE, "module_path": KVTIER_TIER_MODULE,
        "root_dir": "/mnt/files-storage", "n_read_threads": 16, "n_write_threads": 16,
    }]


def test_the_store_priority_reaches_kvtiers_tiers_where_the_spec_sets_it():
    t = tpc({"storage": {"storeNice": 3},
             "localDisk": {"capacity": "100Gi", "volume": {"emptyDir": {}}, "storeNice": 0}})
    disk, shared = kv_transfer_config(t)["kv_connector_extra_config"]["secondary_tiers"]
    assert (disk["store_nice"], shared["store_nice"]) == (0, 3)
    no_cpu = tpc({"cpu": None, "storage": {"storeNice": 19}})
    assert kv_transfer_config(no_cpu)["kv_connector_extra_config"]["store_nice"] == 19
    # unset: the backend's default (StoreConfig.store_nice), nothing rendered
    (unset,) = kv_transfer_config(tpc())["kv_connector_extra_config"]["secondary_tiers"]
    assert "store_nice" not in unset


def test_native_no_cpu_tier_uses_kvtiers_own_connector_and_spec_and_recomputes():
    t = tpc({"cpu": None, "storage": {"readThreads": 8, "writeThreads": 4}})
    assert kv_transfer_config(t) == {
        "kv_connector": KVTIER_CONNECTOR, "kv_connector_module_path": KVTIER_CONNECTOR_MODULE,
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": KVTIER_SPEC_NAME, "spec_module_path": KVTIER_SPEC_MODULE,
            "root_dir": "/mnt/files-storage", "n_read_threads": 8, "n_write_threads": 4,
            "max_staging_bytes": sizing.NO_CPU_TIER_STAGING_BYTES, "block_size": 256},
    }
    assert connector_env(t) == {"PYTHONHASHSEED": str(t.hash_seed),
                                "PROMETHEUS_MULTIPROC_DIR": names.METRICS_MOUNT}


@pytest.mark.parametrize(("storage", "model", "tokens"), [
    ({}, {}, 256),  # Qwen3-32B's 256 KiB per token: 8 files of 64 MiB in 1 GiB
    ({"hostStagingSize": "256Mi"}, {}, 64),  # 8 x 32 MiB and their id slots overflow
    ({}, {"kvBytesPerToken": 2 << 20}, 32),  # a huge KV per token: smaller files
    ({"hostStagingSize": "1Mi"}, {"kvBytesPerToken": 4096}, 16),  # at least 16 tokens
    ({"blockSize": 512}, {}, 512),  # the author's choice, where staging holds two
])
def test_no_cpu_tier_files_hold_about_256_tokens_as_staging_allows(storage, model, tokens):
    """R1 (#36): GPU-direct files are vLLM chunks of block_size tokens, 256 by default like
    the tiers' files (16x fewer than one per GPU block), halved where the pinned staging
    would hold fewer than eight of them."""
    t = tpc({"cpu": None, "storage": storage, "model": {"name": "m", **model}})
    extra = kv_transfer_config(t)["kv_connector_extra_config"]
    assert extra["block_size"] == tokens == sizing.direct_file_tokens(t.spec)


@pytest.mark.parametrize(("spec", "args", "conflict"), [
    # GPU-direct files of 256 tokens: --block-size 64 divides them, 96 does not
    ({"cpu": None}, ["--block-size", "64"], None),
    ({"cpu": None}, ["--block-size=96"], "--block-size 96, which does not divide the "
     "256-token files kvtier renders (vLLM would refuse to start): set "
     "spec.storage.blockSize to a multiple of 96, e.g. 192"),
    # staging for 64-token files only: a 128-token GPU block cannot divide them
    ({"cpu": None, "storage": {"hostStagingSize": "256Mi"}}, ["--block-size", "128"],
     "--block-size 128, which does not divide the 64-token files"),
    # a CPU tier chained to kvtier's shared tier: storage.blockSize is the file size
    ({"storage": {"blockSize": 512}}, ["--block-size", "48"], "the 512-token files"),
    # a CPU tier alone: kvtier renders no block_size; vLLM's own default applies
    ({"storage": None}, ["--block-size", "48"], None),
    ({"cpu": None}, [], None),  # vLLM picks the GPU block size: nothing to contradict
])
def test_a_gpu_block_size_that_cannot_divide_the_files_is_a_conflict(spec, args, conflict):
    """vLLM refuses to start where the offloaded block_size is not a multiple of its GPU
    block size (--block-size, e.g. 64 for FlashMLA): the pod is left as written, with the
    field to change, instead of an engine that crashes at start."""
    pod = vllm_pod(args=["Qwen/Qwen3-32B", *args])
    result = inject(tpc(spec), pod, CTX)
    if conflict is None:
        assert result.changed and not result.conflicts, result.conflicts
    else:
        assert not result.changed and any(conflict in c for c in result.conflicts), \
            result.conflicts


def test_no_cpu_tier_gives_the_workers_metrics_a_multiprocess_directory_of_the_pods_own():
    """kvtier's stores run in vLLM's worker processes in this mode: PROMETHEUS_MULTIPROC_DIR
    on a writable emptyDir of the pod is what brings their metrics to /metrics (#32)."""
    pod = inject(tpc({"cpu": None}), vllm_pod(), CTX).pod
    c = pod["spec"]["containers"][0]
    assert env_of(c)["PROMETHEUS_MULTIPROC_DIR"] == names.METRICS_MOUNT
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[names.VOLUME_METRICS] == {
        "name": names.VOLUME_METRICS, "emptyDir": {"sizeLimit": names.METRICS_SIZE_LIMIT}}
    mount = next(m for m in c["volumeMounts"] if m["name"] == names.VOLUME_METRICS)
    assert mount["mountPath"] == names.METRICS_MOUNT and not mount.get("readOnly")
    # with vLLM's own CPU tier the tier's metrics travel with vLLM's stats: nothing added
    tiered = inject(tpc(), vllm_pod(), CTX).pod
    assert "PROMETHEUS_MULTIPROC_DIR" not in env_of(tiered["spec"]["containers"][0])
    assert names.VOLUME_METRICS not in {v["name"] for v in tiered["spec"]["volumes"]}


def test_lmcache_cpu():
    t = tpc({"connector": "lmcache", "storage": None, "cpu": {"size": "200G"}})
    assert kv_transfer_config(t) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    env = connector_env(t)
    assert env["LMCACHE_LOCAL_CPU"] == "True"
    # LMCache reads GiB: 200 GB (decimal) is 186.264 GiB, floored so it never exceeds it
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "186.264"
    assert "LMCACHE_LOCAL_DISK" not in env and "LMCACHE_EXTRA_CONFIG" not in env
    # LMCache's metrics across processes, in an emptyDir of the pod (llm-d's guide).
    assert env["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/lmcache_prometheus"
    out = inject(t, vllm_pod(), RenderContext()).pod
    assert {"name": "kvtier-lmcache-prometheus", "emptyDir": {}} in out["spec"]["volumes"]
    assert {"name": "kvtier-lmcache-prometheus", "mountPath": "/tmp/lmcache_prometheus"} in \
        out["spec"]["containers"][0]["volumeMounts"]


def test_lmcache_cpu_plus_disk():
    t = tpc({"connector": "lmcache", "storage": {"pvc": {"size": "1000G"}}})
    env = connector_env(t)
    assert env["LMCACHE_LOCAL_DISK"] == "file:///mnt/files-storage/lmcache/"
    assert env["LMCACHE_MAX_LOCAL_DISK_SIZE"] == "791.624"  # 1000G x highWatermark 85%, GiB
    assert env["LMCACHE_CHUNK_SIZE"] == "256"
    # O_DIRECT on by default, as in llm-d's guide; a JSON boolean (LMCache tests it for
    # truth, so the string "False" would turn it on).
    assert json.loads(env["LMCACHE_EXTRA_CONFIG"]) == {"use_odirect": True}
    buffered = tpc({"connector": "lmcache", "storage": {"pvc": {"size": "1000G"},
                                                        "directIO": False}})
    assert json.loads(connector_env(buffered)["LMCACHE_EXTRA_CONFIG"]) == {"use_odirect": False}
    capped = tpc({"connector": "lmcache", "storage": {"maxSizePerReplica": "500G"}})
    assert connector_env(capped)["LMCACHE_MAX_LOCAL_DISK_SIZE"] == "465.661"
    gib = tpc({"connector": "lmcache", "storage": None, "cpu": {"size": "100Gi"}})
    assert connector_env(gib)["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "100.0"


@pytest.mark.parametrize("spec", [{}, {"engine": "sglang", "sglang": {}}])
def test_direct_io_is_lmcaches_only(spec):
    with pytest.raises(InvalidResource, match=r"storage\.directIO"):
        tpc({**spec, "storage": {"pvc": {"size": "1Ti"}, "directIO": True}})


@pytest.mark.parametrize(("requests", "limits"), [("100Gi", "200Gi"), ("100Gi", None),
                                                 (None, "200Gi")])
def test_lmcache_pool_lands_on_the_memory_request(requests, limits):
    # LMCache pins its whole CPU pool when it starts: the request (what the scheduler
    # reserves and what node-pressure eviction compares usage with) must grow by all of it,
    # whatever gap the pod leaves to its limit; kvtier does not force request == limit
    # (docs/sizing.md).
    t = tpc({"connector": "lmcache", "storage": None, "cpu": {"size": "100Gi"}})
    resources = {k: {"memory": v} for k, v in (("requests", requests), ("limits", limits)) if v}
    out = inject(t, vllm_pod(resources=resources), RenderContext()).pod
    got = out["spec"]["containers"][0]["resources"]
    pool = int(float(connector_env(t)["LMCACHE_MAX_LOCAL_CPU_SIZE"]) * GIB)
    if requests:
        assert quantity_bytes(got["requests"]["memory"]) >= quantity_bytes(requests) + pool
    if limits:
        assert quantity_bytes(got["limits"]["memory"]) >= quantity_bytes(limits) + pool
    if not requests:
        # Kubernetes defaults a missing request to the limit, raised by the pool too.
        assert "memory" not in got.get("requests", {})


# ----------------------------------------------------------------- sizing

def test_sizing_native_without_shm():
    s = sizing.pod_sizing(tpc({"storage": None}).spec, None)
    assert s.shm_bytes == 102 * GIB  # tier + 2Gi base
    assert s.memory_increase_bytes == 103 * GIB  # shm + 1Gi headroom


def test_sizing_native_grows_existing_shm_by_tier():
    s = sizing.pod_sizing(tpc({"storage": None}).spec, 20 * GIB)
    assert s.shm_bytes == 120 * GIB
    assert s.memory_increase_bytes == 101 * GIB


def test_sizing_kvtier_counts_io_buffers():
    spec = tpc().spec  # 32 threads x 256 tokens x 256 KiB = 2 GiB
    assert sizing.io_buffer_bytes(spec) == 2 * GIB
    assert sizing.pod_sizing(spec, None).memory_increase_bytes == 105 * GIB


def test_sizing_lmcache_keeps_tier_out_of_shm():
    spec = tpc({"connector": "lmcache", "storage": None}).spec
    s = sizing.pod_sizing(spec, None)
    assert s.shm_bytes == 2 * GIB
    assert s.memory_increase_bytes == 103 * GIB


def test_sizing_no_cpu_tier_counts_pinned_staging_not_shm():
    spec = tpc({"cpu": None}).spec
    assert sizing.io_buffer_bytes(spec) == 0  # staging rows are written in place
    s = sizing.pod_sizing(spec, None)
    assert s.shm_bytes == 2 * GIB  # base only: no tier in /dev/shm
    assert s.memory_increase_bytes == 2 * GIB + sizing.NO_CPU_TIER_STAGING_BYTES + GIB
    kept = sizing.pod_sizing(spec, 20 * GIB)
    assert kept.shm_bytes == 20 * GIB
    assert kept.memory_increase_bytes == sizing.NO_CPU_TIER_STAGING_BYTES + GIB


@pytest.mark.parametrize("name", ["hostStagingSize", "stagingSize"])
def test_host_staging_size_and_its_deprecated_name_stage_alike(name):
    t = tpc({"cpu": None, "storage": {name: "256Mi"}})
    assert t.spec.storage.staging_bytes == 256 * 2**20
    assert kv_transfer_config(t)["kv_connector_extra_config"]["max_staging_bytes"] == 256 * 2**20
    warned = deprecations(t)
    assert warned == (["spec.storage.stagingSize is deprecated: rename it hostStagingSize "
                       "(the same setting)"] if name == "stagingSize" else [])


def test_no_cpu_tier_staging_size_from_the_cr_per_worker_process():
    t = tpc({"cpu": None, "storage": {"stagingSize": "256Mi"}})
    assert kv_transfer_config(t)["kv_connector_extra_config"]["max_staging_bytes"] == 256 << 20
    one = sizing.pod_sizing(t.spec, 20 * GIB)
    assert one.memory_increase_bytes == (256 << 20) + GIB
    eight = sizing.pod_sizing(t.spec, 20 * GIB, workers=8)
    assert eight.memory_increase_bytes == 8 * (256 << 20) + GIB


@pytest.mark.parametrize(("patch", "needle"), [
    ({"storage": {"stagingSize": "1Gi"}}, "spec.storage.hostStagingSize applies without a CPU"),
    ({"storage": {"hostStagingSize": "1Gi"}}, "spec.storage.hostStagingSize applies without a CPU"),
    ({"cpu": None, "storage": {"stagingSize": "1Gi", "hostStagingSize": "1Gi"}},
     "stagingSize is hostStagingSize's deprecated name"),
    ({"cpu": None, "storage": {"stagingSize": "4Ki"}}, "too small to stage a KV block"),
])
def test_staging_size_is_refused_where_it_means_nothing(patch, needle):
    from kvtier_operator.validation import InvalidResource

    with pytest.raises(InvalidResource) as err:
        tpc(patch)
    assert needle in "\n".join(err.value.messages)


@pytest.mark.parametrize(("container", "workers"), [
    ({}, 1),
    ({"resources": {"limits": {"nvidia.com/gpu": "4"}}}, 4),
    ({"resources": {"requests": {"amd.com/gpu": 2}}}, 2),
    ({"args": ["--model", "m", "--tensor-parallel-size", "4", "--pipeline-parallel-size=2"]}, 8),
    ({"command": ["sh", "-c"], "args": ["exec vllm serve m -tp 2 -dp 2"]}, 4),
    ({"args": ["--tensor-parallel-size", "$(TP)"]}, 1),  # not a number kvtier can read
])
def test_worker_processes_of_a_container(container, workers):
    assert sizing.worker_processes(container) == workers


def test_router_capacity_from_geometry():
    # Qwen3-32B: 256 KiB/token x 16 tokens = 4 MiB per router block; 100 GiB / 4 MiB.
    assert adapter_for(tpc().spec).router_cpu_blocks(tpc().spec) == 25600
    bigger_blocks = tpc({"router": {"blockSize": 64}}).spec
    assert adapter_for(bigger_blocks).router_cpu_blocks(bigger_blocks) == 6400


# -------------------------------------------------------------- injection

def test_inject_list_form_field_by_field():
    t = tpc()
    pod = vllm_pod(resources={"requests": {"memory": "100Gi"}, "limits": {"memory": "200Gi"}})
    original = copy.deepcopy(pod)
    result = inject(t, pod, CTX)
    assert pod == original, "inject must not edit its input"
    assert result.changed and not result.conflicts and result.container == "vllm"
    c = result.pod["spec"]["containers"][0]
    assert c["args"][:2] == ["Qwen/Qwen3-32B", "--tensor-parallel-size=2"]
    assert kv_flag(c) == kv_transfer_config(t)
    env = env_of(c)
    assert env["PYTHONHASHSEED"] == str(t.hash_seed)
    assert env["PYTHONPATH"] == names.SITE_MOUNT
    assert c["resources"]["requests"]["memory"] == "205Gi"
    assert c["resources"]["limits"]["memory"] == "305Gi"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == names.VOLUME_SHM
    assert mounts["/mnt/files-storage"]["name"] == names.VOLUME_CACHE
    assert mounts[names.SITE_MOUNT] == {"name": names.VOLUME_SITE, "mountPath": names.SITE_MOUNT,
                                        "readOnly": True}
    volumes = {v["name"]: v for v in result.pod["spec"]["volumes"]}
    assert volumes[names.VOLUME_SHM]["emptyDir"] == {"medium": "Memory", "sizeLimit": "102Gi"}
    assert volumes[names.VOLUME_CACHE]["persistentVolumeClaim"] == {"claimName": "cache-kv-cache"}
    assert volumes[names.VOLUME_SITE] == {"name": names.VOLUME_SITE, "emptyDir": {}}
    (init,) = result.pod["spec"]["initContainers"]
    assert init["image"] == "reg/kvtier-offload:1"
    assert init["command"][-3:] == ["install", "--target", names.SITE_MOUNT]
    assert init["securityContext"]["runAsNonRoot"] is True
    assert init["resources"]["limits"]["memory"] == "128Mi"
    ann = result.pod["metadata"]["annotations"]
    assert ann == {names.ANNOTATION_CACHE: "cache",
                   names.ANNOTATION_CONFIG_HASH: config_hash(t, CTX)}


def test_inject_vllm_fs_gets_the_offload_package_for_the_shm_sweep_only():
    t = tpc({"storage": {"backend": "vllm-fs"}})
    c_pod = inject(t, vllm_pod(), CTX).pod
    c = c_pod["spec"]["containers"][0]
    # no kvtier tier or spec: the package is there for the /dev/shm sweep before vLLM
    assert [i["name"] for i in c_pod["spec"]["initContainers"]] == [names.INIT_CONTAINER]
    assert env_of(c)["PYTHONPATH"] == names.SITE_MOUNT
    assert c["command"] == [*names.SHM_SWEEP_PREFIX, "vllm", "serve"]
    assert "module_path" not in json.dumps(kv_flag(c))


def test_inject_no_cpu_tier_mounts_claim_and_backend_but_no_tier():
    t = tpc({"cpu": None})
    c_pod = inject(t, vllm_pod(resources={"requests": {"memory": "100Gi"}}), CTX).pod
    c = c_pod["spec"]["containers"][0]
    assert kv_flag(c)["kv_connector_extra_config"]["spec_name"] == KVTIER_SPEC_NAME
    assert env_of(c)["PYTHONPATH"] == names.SITE_MOUNT
    # the sample pod runs --tensor-parallel-size=2: two worker processes, each with its own
    # 1Gi staging, + shm base 2Gi + headroom 1Gi
    assert c["resources"]["requests"]["memory"] == "105Gi"
    (init,) = c_pod["spec"]["initContainers"]
    assert init["image"] == "reg/kvtier-offload:1"
    vols = {v["name"]: v for v in c_pod["spec"]["volumes"]}
    assert vols[names.VOLUME_SHM]["emptyDir"]["sizeLimit"] == "2Gi"
    assert vols[names.VOLUME_CACHE]["persistentVolumeClaim"] == {"claimName": "cache-kv-cache"}
    assert config_hash(t, CTX) != config_hash(tpc(), CTX)


def test_inject_cpu_only_mounts_no_claim():
    pod = inject(tpc({"storage": None}), vllm_pod(), CTX).pod
    vols = {v["name"] for v in pod["spec"]["volumes"]}
    assert vols == {names.VOLUME_SHM, names.VOLUME_SITE}  # the site: the /dev/shm sweep
    # no memory request or limit before: the request becomes the increase
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"memory": "103Gi"}}


def test_inject_raises_only_existing_limit():
    pod = vllm_pod(resources={"limits": {"memory": "10Gi", "cpu": "2"}})
    c = inject(tpc({"storage": None}), pod, CTX).pod["spec"]["containers"][0]
    assert c["resources"] == {"limits": {"memory": "113Gi", "cpu": "2"}}


def test_inject_shell_form_llm_d_style():
    script = "exec vllm serve \\\n  Qwen/Qwen3-32B \\\n  --tensor-parallel-size=2\n"
    pod = vllm_pod(command=["/bin/sh", "-c"], args=[script])
    c = inject(tpc(), pod, CTX).pod["spec"]["containers"][0]
    assert len(c["args"]) == 1
    # only constant text goes into the script; the JSON stays in the env var
    assert c["args"][0] == ("exec vllm serve \\\n  Qwen/Qwen3-32B \\\n  --tensor-parallel-size=2"
                            ' --kv-transfer-config "$KVTIER_KV_TRANSFER_CONFIG"\n')
    assert json.loads(env_of(c)[names.ENV_KV_TRANSFER_CONFIG]) == kv_transfer_config(tpc())


def test_inject_shell_form_in_command():
    pod = vllm_pod(command=["bash", "-c", "pip list; vllm serve m --port 8000"], args=None)
    c = inject(tpc(), pod, CTX).pod["spec"]["containers"][0]
    assert c["command"][:len(names.SHM_SWEEP_PREFIX)] == list(names.SHM_SWEEP_PREFIX)
    assert c["command"][len(names.SHM_SWEEP_PREFIX) + 2] == ('pip list; vllm serve m --port 8000 --kv-transfer-config '
                               '"$KVTIER_KV_TRANSFER_CONFIG"')


def test_inject_python_module_form():
    pod = vllm_pod(command=["python3", "-m", "vllm.entrypoints.openai.api_server"],
                   args=["--model", "m"])
    c = inject(tpc(), pod, CTX).pod["spec"]["containers"][0]
    assert c["args"][:2] == ["--model", "m"] and c["args"][2] == "--kv-transfer-config"


def test_inject_resizes_own_memory_shm():
    pod = vllm_pod(volumeMounts=[{"name": "shm", "mountPath": "/dev/shm"}])
    pod["spec"]["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory",
                                                            "sizeLimit": "20Gi"}}]
    out = inject(tpc({"storage": None}), pod, CTX).pod
    assert out["spec"]["volumes"][0] == {"name": "shm", "emptyDir": {"medium": "Memory",
                                                                     "sizeLimit": "120Gi"}}
    assert [m["name"] for m in out["spec"]["containers"][0]["volumeMounts"]] == [
        "shm", names.VOLUME_SITE]


def test_finds_vllm_container_among_sidecars():
    pod = vllm_pod()
    pod["spec"]["containers"].insert(0, {"name": "proxy", "image": "envoy", "args": ["-c", "x"]})
    result = inject(tpc(), pod, CTX)
    assert result.container == "vllm"
    assert "--kv-transfer-config" not in str(result.pod["spec"]["containers"][0])


def test_runs_vllm_heuristic():
    assert runs_vllm({"command": ["vllm", "serve"]})
    assert runs_vllm({"command": ["/usr/local/bin/vllm"], "args": ["serve", "m"]})
    assert runs_vllm({"args": ["/bin/sh", "-c", "exec vllm serve m"]})
    assert runs_vllm({"command": ["python", "-m", "vllm.entrypoints.openai.api_server"]})
    assert not runs_vllm({"command": ["python", "server.py", "--vllm"]})
    assert not runs_vllm({"command": ["vllm-router"]})


def test_inject_is_idempotent():
    t = tpc()
    once = inject(t, vllm_pod(), CTX).pod
    twice = inject(t, once, CTX)
    assert not twice.changed and twice.pod == once


@pytest.mark.parametrize(
    ("pod", "spec", "needle"),
    [
        (vllm_pod(args=["m", "--kv-transfer-config", "{}"]), {}, "already passes --kv-transfer-config"),
        (vllm_pod(args=["m", "--kv-offloading-size=10"]), {}, "--kv-offloading-size"),
        (vllm_pod(command=["sh", "-c", "vllm serve m --kv-offloading-backend native"], args=None),
         {}, "--kv-offloading-backend"),
        (vllm_pod(env=[{"name": "PYTHONHASHSEED", "value": "7"}]), {"hashSeed": 8},
         "sets PYTHONHASHSEED=7; kvtier needs 8: remove it from the pod or set spec.hashSeed"),
        (vllm_pod(command=["python", "app.py"], args=None), {}, "no container runs 'vllm serve'"),
        (vllm_pod(), {"containerName": "modelserver"},
         "no container named 'modelserver' (containers: vllm); fix spec.containerName"),
        (vllm_pod(volumeMounts=[{"name": "cache", "mountPath": "/mnt/files-storage"}]), {},
         "already mounts volume 'cache' at /mnt/files-storage"),
        (vllm_pod(env=[{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {}}}]), {},
         "takes PYTHONPATH from valueFrom"),
    ],
)
def test_conflicts_leave_pod_untouched(pod, spec, needle):
    result = inject(tpc(spec), pod, CTX)
    assert not result.changed
    assert result.pod == pod
    assert any(needle in c for c in result.conflicts), result.conflicts


def test_conflict_on_non_memory_shm():
    pod = vllm_pod(volumeMounts=[{"name": "shm", "mountPath": "/dev/shm"}])
    pod["spec"]["volumes"] = [{"name": "shm", "hostPath": {"path": "/dev/shm"}}]
    result = inject(tpc(), pod, CTX)
    assert not result.changed
    assert "not a memory-backed emptyDir" in result.conflicts[0]


def test_matching_pythonhashseed_is_no_conflict_and_pythonpath_is_prepended():
    t = tpc({"hashSeed": 9})
    pod = vllm_pod(env=[{"name": "PYTHONHASHSEED", "value": "9"},
                        {"name": "PYTHONPATH", "value": "/app"}])
    result = inject(t, pod, CTX)
    assert result.changed
    env = env_of(result.pod["spec"]["containers"][0])
    assert env["PYTHONPATH"] == f"{names.SITE_MOUNT}:/app"


def test_config_hash_tracks_what_pods_carry():
    base = config_hash(tpc(), CTX)
    assert base == config_hash(tpc(), CTX)
    assert base != config_hash(tpc({"cpu": {"size": "50Gi"}}), CTX)
    assert base != config_hash(tpc(), RenderContext(offload_image="reg/other:2"))
    # eviction settings never reach the pod: changing them must not restart model servers
    assert base == config_hash(tpc({"eviction": {"highWatermark": 95}}), CTX)


def test_inject_workloads():
    dep = example("vllm-deployment.yaml")
    out, conflicts = inject_workload(tpc(), dep, CTX)
    assert not conflicts
    assert kv_flag_in_script(out["spec"]["template"]["spec"]["containers"][0])
    lws = {"kind": "LeaderWorkerSet", "spec": {"leaderWorkerTemplate": {
        "leaderTemplate": vllm_pod(), "workerTemplate": vllm_pod()}}}
    out, conflicts = inject_workload(tpc(), lws, CTX)
    for role in ("leaderTemplate", "workerTemplate"):
        c = out["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"][0]
        assert "--kv-transfer-config" in c["args"]
    with pytest.raises(ValueError, match="no pod template kvtier knows"):
        inject_workload(tpc(), {"kind": "Service"}, CTX)


def kv_flag_in_script(container) -> bool:
    return "--kv-transfer-config" in container["args"][0]


# ---------------------------------------------------------------- cronjob

def test_cronjob_fields():
    t = tpc({"eviction": {"schedule": "*/10 * * * *", "highWatermark": 90, "lowWatermark": 60,
                          "minIdle": "1h", "suspend": True, "fsGroup": 2000}}, uid="u")
    cj = render_cronjob(t, CTX)
    assert cj["metadata"]["name"] == "cache-evictor"
    assert cj["metadata"]["ownerReferences"][0]["uid"] == "u"
    spec = cj["spec"]
    assert spec["schedule"] == "*/10 * * * *"
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["suspend"] is True
    assert spec["startingDeadlineSeconds"] > 0
    assert spec["successfulJobsHistoryLimit"] == 3 and spec["failedJobsHistoryLimit"] == 3
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroup"] == 2000
    assert pod["automountServiceAccountToken"] is False  # the evictor needs no API access
    (c,) = pod["containers"]
    assert c["image"] == "reg/kvtier:1"
    assert c["command"] == ["kvtier-evictor"]
    from kvtier_evictor.cli import build_parser

    parsed = build_parser().parse_args(c["args"])
    assert (parsed.high_watermark, parsed.low_watermark) == (90, 60)
    assert parsed.min_idle_seconds == 3600 and parsed.layout == "kvtier"
    assert parsed.capacity_bytes is None and parsed.ok_exit_zero
    assert c["resources"]["limits"]["memory"] == "512Mi"
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "cache-kv-cache"


def test_cronjob_claim_size_mode_and_layouts():
    cj = render_cronjob(tpc({"eviction": {"capacity": "ClaimSize"}}), CTX)
    args = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--capacity-bytes") + 1] == str(1024**4)
    fs = render_cronjob(tpc({"storage": {"backend": "vllm-fs"}}), CTX)
    assert "vllm-fs" in fs["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert render_cronjob(tpc({"storage": None}), CTX) is None


# ----------------------------------------------------------------- router

def test_router_config():
    assert render_router_configmap(tpc()) is None
    cm = render_router_configmap(tpc({"router": {"enabled": True, "configMapName": "epp"}}))
    assert cm["metadata"]["name"] == "epp"
    cfg = endpoint_picker_config(tpc({"router": {"enabled": True}}))
    cpu = next(p for p in cfg["plugins"] if p.get("name") == "cpu-prefix-cache-producer")
    assert cpu["parameters"] == {"autoTune": False, "blockSizeTokens": 16,
                                 "lruCapacityPerServer": 25600}
    refs = [p["pluginRef"] for p in cfg["schedulingProfiles"][0]["plugins"]]
    assert "cpu-prefix-cache-scorer" in refs and "gpu-prefix-cache-scorer" in refs


def test_router_config_without_cpu_tier_scores_gpu_only():
    cfg = endpoint_picker_config(tpc({"cpu": None, "router": {"enabled": True}}))
    names_ = {p.get("name") or p["type"] for p in cfg["plugins"]}
    assert not any(n.startswith("cpu-") for n in names_)
    refs = [p["pluginRef"] for p in cfg["schedulingProfiles"][0]["plugins"]]
    assert refs == ["queue-scorer", "kv-cache-utilization-scorer", "gpu-prefix-cache-scorer",
                    "no-hit-lru-scorer"]
    assert set(refs) <= names_


def test_render_objects_orders_and_filters():
    kinds = [o["kind"] for o in render_objects(tpc({"router": {"enabled": True}}), CTX)]
    assert kinds == ["PersistentVolumeClaim", "CronJob", "ConfigMap"]
    assert render_objects(tpc({"storage": None}), CTX) == []


def test_renders_are_deterministic():
    a = render_objects(tpc({"router": {"enabled": True}}), CTX)
    b = render_objects(tpc({"router": {"enabled": True}}), CTX)
    assert a == b
