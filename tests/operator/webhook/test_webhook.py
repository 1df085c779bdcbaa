"""Real AdmissionReview requests over HTTPS against the real webhook server."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import socket
import ssl
import time

import aiohttp
import jsonpatch
import kubernetes_validate
import pytest
import yaml

from kvtier_demo.certs import make_certs
from kvtier_demo.samples import VLLM_GPU, sample_workload
from kvtier_demo.sandbox import DEMO_OBJECT_ENDPOINTS
from kvtier_operator import names
from kvtier_operator.context import RenderContext
from kvtier_operator.webhook import (
    MUTATE_PATH,
    VALIDATE_PATH,
    CacheRegistry,
    ConflictLog,
    make_app,
    serve,
    tls_context,
    watch_certificates,
)
from tests.helpers import EXAMPLES, tpc_doc

# The examples' object store endpoint is one an install would allow (the chart's
# objectStore.allowedEndpoints), as make demo does.
CTX = RenderContext(offload_image="reg/kvtier-offload:1",
                    allowed_object_endpoints=DEMO_OBJECT_ENDPOINTS)
K8S = kubernetes_validate.latest_version()
CR_EXAMPLES = {p.name: yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))}
CR_EXAMPLES = {n: d for n, d in CR_EXAMPLES.items() if d["kind"] == "TieredPrefixCache"}
# vLLM-on-GPU variants meet the GPU pod shapes; the others meet their own workload's pods.
VARIANTS = sorted(n for n, d in CR_EXAMPLES.items() if sample_workload(d) == VLLM_GPU)
# SGLang's pod shapes have their own file (test_webhook_sglang.py).
TPU_VARIANTS = sorted(n for n, d in CR_EXAMPLES.items() if d["spec"].get("engine") == "vllm-tpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Webhook:
    def __init__(self, caches, conflicts, url, ca, certdir):
        self.caches, self.conflicts, self.url, self.ca, self.certdir = \
            caches, conflicts, url, ca, certdir
        self.client_ssl = ssl.create_default_context(cafile=str(ca))

    async def post(self, path, payload=None, data=None, headers=None):
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            body = data if data is not None else json.dumps(payload).encode()
            async with session.post(self.url + path, data=body, ssl=self.client_ssl,
                                    headers={"Content-Type": "application/json",
                                             **(headers or {})}) as resp:
                text = await resp.text()
                return resp.status, (json.loads(text) if text.startswith("{") else text)


@pytest.fixture
async def webhook(tmp_path):
    ca = make_certs(tmp_path / "certs")
    caches, conflicts = CacheRegistry(), ConflictLog()
    port = free_port()
    tls = tls_context(str(tmp_path / "certs" / "tls.crt"), str(tmp_path / "certs" / "tls.key"))
    runner = await serve(make_app(caches, conflicts, CTX), "127.0.0.1", port, tls)
    yield Webhook(caches, conflicts, f"https://127.0.0.1:{port}", ca, tmp_path / "certs")
    await runner.cleanup()


def review(obj, operation="CREATE", uid="u-1"):
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "operation": operation, "namespace": "llm-d",
                        "object": obj}}


def apply(pod, response):
    r = response["response"]
    if "patch" not in r:
        return pod
    assert r["patchType"] == "JSONPatch"
    return jsonpatch.apply_patch(pod, json.loads(base64.b64decode(r["patch"])))


def sample_pod():
    dep = yaml.safe_load((EXAMPLES / "vllm-deployment.yaml").read_text())
    tmpl = copy.deepcopy(dep["spec"]["template"])
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**tmpl["metadata"], "name": "decode-0", "namespace": "llm-d"},
            "spec": tmpl["spec"]}


def minimal_pod():
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "decode-1", "namespace": "llm-d",
                         "labels": {"llm-d.ai/role": "decode"}},
            "spec": {"containers": [{"name": "modelserver", "image": "vllm/vllm-openai",
                                     "command": ["vllm", "serve", "m"]}]}}


def busy_pod():
    pod = minimal_pod()
    c = pod["spec"]["containers"][0]
    c["command"] = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    c["args"] = ["--model", "m"]
    c["env"] = [{"name": "A", "value": "1"}]
    c["volumeMounts"] = [{"name": "models", "mountPath": "/models"}]
    c["resources"] = {"requests": {"memory": "64Gi", "cpu": "4"}}
    pod["spec"]["volumes"] = [{"name": "models", "emptyDir": {}}]
    pod["spec"]["initContainers"] = [{"name": "warmup", "image": "busybox", "command": ["true"]}]
    pod["spec"]["containers"].append({"name": "proxy", "image": "envoy"})
    return pod


SHAPES = {"llm-d": sample_pod, "minimal": minimal_pod, "busy": busy_pod}


def load_example(name):
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    doc["spec"].pop("containerName", None)  # find the vLLM container by its command
    return doc


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("variant", VARIANTS)
async def test_every_variant_and_pod_shape(webhook, variant, shape):
    webhook.caches.observe("ADDED", load_example(variant))
    pod = SHAPES[shape]()
    status, answer = await webhook.post(MUTATE_PATH, review(pod))
    assert status == 200 and answer["response"]["allowed"] is True
    assert answer["response"]["uid"] == "u-1"
    patched = apply(pod, answer)
    kubernetes_validate.validate(patched, K8S, strict=True)
    vllm = next(c for c in patched["spec"]["containers"] if c["name"] == "modelserver")
    assert "--kv-transfer-config" in json.dumps(vllm)
    assert patched["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]
    # idempotent: the patched pod comes back unchanged
    status, again = await webhook.post(MUTATE_PATH, review(patched, uid="u-2"))
    assert "patch" not in again["response"]


async def test_unselected_and_opted_out_pods_pass_untouched(webhook):
    webhook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
    other = minimal_pod()
    other["metadata"]["labels"] = {"llm-d.ai/role": "prefill"}
    opted = minimal_pod()
    opted["metadata"]["labels"][names.LABEL_OPT_OUT] = "false"
    for pod in (other, opted):
        _, answer = await webhook.post(MUTATE_PATH, review(pod))
        assert answer["response"] == {"uid": "u-1", "allowed": True}


async def test_updates_are_not_mutated(webhook):
    webhook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
    _, answer = await webhook.post(MUTATE_PATH, review(minimal_pod(), operation="UPDATE"))
    assert "patch" not in answer["response"]


async def test_hand_made_offloading_is_a_conflict_not_an_override(webhook):
    webhook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
    pod = minimal_pod()
    pod["spec"]["containers"][0]["command"] += ["--kv-transfer-config", "{}"]
    _, answer = await webhook.post(MUTATE_PATH, review(pod))
    assert answer["response"]["allowed"] and "patch" not in answer["response"]
    assert "already passes --kv-transfer-config" in answer["response"]["warnings"][0]
    (pod, conflict), = webhook.conflicts.for_cache("llm-d", "qwen3-tiered", ["decode-1"]).items()
    assert pod == "decode-1"
    assert conflict.startswith("container 'modelserver' already passes")


async def test_two_caches_selecting_one_pod_both_report_it(webhook):
    a = tpc_doc({"storage": None}, name="a", namespace="llm-d")
    b = tpc_doc({"storage": None, "selector": {"matchLabels": {"llm-d.ai/role": None,
                                                               "app": "vllm"}}},
                name="b", namespace="llm-d")
    b["spec"]["selector"] = {"matchLabels": {"app": "vllm"}}
    webhook.caches.observe("ADDED", a)
    webhook.caches.observe("ADDED", b)
    pod = minimal_pod()
    pod["metadata"]["labels"]["app"] = "vllm"
    _, answer = await webhook.post(MUTATE_PATH, review(pod))
    assert "patch" not in answer["response"]
    for cache in ("a", "b"):
        (c,) = webhook.conflicts.for_cache("llm-d", cache, ["decode-1"]).values()
        assert "selected by several TieredPrefixCaches (a, b)" in c
    assert webhook.conflicts.for_cache("llm-d", "a", []) == {}  # forgotten once the pod is gone


async def test_missing_container_is_reported(webhook):
    doc = load_example("native-kvtier.yaml")
    doc["spec"]["containerName"] = "nope"
    webhook.caches.observe("ADDED", doc)
    _, answer = await webhook.post(MUTATE_PATH, review(minimal_pod()))
    assert "patch" not in answer["response"]
    assert "no container named 'nope'" in answer["response"]["warnings"][0]


@pytest.mark.parametrize("body", [b"not json", b'{"kind": "AdmissionReview", "requ',
                                  b"[]", b'{"kind": "AdmissionReview"}',
                                  b'{"kind": "AdmissionReview", "request": {"operation": "CREATE"}}',
                                  b"\xff\xfe"])
async def test_garbage_gets_400(webhook, body):
    for path in (MUTATE_PATH, VALIDATE_PATH):
        status, answer = await webhook.post(path, data=body)
        assert status == 400, (path, body, answer)
        assert "error" in answer


@pytest.mark.slow
async def test_oversized_body_gets_413(webhook):
    status, _ = await webhook.post(MUTATE_PATH, data=b"{" + b" " * (4 * 1024 * 1024) + b"}")
    assert status == 413


async def test_server_survives_all_of_that(webhook):
    await test_garbage_gets_400(webhook, b"x")
    async with aiohttp.ClientSession() as session:
        async with session.get(webhook.url + "/healthz", ssl=webhook.client_ssl) as resp:
            assert resp.status == 200


def workload_pods(workload_file):
    """The pods a workload's controller would create (LeaderWorkerSet: leader and worker,
    with the index label and the group size annotation LWS adds)."""
    workload = yaml.safe_load((EXAMPLES / workload_file).read_text())
    size = None
    if workload["kind"] == "LeaderWorkerSet":
        group = workload["spec"]["leaderWorkerTemplate"]
        templates = [(group["leaderTemplate"], "0"), (group["workerTemplate"], "1")]
        size = str(group["size"])
    else:
        templates = [(workload["spec"]["template"], None)]
    pods = []
    for template, index in templates:
        meta = copy.deepcopy(template["metadata"])
        if index is not None:
            meta["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] = index
            meta.setdefault("annotations", {})["leaderworkerset.sigs.k8s.io/size"] = size
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {**meta, "name": f"decode-{index or 0}", "namespace": "llm-d"},
                     "spec": copy.deepcopy(template["spec"])})
    return pods


@pytest.mark.parametrize("variant", TPU_VARIANTS)
async def test_tpu_engines_in_their_own_pod_shapes(webhook, variant):
    """TPU single-host pods, TPU multi-host leaders and workers: patched over HTTPS, the
    patch applied with an independent JSON-patch library, the result a valid Pod."""
    doc = CR_EXAMPLES[variant]
    webhook.caches.observe("ADDED", copy.deepcopy(doc))
    for i, pod in enumerate(workload_pods(sample_workload(doc))):
        status, answer = await webhook.post(MUTATE_PATH, review(pod, uid=f"u-{i}"))
        assert status == 200 and answer["response"]["allowed"] is True
        assert not answer["response"].get("warnings"), answer["response"]["warnings"]
        patched = apply(pod, answer)
        kubernetes_validate.validate(patched, K8S, strict=True)
        (c,) = patched["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TPU_OFFLOAD_NUM_CPU_CHUNKS"].isdigit()
        assert c["resources"]["requests"]["memory"]
        serves = "vllm serve" in json.dumps(c)
        assert ("--kv-transfer-config" in json.dumps(c)) == serves
        assert patched["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]
        _, again = await webhook.post(MUTATE_PATH, review(patched, uid=f"v-{i}"))
        assert "patch" not in again["response"]


async def test_tpu_hosts_other_than_the_leaderworkerset_size_is_a_conflict(webhook):
    """A LeaderWorkerSet pod of 2 hosts under spec.tpu.hosts 4 would get a quarter of each
    chunk's memory: left alone, with a warning and a recorded conflict naming both."""
    doc = copy.deepcopy(CR_EXAMPLES["vllm-tpu-multi-host.yaml"])
    doc["spec"]["tpu"]["hosts"] = 4
    webhook.caches.observe("ADDED", doc)
    for i, pod in enumerate(workload_pods("tpu-leaderworkerset.yaml")):
        _, answer = await webhook.post(MUTATE_PATH, review(pod, uid=f"u-{i}"))
        r = answer["response"]
        assert r["allowed"] is True and "patch" not in r
        assert any("spec.tpu.hosts is 4" in w and "leaderworkerset.sigs.k8s.io/size annotation is 2" in w
                   for w in r["warnings"]), r["warnings"]
    recorded = webhook.conflicts.for_cache("llm-d", doc["metadata"]["name"],
                                           ["decode-0", "decode-1"])
    assert sorted(recorded) == ["decode-0", "decode-1"]
    assert all("spec.tpu.hosts is 4" in why for why in recorded.values())


