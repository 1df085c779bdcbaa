"""The engine pods' router identities the evictor publishes its removals under (#33,
router #2586): rendered into the cache's <name>-event-pods ConfigMap, updated by the
reconcile as pods come and go, mounted read-only into the evictor CronJob."""

from __future__ import annotations

from kvtier_operator import names
from kvtier_operator.render.event_pods import MAX_EVENT_PODS
from tests.operator.unit.test_reconcile import FakeGateway, body, decode_pod, pod_view, run

PUBLISHING = {"router": {"enabled": True, "scoring": "precise",
                         "evictionEventsEndpoint": "tcp://epp:5590"}}
KEY = ("ConfigMap", "ml", "cache-event-pods")


def running(name, ip, cache="cache"):
    pod = decode_pod(name, f"uid-{name}", "h")
    pod["metadata"]["annotations"]["kvtier.dev/cache"] = cache
    pod["status"]["podIP"] = ip
    return pod_view(pod)


def listed(gw):
    return gw.store[KEY]["data"][names.EVENT_PODS_KEY].splitlines()


def test_the_injected_pods_are_listed_and_follow_the_pods():
    gw = FakeGateway()
    doc = body(PUBLISHING)
    pods = [running("decode-0", "10.0.0.2"), running("decode-1", "10.0.0.1"),
            running("other", "10.0.0.9", cache="another"), running("starting", None)]
    outcome = run(gw, doc, pods)
    assert outcome.ok
    assert listed(gw) == ["10.0.0.1:8000", "10.0.0.2:8000"]  # vLLM's serving port
    owner = gw.store[KEY]["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "u-1" and owner["controller"]
    run(gw, doc, [running("decode-1", "10.0.0.1"), running("decode-2", "10.0.0.3")])
    assert listed(gw) == ["10.0.0.1:8000", "10.0.0.3:8000"]
    writes = len([c for c in gw.calls if c[0] in ("create", "patch") and c[2] == KEY[2]])
    run(gw, doc, [running("decode-1", "10.0.0.1"), running("decode-2", "10.0.0.3")])
    assert len([c for c in gw.calls if c[0] in ("create", "patch") and c[2] == KEY[2]]) \
        == writes  # unchanged pods: no write


def test_a_pod_is_named_by_its_target_ports_never_the_kv_events_port():
    """llm-d-router ebab687 names a pod <pod IP>:<InferencePool target port>, one per
    port (pkg/epp/datastore/datastore.go:332-346, preciseprefixcache/extractor.go:80,
    producer.go:379): removals under the KV-events port would match nothing it indexed."""
    gw = FakeGateway()
    router = {**PUBLISHING["router"], "kvEventsPort": 5600, "targetPorts": [8200, 8201]}
    run(gw, body({"router": router}),
        [running("decode-0", "10.0.0.2"), running("decode-1", "fd00::7")])
    assert listed(gw) == ["10.0.0.2:8200", "10.0.0.2:8201", "fd00::7:8200", "fd00::7:8201"]
    assert not any(line.endswith(":5600") for line in listed(gw))


def test_the_list_is_bounded():
    gw = FakeGateway()
    pods = [running(f"d-{i}", f"10.1.{i // 200}.{i % 200}") for i in range(MAX_EVENT_PODS + 50)]
    run(gw, body(PUBLISHING), pods)
    assert len(listed(gw)) == MAX_EVENT_PODS


def test_the_bound_keeps_whole_pods_with_every_port():
    """With several target ports the bound counts names, but a pod keeps all its ports'
    names or none: a pod listed under some ports only would keep stale entries under the
    others (7 ports: 36 whole pods, 252 names, not 256 names cut inside a pod)."""
    gw = FakeGateway()
    ports = [8000 + i for i in range(7)]
    router = {**PUBLISHING["router"], "targetPorts": ports}
    pods = [running(f"d-{i}", f"10.2.0.{i}") for i in range(40)]
    run(gw, body({"router": router}), pods)
    by_pod: dict[str, set[str]] = {}
    for line in listed(gw):
        ip, _, port = line.rpartition(":")
        by_pod.setdefault(ip, set()).add(port)
    assert len(by_pod) == MAX_EVENT_PODS // 7
    assert all(len(p) == 7 for p in by_pod.values()), by_pod


def test_the_evictor_reads_it_read_only_at_a_fixed_path():
    gw = FakeGateway()
    run(gw, body(PUBLISHING), [running("decode-0", "10.0.0.2")])
    pod = gw.store["CronJob", "ml", "cache-evictor"]["spec"]["jobTemplate"]["spec"][
        "template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[args.index("--events-pods-file") + 1] == \
        f"{names.EVENT_PODS_MOUNT}/{names.EVENT_PODS_KEY}"
    assert {"name": names.VOLUME_EVENT_PODS, "mountPath": names.EVENT_PODS_MOUNT,
            "readOnly": True} in container["volumeMounts"]
    assert {"name": names.VOLUME_EVENT_PODS,
            "configMap": {"name": "cache-event-pods", "optional": True}} in pod["volumes"]


def test_no_publishing_no_configmap():
    gw = FakeGateway()
    doc = body(PUBLISHING)
    run(gw, doc, [running("decode-0", "10.0.0.2")])
    assert KEY in gw.store
    doc["spec"]["router"].pop("evictionEventsEndpoint")
    run(gw, doc, [running("decode-0", "10.0.0.2")])
    assert KEY not in gw.store
    cron = gw.store["CronJob", "ml", "cache-evictor"]["spec"]["jobTemplate"]["spec"][
        "template"]["spec"]
    assert [v["name"] for v in cron["volumes"]] == [names.VOLUME_CACHE]
