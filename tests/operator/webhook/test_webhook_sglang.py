"""SGLang pods through the real webhook over HTTPS: every SGLang pod shape gets the
HiCache flags (in --flag=value form), the storage directory env and the volume; the
patch is applied with an independent JSON-patch library and the result validated
against the Pod schema; SGLang's own parser accepts the patched command line where it is
installed."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from kvtier_operator import names
from kvtier_operator.engines.sglang.hicache import ENV_STORAGE_DIR
from kvtier_operator.webhook import MUTATE_PATH
from tests.helpers import EXAMPLES
from tests.operator.webhook.test_webhook import K8S, apply, review, webhook  # noqa: F401

CACHE = yaml.safe_load((EXAMPLES / "sglang-hicache.yaml").read_text())
LABELS = {"llm-d.ai/engine-type": "sglang"}


def llmd_pod():
    dep = yaml.safe_load((EXAMPLES / "sglang-deployment.yaml").read_text())
    tmpl = copy.deepcopy(dep["spec"]["template"])
    tmpl["spec"]["containers"].append({"name": "proxy", "image": "envoy"})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**tmpl["metadata"], "name": "sglang-0", "namespace": "llm-d"},
            "spec": tmpl["spec"]}


def pod(command, args=None, **container):
    c = {"name": "sglang", "image": "lmsysorg/sglang:v0.5.23", "command": command, **container}
    if args is not None:
        c["args"] = args
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "sglang-1", "namespace": "llm-d", "labels": dict(LABELS)},
            "spec": {"containers": [c, {"name": "proxy", "image": "envoy"}]}}


# name -> (pod, GPUs/ranks the flags must be sized for)
SHAPES = {
    "llm-d": (llmd_pod, 2),
    "sglang-serve": (lambda: pod(["sglang", "serve", "Qwen/Qwen3-32B", "--tp=4"]), 4),
    "python-module": (lambda: pod(["python", "-m", "sglang.launch_server"],
                                  ["--model-path", "m"]), 1),
    "sh-c": (lambda: pod(["/bin/sh", "-c"], [
        "set -e\nexec python3 -m sglang.launch_server \\\n  --model-path=m \\\n"
        "  --tensor-parallel-size=8 --port=8000\n"]), 8),
    "bash-lc-serve": (lambda: pod(["bash", "-lc", "exec sglang serve m --page-size=64"],
                                  resources={"limits": {"nvidia.com/gpu": "1",
                                                        "memory": "64Gi"}}), 1),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_every_sglang_pod_shape(webhook, shape):  # noqa: F811
    webhook.caches.observe("ADDED", copy.deepcopy(CACHE))
    make, ranks = SHAPES[shape]
    original = make()
    status, answer = await webhook.post(MUTATE_PATH, review(original))
    assert status == 200 and answer["response"]["allowed"] is True
    patched = apply(copy.deepcopy(original), answer)
    kubernetes_validate.validate(patched, K8S, strict=True)
    c = next(c for c in patched["spec"]["containers"] if c["name"] == "sglang")
    line = " ".join(c.get("command", []) + c.get("args", []))
    hicache = 400 * 2**30 // (ranks * 10**9)
    for word in ("--enable-hierarchical-cache", f"--hicache-size={hicache}",
                 "--hicache-write-policy=write_through", "--hicache-io-backend=kernel",
                 "--page-size=64", "--hicache-storage-backend=file"):
        assert line.count(word) == 1, (word, line)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[ENV_STORAGE_DIR] == "/mnt/files-storage/sglang"
    assert {"name": names.VOLUME_CACHE, "mountPath": "/mnt/files-storage"} in c["volumeMounts"]
    assert "--kv-transfer-config" not in line and not patched["spec"].get("initContainers")
    assert patched["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]
    proxy = next(c for c in patched["spec"]["containers"] if c["name"] == "proxy")
    assert proxy == {"name": "proxy", "image": "envoy"}
    status, again = await webhook.post(MUTATE_PATH, review(patched, uid="u-2"))
    assert "patch" not in again["response"]  # idempotent


async def test_sglang_pod_with_its_own_evictor_is_a_conflict_left_alone(webhook):  # noqa: F811
    webhook.caches.observe("ADDED", copy.deepcopy(CACHE))
    p = pod(["sglang", "serve", "m", "--page-size=32"],
            env=[{"name": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "value": "100G"}])
    status, answer = await webhook.post(MUTATE_PATH, review(p))
    assert status == 200 and answer["response"]["allowed"] is True
    assert "patch" not in answer["response"]
    (conflict,) = webhook.conflicts.for_cache("llm-d", "qwen3-sglang", ["sglang-1"]).values()
    assert "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE" in conflict
    assert "passes --page-size=32; kvtier needs --page-size=64" in conflict


async def test_every_conflict_of_a_pod_reaches_the_status(webhook):  # noqa: F811
    """A pod left alone for two reasons (a flag and an env var) has both recorded for the
    cache's status, not only the last one."""
    webhook.caches.observe("ADDED", copy.deepcopy(CACHE))
    p = pod(["sglang", "serve", "m", "--page-size=32"],
            env=[{"name": "PYTHONHASHSEED", "value": "7"}])
    status, answer = await webhook.post(MUTATE_PATH, review(p))
    assert status == 200 and "patch" not in answer["response"]
    assert len(answer["response"]["warnings"]) == 2
    (conflict,) = webhook.conflicts.for_cache("llm-d", "qwen3-sglang", ["sglang-1"]).values()
    assert "--page-size=32" in conflict and "PYTHONHASHSEED=7" in conflict


async def test_vllm_pods_are_not_sglang_pods(webhook):  # noqa: F811
    webhook.caches.observe("ADDED", copy.deepcopy(CACHE))
    p = pod(["vllm", "serve", "m"])
    status, answer = await webhook.post(MUTATE_PATH, review(p))
    assert status == 200 and "patch" not in answer["response"]