async def test_validating_webhook_refuses_an_impossible_engine_pair(webhook):
    bad = tpc_doc({"engine": "vllm-tpu", "tpu": {"pageSize": 128}}, name="x",
                  namespace="llm-d")  # keeps the base's storage.pvc
    _, answer = await webhook.post(VALIDATE_PATH, review(bad))
    r = answer["response"]
    assert r["allowed"] is False and r["status"]["code"] == 422
    assert "spec.storage: engine vllm-tpu and connector native has no shared file tier" in \
        r["status"]["message"]


async def test_validating_webhook(webhook):
    existing = tpc_doc(name="decode", namespace="llm-d")
    webhook.caches.observe("ADDED", existing)
    bad = tpc_doc({"eviction": {"lowWatermark": 90}}, name="x", namespace="llm-d")
    _, answer = await webhook.post(VALIDATE_PATH, review(bad))
    r = answer["response"]
    assert r["allowed"] is False and r["status"]["code"] == 422
    assert "spec.eviction: lowWatermark 90 must be below highWatermark 85" in r["status"]["message"]
    overlapping = tpc_doc(name="x", namespace="llm-d")
    _, answer = await webhook.post(VALIDATE_PATH, review(overlapping))
    assert answer["response"]["allowed"] is False
    assert "may select the same pods as decode" in answer["response"]["status"]["message"]
    disjoint = tpc_doc({"selector": {"matchLabels": {"llm-d.ai/role": "prefill"}}},
                       name="x", namespace="llm-d")
    _, answer = await webhook.post(VALIDATE_PATH, review(disjoint))
    assert answer["response"]["allowed"] is True
    _, answer = await webhook.post(VALIDATE_PATH, review(existing, operation="UPDATE"))
    assert answer["response"]["allowed"] is True  # a resource never overlaps itself


