"""spec.storage.permissions: model servers that do not run as root write a fresh volume.
fsGroup on the pods (and the evictor); the opt-in init container that prepares only the
tier's own directory, in exec form, as root with three capabilities; never the model
server as root."""

from __future__ import annotations

import pytest

from kvtier_operator import names
from kvtier_operator.context import RenderContext
from kvtier_operator.render.cronjob import render_cronjob
from kvtier_operator.render.pod import config_hash, inject, inject_workload
from kvtier_operator.validation import InvalidResource, parse_tpc
from tests.helpers import example, tpc_doc, vllm_pod

CTX = RenderContext(offload_image="reg/kvtier-offload:1")


def tpc(spec):
    return parse_tpc(tpc_doc(spec))


def storage(permissions, **more):
    return {"storage": {"pvc": {"size": "1Ti"}, "permissions": permissions, **more}}


def test_fs_group_goes_on_the_pod_and_the_evictor_and_nothing_runs_as_root():
    t = tpc(storage({"fsGroup": 1000}))
    out = inject(t, vllm_pod(), CTX)
    assert out.conflicts == []
    spec = out.pod["spec"]
    assert spec["securityContext"] == {"fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"}
    assert not any(c["name"] == names.PREPARE_CONTAINER for c in spec.get("initContainers", []))
    for c in spec["containers"] + spec.get("initContainers", []):
        assert (c.get("securityContext") or {}).get("runAsUser") != 0, c["name"]
    job = render_cronjob(t, CTX)["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert job["securityContext"]["fsGroup"] == 1000
    # eviction.fsGroup, where set, is the evictor's.
    own = tpc({**storage({"fsGroup": 1000}), "eviction": {"fsGroup": 2000}})
    job = render_cronjob(own, CTX)["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert job["securityContext"]["fsGroup"] == 2000


@pytest.mark.parametrize(("spec", "directory"), [
    ({}, ""),  # vLLM's tiers write in the mount itself (root_dir)
    ({"connector": "lmcache"}, "lmcache"),
    ({"storage": {"backend": "vllm-fs"}}, ""),
])
def test_prepare_directory_is_an_exec_form_init_container_for_the_tiers_own_directory(
        spec, directory):
    doc = tpc_doc({**storage({"fsGroup": 1000, "prepareDirectory": True},
                             mountPath="/mnt/kv")})
    doc["spec"].update({k: v for k, v in spec.items() if k != "storage"})
    doc["spec"]["storage"].update(spec.get("storage", {}))
    pod = vllm_pod()
    pod["spec"]["initContainers"] = [{"name": "model-download", "image": "busybox"}]
    out = inject(parse_tpc(doc), pod, CTX)
    assert out.conflicts == []
    first = out.pod["spec"]["initContainers"][0]  # before anything else the pod runs
    assert first["name"] == names.PREPARE_CONTAINER
    assert first["command"] == ["python3", "-m", "kvtier_offload", "prepare-dir", "--mount",
                                "/mnt/kv", "--dir", directory, "--group", "1000"]
    assert "args" not in first  # no shell anywhere
    assert first["image"] == "reg/kvtier-offload:1"
    assert first["volumeMounts"] == [{"name": names.VOLUME_CACHE, "mountPath": "/mnt/kv"}]
    security = first["securityContext"]
    assert security["runAsUser"] == 0 and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"],
                                        "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]}
    assert security["readOnlyRootFilesystem"] is True
    model_server = out.pod["spec"]["containers"][0]
    assert (model_server.get("securityContext") or {}).get("runAsUser") is None


def test_sglang_prepares_its_own_directory():
    doc = example("sglang-hicache.yaml")
    doc["spec"]["storage"]["permissions"] = {"fsGroup": 1000, "prepareDirectory": True}
    out, conflicts = inject_workload(parse_tpc(doc), example("sglang-deployment.yaml"), CTX)
    assert conflicts == []
    first = out["spec"]["template"]["spec"]["initContainers"][0]
    assert first["command"][first["command"].index("--dir") + 1] == "sglang"


def test_a_pod_with_another_fs_group_is_left_alone_and_reported():
    pod = vllm_pod()
    pod["spec"]["securityContext"] = {"fsGroup": 5}
    out = inject(tpc(storage({"fsGroup": 1000})), pod, CTX)
    assert not out.changed
    assert any("securityContext.fsGroup 5" in c and "permissions.fsGroup is 1000" in c
               for c in out.conflicts)
    same = vllm_pod()
    same["spec"]["securityContext"] = {"fsGroup": 1000, "fsGroupChangePolicy": "Always"}
    out = inject(tpc(storage({"fsGroup": 1000})), same, CTX)
    assert out.conflicts == []
    assert out.pod["spec"]["securityContext"]["fsGroupChangePolicy"] == "Always"  # the pod's


@pytest.mark.parametrize(("permissions", "needle"), [
    ({"prepareDirectory": True}, "fsGroup"),  # the group is required
    ({"fsGroup": 0}, "greater than or equal to 1"),  # never root's group
    ({"fsGroup": 1000, "extra": 1}, "permissions.extra: unknown field"),
])
def test_bad_permissions_are_refused(permissions, needle):
    with pytest.raises(InvalidResource, match=needle):
        tpc(storage(permissions))


def test_pods_without_permissions_keep_their_config_hash():
    # No new key in the hash unless permissions are asked for: running pods stay current.
    plain = tpc({})
    assert config_hash(plain, CTX) == config_hash(tpc(storage(None)), CTX)
    assert config_hash(plain, CTX) != config_hash(tpc(storage({"fsGroup": 1000})), CTX)
