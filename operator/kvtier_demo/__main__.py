"""`make demo`: kvtier's whole job, live, on one machine, with no cluster, GPU or root.

An in-process Kubernetes API server, the real operator and the real webhook server
(HTTPS). It applies an example TieredPrefixCache, admits the sample vLLM Deployment's pod
through the webhook, moves real KV blocks through the kvtier block store into a local
directory, runs the evictor on it, and feeds the evictor's report back into the status.
No engine runs here: the pod's metrics endpoint serves the engine's pages captured from a
real vLLM server, with the live kvtier_offload_* families of the block store the demo moves
its blocks through (kvtier_demo.replay, kvtier_demo.blocks), read by the operator's real
observation path. So the status ends with a real Hit (the captured engine's), the storage
tier's bytes, latency and failed loads of the blocks this run moved, and the advice.
"""

from __future__ import annotations

import asyncio
import base64
import difflib
import json
import os
import ssl
import sys
import tempfile
import time
from contextlib import AsyncExitStack, closing
from pathlib import Path
from typing import Any

import yaml

from kvtier_demo.blocks import BLOCK_BYTES, BLOCKS, FLIPPED, DemoBlocks
from kvtier_demo.cluster import live_cluster, say, until
from kvtier_demo.replay import ReplayedMetrics
from kvtier_demo.table import table
from kvtier_evictor.evict import Config as EvictorConfig
from kvtier_evictor.evict import Run as EvictorRun
from kvtier_evictor.layouts import KVTIER
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.engines.vllm.launch import kv_transfer_json
from kvtier_operator.render.connector import kv_transfer_config
from kvtier_operator.validation import parse_tpc
from kvtier_operator.yamlio import dump

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EXAMPLE, SAMPLE = "native-kvtier.yaml", "vllm-deployment.yaml"
NS = "llm-d"
_NONE = type("NoObservation", (), {"pods_read": 0})()


def _pod_from(deployment: dict[str, Any]) -> dict[str, Any]:
    template = deployment["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**template["metadata"], "name": "gpu-vllm-decode-7c9f-x2k4p",
                         "namespace": NS},
            "spec": template["spec"]}