@pytest.mark.parametrize(("change", "field"), [
    ({"engine": "sglang", "sglang": {}}, "spec.engine"),
    ({"connector": "lmcache"}, "spec.connector"),
    ({"storage": {"backend": "vllm-fs"}}, "spec.storage.backend"),
])
async def test_validating_webhook_refuses_changing_the_engine_of_a_live_cache(
        webhook, change, field):
    old = tpc_doc(name="decode", namespace="llm-d")
    new = tpc_doc(change, name="decode", namespace="llm-d")
    update = review(new, operation="UPDATE")
    update["request"]["oldObject"] = old
    _, answer = await webhook.post(VALIDATE_PATH, update)
    r = answer["response"]
    assert r["allowed"] is False and r["status"]["code"] == 422
    assert f"{field} cannot change on a live TieredPrefixCache: create a new " \
        "TieredPrefixCache (and PVC) for another engine; delete this one" in r["status"]["message"]
    _, answer = await webhook.post(VALIDATE_PATH, review(new))  # a create: allowed
    assert answer["response"]["allowed"] is True


async def test_validating_webhook_allows_updates_that_keep_the_engine(webhook):
    old = tpc_doc(name="decode", namespace="llm-d")
    for change in ({"cpu": {"size": "200Gi"}},
                   {"engine": "vllm", "connector": "native", "storage": {"backend": "kvtier"}}):
        update = review(tpc_doc(change, name="decode", namespace="llm-d"), operation="UPDATE")
        update["request"]["oldObject"] = old
        _, answer = await webhook.post(VALIDATE_PATH, update)
        assert answer["response"]["allowed"] is True, answer


