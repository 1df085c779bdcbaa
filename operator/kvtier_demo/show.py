"""`make demo EXAMPLE=examples/<cr>.yaml` for any example: the real operator reconciles
it against an in-process API server, and each pod of the example's sample workload
(examples/, kvtier_demo.samples) is admitted through the real webhook over HTTPS.

The full data-path demo (blocks through the kvtier backend, the evictor) is `make demo`
with the default example; this shows every other engine and connector.
"""

from __future__ import annotations

import base64
import copy
import difflib
import json
import ssl
from pathlib import Path
from typing import Any

import yaml

from kvtier_demo.cluster import live_cluster, say, until
from kvtier_demo.samples import sample_workload
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.validation import parse_tpc
from kvtier_operator.yamlio import dump

STAND_IN_RESOURCES = {"ConfigMap": "v1/configmaps", "Service": "v1/services",
                      "DaemonSet": "apps/v1/daemonsets"}


def example_object(folder: Path, kind: str, name: str) -> dict[str, Any] | None:
    """The object of that kind and name among the examples (e.g. the Mooncake client
    config an example CR names), or None."""
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == kind and \
                    (doc.get("metadata") or {}).get("name") == name:
                return doc
    return None


def workload_pods(workload: dict[str, Any], namespace: str) -> list[dict[str, Any]]:
    """The pods the workload's controller would create (a LeaderWorkerSet: a leader and
    a worker, with the index label and the group size annotation LWS adds)."""
    templates: list[tuple[dict[str, Any], str | None]]
    size = "1"
    if workload["kind"] == "LeaderWorkerSet":
        group = workload["spec"]["leaderWorkerTemplate"]
        templates = [(group["leaderTemplate"], "0"), (group["workerTemplate"], "1")]
        size = str(group.get("size", 1))
    else:
        templates = [(workload["spec"]["template"], None)]
    pods = []
    for template, index in templates:
        meta = copy.deepcopy(template.get("metadata") or {})
        if index is not None:
            meta.setdefault("labels", {})["leaderworkerset.sigs.k8s.io/worker-index"] = index
            meta.setdefault("annotations", {})["leaderworkerset.sigs.k8s.io/size"] = size
        name = f"{workload['metadata']['name']}-0" + (f"-{index}" if index else "")
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {**meta, "name": name, "namespace": namespace},
                     "spec": copy.deepcopy(template["spec"])})
    return pods


async def show(example: Path, out: Path) -> int:
    import aiohttp
    import jsonpatch

    from kvtier_demo import sandbox
    from kvtier_operator.webhook import MUTATE_PATH

    doc = yaml.safe_load(example.read_text())
    tpc = parse_tpc(doc)
    ns, name = tpc.namespace, tpc.name
    adapter = adapter_for(tpc.spec)
    workload_file = example.parent / sample_workload(doc)
    workload = yaml.safe_load(workload_file.read_text())
    async with live_cluster(out) as cluster:
        kmock, config, ca, port = cluster.kmock, cluster.config, cluster.ca, cluster.port
        say(f"1. kubectl apply -f {example.name}")
        print(f"TieredPrefixCache {ns}/{name}: {adapter.title}")
        for need in adapter.prerequisites(tpc):
            # Stand-ins for what the user deploys (e.g. the mooncake master).
            print(f"(prerequisite {need.kind} {need.namespace}/{need.name}, named by "
                  f"{need.field}, created here as the user would)")
            stand_in = example_object(example.parent, need.kind, need.name) or {
                "apiVersion": "v1", "kind": need.kind,
                "metadata": {"name": need.name, "namespace": need.namespace}}
            if need.key and need.key not in (stand_in.get("data") or {}):
                stand_in["data"] = {need.key: "{}"}
            stand_in["metadata"]["namespace"] = need.namespace
            kmock.objects[STAND_IN_RESOURCES[need.kind], need.namespace, need.name] = stand_in
        doc["metadata"].update(uid="demo-uid-1", generation=1)
        kmock.objects[sandbox.TPC, ns, name] = doc

        def status() -> dict[str, Any] | None:
            body = sandbox.stored(kmock, sandbox.TPC, ns, name) or {}
            return body.get("status") or None

        await until(status, "the status")
        say("2. the operator created")
        for resource in ("v1/persistentvolumeclaims", "batch/v1/cronjobs",
                         "v1/configmaps"):
            for suffix in ("kv-cache", "evictor", "objects", "router"):
                obj = sandbox.stored(kmock, resource, ns, f"{name}-{suffix}")
                if obj is not None:
                    print(dump({obj["kind"]: {"name": obj["metadata"]["name"],
                                              **({"data": obj["data"]} if "data" in obj
                                                 else {"spec": obj["spec"]})}}))
        if adapter.evictor_layout(tpc.spec) is None:
            print("(no shared-volume evictor CronJob: no shared tier kvtier manages, or "
                  "the engine evicts on its own)")
        await until(lambda: config.caches.in_namespace(ns), "the webhook's cache view")
        client_tls = ssl.create_default_context(cafile=str(ca))
        for i, pod in enumerate(workload_pods(workload, ns)):
            say(f"3.{i + 1} pod {pod['metadata']['name']} of {workload_file.name} "
                f"admitted through the webhook (HTTPS :{port})")
            review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                      "request": {"uid": f"demo-{i}", "operation": "CREATE",
                                  "namespace": ns, "object": pod}}
            async with aiohttp.ClientSession() as session:
                async with session.post(f"https://127.0.0.1:{port}{MUTATE_PATH}",
                                        json=review, ssl=client_tls) as resp:
                    answer = (await resp.json())["response"]
            for warning in answer.get("warnings") or []:
                print(f"warning: {warning}")
            patch = json.loads(base64.b64decode(answer.get("patch") or b"W10="))
            injected = jsonpatch.apply_patch(pod, patch)
            print("\n".join(difflib.unified_diff(
                dump(pod).splitlines(), dump(injected).splitlines(), "as written",
                "as admitted", lineterm="", n=1)))
            injected["status"] = {"phase": "Running"}
            kmock.objects["v1/pods", ns, injected["metadata"]["name"]] = injected
        pods = len(workload_pods(workload, ns))
        body = await until(lambda: (s := status()) and s.get("injectedPods") == pods
                           and s, "the pods counted")
        say(f"4. kubectl get tpc {name} -o yaml (status)")
        print(dump({"status": body}))
    ready = next(c for c in body["conditions"] if c["type"] == "Ready")
    say("summary")
    print(f"Ready={ready['status']} ({ready['reason']}), {body['injectedPods']} pod(s) "
          f"injected, {body['pendingPods']} pending")
    return 0