async def live(out: Path) -> int:
    from kvtier_demo import sandbox
    from kvtier_operator.webhook import MUTATE_PATH

    doc = yaml.safe_load((EXAMPLES / EXAMPLE).read_text())
    tpc = parse_tpc(doc)
    claim = tpc.spec.storage.pvc if tpc.spec.storage is not None else None
    if claim is None:
        raise RuntimeError(f"demo: examples/{EXAMPLE} needs spec.storage.pvc (the demo shows "
                           "a shared tier on a claim kvtier creates)")
    name = tpc.name
    deployment = yaml.safe_load((EXAMPLES / SAMPLE).read_text())
    async with live_cluster(out) as cluster, ReplayedMetrics() as replay, \
            AsyncExitStack() as stack:
        kmock, ctx, config, ca, port = (cluster.kmock, cluster.ctx, cluster.config,
                                        cluster.ca, cluster.port)
        say(f"1. kubectl apply -f examples/{EXAMPLE}")
        cpu = tpc.spec.cpu.size if tpc.spec.cpu else "none"
        print(f"TieredPrefixCache {NS}/{name}: connector {tpc.spec.connector}, CPU tier "
              f"{cpu}, shared tier {adapter_for(tpc.spec).storage_backend(tpc.spec)} on a "
              f"{claim.size} ReadWriteMany claim")
        doc["metadata"]["uid"] = "demo-uid-1"
        doc["metadata"]["generation"] = 1
        # What an API server stamps on create (kmock does not): kubectl's AGE column.
        doc["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                             time.gmtime())
        kmock.objects[sandbox.TPC, NS, name] = doc

        def get(resource: str, obj: str) -> dict[str, Any] | None:
            return sandbox.stored(kmock, resource, NS, obj)

        claim = await until(lambda: get("v1/persistentvolumeclaims", f"{name}-kv-cache"),
                             "the claim")
        cron = await until(lambda: get("batch/v1/cronjobs", f"{name}-evictor"), "CronJob")
        router = await until(lambda: get("v1/configmaps", f"{name}-router"), "router")
        say("2. the operator created")
        print(dump({"PersistentVolumeClaim": {"name": claim["metadata"]["name"],
                                              "spec": claim["spec"]}}))
        container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"][
            "containers"][0]
        print(dump({"CronJob": {"name": cron["metadata"]["name"],
                                "schedule": cron["spec"]["schedule"],
                                "concurrencyPolicy": cron["spec"]["concurrencyPolicy"],
                                "command": container["command"] + container["args"]}}))
        lru = adapter_for(tpc.spec).router_cpu_blocks(tpc.spec) or 0
        print("ConfigMap " + router["metadata"]["name"] + " (llm-d router, CPU tier "
              f"lruCapacityPerServer {lru:,} computed "
              "from 256 KiB/token x 16 tokens):")
        print(router["data"]["tiered-prefix-cache-plugins.yaml"])
        # The sandbox has no storage provisioner: bind the claim as one would.
        await kmock.patch(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/"
                          f"{name}-kv-cache", json={"status": {
                              "phase": "Bound", "capacity": {"storage": "9000Gi"}}},
                          headers={"Content-Type": "application/merge-patch+json"})

        say("3. a vLLM pod of examples/vllm-deployment.yaml is admitted through the "
            f"webhook (HTTPS :{port})")
        pod = _pod_from(deployment)
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "request": {"uid": "demo-1", "operation": "CREATE", "namespace": NS,
                              "object": pod}}
        await until(lambda: config.caches.in_namespace(NS), "the webhook's cache view")
        import aiohttp
        import jsonpatch

        client_tls = ssl.create_default_context(cafile=str(ca))
        async with aiohttp.ClientSession() as session:
            async with session.post(f"https://127.0.0.1:{port}{MUTATE_PATH}", json=review,
                                    ssl=client_tls) as resp:
                answer = await resp.json()
        patch = json.loads(base64.b64decode(answer["response"]["patch"]))
        injected = jsonpatch.apply_patch(pod, patch)
        print(f"{len(patch)} JSONPatch operations; the pod as written vs as admitted:")
        print("\n".join(difflib.unified_diff(
            dump(pod).splitlines(), dump(injected).splitlines(), "as written",
            "as admitted", lineterm="", n=1)))
        # The pod runs. No engine runs here: its /metrics serves a real vLLM server's
        # captured engine page with the live figures of the demo's own kvtier backend
        # (kvtier_demo.replay), which the operator reads as it reads any pod's. The
        # backend opens with the pod, before the operator's first read: that read is the
        # baseline, so the window holds exactly what the demo moves.
        volume = out / "volume"
        blocks = stack.enter_context(closing(DemoBlocks(
            volume, {"model": tpc.spec.model.name, "demo": True})))
        injected["metadata"].setdefault("annotations", {})[
            "kvtier.dev/metrics-port"] = str(replay.port)
        injected["status"] = {"phase": "Running", "podIP": "127.0.0.1"}
        kmock.objects["v1/pods", NS, injected["metadata"]["name"]] = injected
        observer = config.the_observer()
        await until(lambda: (observer.snapshot(NS, name) or _NONE).pods_read,
                    "the operator's first read of the pod's metrics")
        print(f"the operator reads the pod's metrics at 127.0.0.1:{replay.port}/metrics "
              "every 0.5 s (30 s in a cluster)")
        print(f"the engine's figures there are a capture from a real vLLM 0.32 API server, "
              f"{replay.file('idle').relative_to(ROOT)} (no request yet), then "
              f"{replay.file('loaded').relative_to(ROOT).name} (one prompt served from "
              "kvtier's storage tier behind vLLM's CPU tier); its kvtier_offload_* "
              "families are live, those of this process's block store on the volume "
              "(the capture's own are left out)")
        replay.show("loaded")  # the next round's read has a difference to the first

        say("4. KV blocks move through the kvtier backend into the shared volume")
        moved = blocks.move()
        print(f"stored {BLOCKS} blocks of {BLOCK_BYTES >> 20} MiB at "
              f"{moved.store_gbps:.2f} GB/s and loaded them back at "
              f"{moved.load_gbps:.2f} GB/s into {volume} on {moved.path}; "
              f"bit-identical: {moved.identical} ({moved.bytes_stored:,} bytes stored, "
              f"{moved.bytes_loaded:,} loaded)")
        print(f"then {FLIPPED} bytes of one block's payload flipped on the volume "
              f"({moved.damaged.relative_to(volume)}): its next load "
              + (f"was refused ({moved.refused_why}) and the file removed: a failed "
                 "load, its tokens recomputed" if moved.refused
                 else "was NOT refused (the store served a damaged block)"))
        if not moved.refused:
            raise SystemExit("demo: the block store served a block whose payload was damaged")
        options = kv_transfer_json(kv_transfer_config(tpc))
        print(f"(vLLM gets this tier from --kv-transfer-config {options})")

        say("5. the evictor CronJob's run, against that volume")
        capacity = moved.kept * (BLOCK_BYTES + 4096) * 100 // 90  # about 90% full
        report = EvictorRun(EvictorConfig(
            root=str(volume), layout=KVTIER, high_watermark=85, low_watermark=60,
            min_idle_seconds=600, capacity_bytes=capacity, threads=1)).execute()
        print(f"usage {report.usage_before.percent:.1f}% -> "
              f"{report.usage_after.percent:.1f}% (budget {capacity:,} bytes): "
              f"{report.outcome}, {report.files_deleted} least-recently-used files "
              f"deleted, {report.bytes_freed:,} bytes freed")
        kmock.objects["v1/pods", NS, f"{name}-evictor-1-demo"] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-evictor-1-demo", "namespace": NS, "labels": {
                "kvtier.dev/cache": name, "kvtier.dev/component": "evictor",
                "job-name": f"{name}-evictor-1"}},
            "spec": {"containers": [{"name": "evictor", "image": ctx.evictor_image}]},
            "status": {"phase": "Succeeded", "containerStatuses": [{
                "name": "evictor", "state": {"terminated": {
                    "exitCode": 0, "finishedAt": report.finished_at,
                    "message": report.to_json(limit=4096)}}}]}}

        say(f"6. kubectl get tpc {name} -o yaml (status)")

        def evicted() -> dict[str, Any] | None:
            b = get(sandbox.TPC, name)
            if b is None:
                raise RuntimeError(f"demo: TieredPrefixCache {NS}/{name} is gone")
            status = b.get("status") or {}
            if not (status.get("lastEviction") and status.get("injectedPods") == 1
                    and status["conditions"][0]["status"] == "True"):
                return None
            storage: dict[str, Any] = next(
                (t for t in status.get("tiers") or [] if t["name"] == "storage"), {})
            if not storage.get("bytesLoaded") or not storage.get("failedLoads") or \
                    status.get("hitPercent") is None:
                return None  # the page's difference (the capture's and the moves'), observed
            return b

        body = await until(evicted, "status with the eviction report")
        print(dump({"status": body["status"]}))
    st = body["status"]
    say("summary")
    print(f"Ready={st['conditions'][0]['status']}, claim {st['pvc']['name']} "
          f"{st['pvc']['phase']}, {st['injectedPods']} pod injected, "
          f"{st['pendingPods']} pending, last eviction {st['lastEviction']['outcome']} "
          f"({st['lastEviction']['filesDeleted']} files), usage {st['usage']['percent']}%")
    captured = replay.file("loaded").relative_to(ROOT)
    print(f"Hit {st['hitPercent']}% of {st['recompute']['promptTokens']} prompt tokens, "
          f"recomputed {st['recompute']['percent']}%, and each tier's hit share: from the "
          f"captured engine page ({captured} against its idle page; the demo runs no engine)")
    print("the storage tier's bytes, load latency and failed loads: from the blocks this "
          "run moved (step 4, counted by its block store's kvtier_offload_* families); "
          "its capacity and use: from the evictor's report (step 5)")
    for tier in st["tiers"]:
        latency = tier.get("loadLatency") or {}
        figures = [f"hit {tier['hitPercent']}% ({tier['hitSource']})"
                   if tier.get("hitPercent") is not None else "no hit figure"]
        figures += [f"{tier[key]:,} {what}" for key, what in (
            ("bytesLoaded", "bytes loaded"), ("bytesStored", "bytes stored"),
            ("failedLoads", "failed loads"), ("droppedWrites", "dropped writes"))
            if tier.get(key) is not None]
        figures += [f"load {q} {latency[key]} s" for q, key in (
            ("p50", "p50Seconds"), ("p99", "p99Seconds")) if latency.get(key) is not None]
        print(f"  {tier['name']}: " + ", ".join(figures))
    for condition in st["conditions"]:
        if condition["type"] in ("MetricsReadable", "TiersEffective"):
            print(f"{condition['type']}={condition['status']} ({condition['reason']}): "
                  f"{condition['message']}")
    say(f"kubectl get tpc {name}")
    print(table(body))
    say(f"kubectl get tpc {name} -o wide")
    print(table(body, wide=True))
    return 0


def main() -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    for noisy in ("kopf", "aiohttp", "kvtier_operator", "kvtier_offload", "kvtier_evictor"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    out = Path(os.environ.get("KVTIER_DEMO_DIR") or tempfile.mkdtemp(prefix="kvtier-demo-"))
    chosen = sys.argv[1] if len(sys.argv) > 1 else ""
    if chosen and Path(chosen).resolve() != (EXAMPLES / EXAMPLE).resolve():
        # Any other example: the operator and the webhook for its engine and workload.
        from kvtier_demo.show import show

        return asyncio.run(show(Path(chosen), out))
    return asyncio.run(live(out))


if __name__ == "__main__":
    sys.exit(main())