async def test_certificate_rotation_is_picked_up(tmp_path):
    certs = tmp_path / "certs"
    ca1 = make_certs(certs)
    tls = tls_context(str(certs / "tls.crt"), str(certs / "tls.key"))
    port = free_port()
    runner = await serve(make_app(CacheRegistry(), ConflictLog(), CTX), "127.0.0.1", port, tls)
    watcher = asyncio.create_task(watch_certificates(tls, str(certs / "tls.crt"),
                                                     str(certs / "tls.key"), interval=0.05))
    await asyncio.sleep(0.1)  # the watcher has taken its first look at the files
    try:
        ca_copy = tmp_path / "ca1.crt"
        ca_copy.write_bytes(ca1.read_bytes())
        make_certs(certs)  # rotate: a new CA and serving certificate
        await asyncio.sleep(0.3)
        new_ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        old_ctx = ssl.create_default_context(cafile=str(ca_copy))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://127.0.0.1:{port}/healthz", ssl=new_ctx) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(f"https://127.0.0.1:{port}/healthz", ssl=old_ctx):
                    pass
    finally:
        watcher.cancel()
        await runner.cleanup()


class CountingContext(ssl.SSLContext):
    """A server context that counts the certificate loads into it."""

    loads = 0

    def load_cert_chain(self, *args, **kwargs):
        self.loads += 1
        super().load_cert_chain(*args, **kwargs)


async def watched_context(certs):
    """A server context over certs/, its watcher running every 20 ms, once it has looked."""
    ctx = CountingContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(certs / "tls.crt"), str(certs / "tls.key"))
    ctx.loads = 0
    watcher = asyncio.create_task(watch_certificates(ctx, str(certs / "tls.crt"),
                                                     str(certs / "tls.key"), interval=0.02))
    await asyncio.sleep(0.05)
    return ctx, watcher


def times(certs) -> dict[str, tuple[int, int]]:
    return {name: (os.stat(certs / name).st_atime_ns, os.stat(certs / name).st_mtime_ns)
            for name in ("tls.crt", "tls.key")}


async def test_a_rotation_that_keeps_the_mtimes_is_picked_up(tmp_path):
    """A copy that preserves mtimes (cp -p, some secret syncers): the content decides."""
    certs = tmp_path / "certs"
    make_certs(certs)
    ctx, watcher = await watched_context(certs)
    try:
        before = times(certs)
        make_certs(certs)  # rotate
        for name, (atime, mtime) in before.items():
            os.utime(certs / name, ns=(atime, mtime))
        assert times(certs) == before
        for _ in range(100):
            if ctx.loads:
                break
            await asyncio.sleep(0.02)
        assert ctx.loads == 1
    finally:
        watcher.cancel()


async def test_new_mtimes_on_the_same_certificate_do_not_reload_it(tmp_path):
    certs = tmp_path / "certs"
    make_certs(certs)
    ctx, watcher = await watched_context(certs)
    try:
        for name in ("tls.crt", "tls.key"):
            path = certs / name
            path.write_bytes(path.read_bytes())  # rewritten, the same bytes
            os.utime(path, ns=(time.time_ns() + 10**11,) * 2)
        await asyncio.sleep(0.2)  # ten looks at the files
        assert ctx.loads == 0
    finally:
        watcher.cancel()


@pytest.mark.parametrize(("src", "dst"), [
    ({"a": 1}, {"a": 2}),
    ({"a": {"b/c": 1, "d~e": 2}}, {"a": {"b/c": 3}}),
    ({"l": [1, 2, {"x": 1}]}, {"l": [1, {"x": 2}]}),
    ({}, {"metadata": {"annotations": {"kvtier.dev/cache": "c"}}}),
    ({"a": [1]}, {"a": [1]}),
    ({"a": None}, {"a": {"b": 1}}),
])
def test_diff_patch_applies_with_an_independent_implementation(src, dst):
    from kvtier_operator.webhook import diff_patch

    assert jsonpatch.apply_patch(copy.deepcopy(src), diff_patch(src, dst)) == dst


@pytest.mark.parametrize(("spec", "warning"), [
    ({"cpu": None, "storage": {"stagingSize": "2Gi"}},
     "kvtier: spec.storage.stagingSize is deprecated: rename it hostStagingSize"),
    ({"cpu": None, "storage": {"hostStagingSize": "2Gi"}}, None),
    ({"engine": "vllm-tpu", "storage": None, "tpu": {"pageSize": 128, "stagingSize": "512Mi"}},
     "kvtier: spec.tpu.stagingSize is deprecated: rename it hbmStagingSize"),
    ({"engine": "vllm-tpu", "storage": None, "tpu": {"pageSize": 128,
                                                       "hbmStagingSize": "512Mi"}}, None),
])
async def test_a_deprecated_field_name_is_accepted_with_a_warning(webhook, spec, warning):
    _, answer = await webhook.post(VALIDATE_PATH, review(tpc_doc(spec, name="d",
                                                                  namespace="llm-d")))
    r = answer["response"]
    assert r["allowed"] is True
    assert [w.split(" (")[0] for w in r.get("warnings", [])] == ([warning] if warning else [])
