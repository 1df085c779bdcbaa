"""spec.localDisk, spec.objectStore and spec.peerSharing (#38): what the operator renders
for the tiers chained behind the CPU tier, and what it refuses."""

from __future__ import annotations

import json

import pytest
import yaml

from kvtier_operator import names
from kvtier_operator.api.quantity import quantity_bytes
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.render.connector import kv_transfer_config
from kvtier_operator.render.object_evictor import render_object_evictor
from kvtier_operator.render.objects import render_objects
from kvtier_operator.render.pod import inject
from kvtier_operator.validation import InvalidResource, parse_tpc
from tests.helpers import tpc_doc, vllm_pod

CTX = RenderContext(allowed_object_endpoints=("https://rgw.storage.svc:443",))
LOCAL = {"capacity": "500Gi", "volume": {"emptyDir": {}}}
OBJECTS = {"bucket": "kv-cache", "endpoint": "https://rgw.storage.svc:443",
           "addressingStyle": "path", "budget": "10Ti",
           "credentialsSecret": {"name": "kv-s3", "sessionTokenKey": "token"}}


def cache(**spec):
    return parse_tpc(tpc_doc(spec))


def tiers_of(tpc) -> list[dict]:
    return kv_transfer_config(tpc)["kv_connector_extra_config"]["secondary_tiers"]


def server(pod: dict) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")


def test_tiers_chain_local_shared_object_fastest_first():
    tpc = cache(localDisk=LOCAL, objectStore=OBJECTS)
    local, shared, objects = tiers_of(tpc)
    assert (local["type"], local["module_path"]) == ("KvtierLocalTier",
                                                     "kvtier_offload.vllm_local_tier")
    assert local["root_dir"] == "/mnt/kv-local"
    assert local["capacity_bytes"] == quantity_bytes("500Gi")
    assert shared["type"] == "KvtierStorageTier" and shared["root_dir"] == "/mnt/files-storage"
    assert objects == {"type": "KvtierObjectTier",
                       "module_path": "kvtier_offload.vllm_object_tier",
                       "bucket": "kv-cache", "prefix": "kvtier/v1",
                       "endpoint_url": "https://rgw.storage.svc:443",
                       "addressing_style": "path", "max_concurrency": 16}
    extra = kv_transfer_config(tpc)["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["block_size"] == 256


def test_an_object_store_alone_is_a_tiering_spec_of_one_tier():
    tpc = cache(storage=None, objectStore=OBJECTS)
    (only,) = tiers_of(tpc)
    assert only["type"] == "KvtierObjectTier"
    assert names.claim_name(tpc) is None
    assert adapter_for(tpc.spec).offloaded_tiers(tpc.spec) == ("cpu", "objectStore")


def test_precise_scoring_makes_every_chained_tier_announce_its_blocks():
    tpc = cache(localDisk=LOCAL, objectStore=OBJECTS,
                router={"enabled": True, "scoring": "precise"})
    assert [t.get("enable_kv_events") for t in tiers_of(tpc)] == [True, True, True]


def test_no_credential_ever_reaches_the_command_line_or_the_objects():
    tpc = cache(objectStore=OBJECTS)
    pod = inject(tpc, vllm_pod(), CTX).pod
    container = server(pod)
    env = {e["name"]: e for e in container["env"]}
    for name, key in (("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
                      ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
                      ("AWS_SESSION_TOKEN", "token")):
        assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {
            "name": "kv-s3", "key": key}}}
    text = json.dumps(kv_transfer_config(tpc)).lower()
    assert "secret" not in text and "key_id" not in text and "token" not in text
    cron = render_object_evictor(tpc, CTX)
    assert cron is not None
    job = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert all("valueFrom" in e and "value" not in e for e in job["env"])
    assert not any("secret" in a.lower() for a in job["args"])


def test_a_pod_that_sets_a_credential_itself_is_left_alone_and_told_why():
    pod = vllm_pod(env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "inline"}])
    result = inject(cache(objectStore=OBJECTS), pod, CTX)
    assert not result.changed
    assert any("AWS_SECRET_ACCESS_KEY" in c and "kv-s3" in c for c in result.conflicts)
    assert not any("inline" in c for c in result.conflicts)


def test_the_eviction_cronjob_holds_the_prefix_to_the_budget():
    tpc = cache(objectStore={**OBJECTS, "region": "eu-west-1", "minAge": "15m",
                             "evictionSchedule": "*/3 * * * *"})
    cron = render_object_evictor(tpc, CTX)
    assert cron is not None and cron["metadata"]["name"] == "cache-objects"
    assert cron["spec"]["schedule"] == "*/3 * * * *"
    job = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = job["containers"]
    assert container["image"] == CTX.offload_image
    assert container["args"] == [
        "evict-objects", "--bucket", "kv-cache", "--prefix", "kvtier/v1",
        "--budget-bytes", str(quantity_bytes("10Ti")), "--min-age-seconds", "900",
        "--addressing-style", "path", "--endpoint-url", "https://rgw.storage.svc:443",
        "--region", "eu-west-1"]
    assert job["automountServiceAccountToken"] is False
    assert cron in render_objects(tpc, CTX)
    assert render_object_evictor(cache(), CTX) is None


def test_the_eviction_cronjobs_arguments_parse_under_the_backends_own_cli():
    from kvtier_offload.cli import main

    args = render_object_evictor(cache(objectStore=OBJECTS), CTX)["spec"]["jobTemplate"][
        "spec"]["template"]["spec"]["containers"][0]["args"]
    with pytest.raises(SystemExit) as shown:
        main([*args, "--help"])
    assert shown.value.code == 0


def test_an_empty_dir_disk_is_bounded_and_requested_as_ephemeral_storage():
    pod = inject(cache(localDisk=LOCAL), vllm_pod(resources={
        "requests": {"ephemeral-storage": "10Gi"}, "limits": {"ephemeral-storage": "20Gi"}}),
        CTX).pod
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == names.VOLUME_LOCAL_DISK)
    size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
    assert size == quantity_bytes("550Gi")  # capacity plus a tenth
    resources = server(pod)["resources"]
    assert quantity_bytes(resources["requests"]["ephemeral-storage"]) == \
        quantity_bytes("10Gi") + size
    assert quantity_bytes(resources["limits"]["ephemeral-storage"]) == \
        quantity_bytes("20Gi") + size
    mount = next(m for m in server(pod)["volumeMounts"]
                 if m["name"] == names.VOLUME_LOCAL_DISK)
    assert mount == {"name": names.VOLUME_LOCAL_DISK, "mountPath": "/mnt/kv-local"}


def test_a_claim_from_a_storage_class_is_an_ephemeral_volume_per_pod():
    tpc = cache(localDisk={"capacity": "100Gi", "mountPath": "/mnt/nvme",
                           "volume": {"ephemeral": {"storageClassName": "topolvm"}}})
    pod = inject(tpc, vllm_pod(), CTX).pod
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == names.VOLUME_LOCAL_DISK)
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "topolvm"
    assert claim["accessModes"] == ["ReadWriteOnce"]
    assert quantity_bytes(claim["resources"]["requests"]["storage"]) == quantity_bytes("110Gi")
    # A claim is not the node's ephemeral storage: no request for it.
    assert "ephemeral-storage" not in server(pod)["resources"].get("requests", {})


HOST = {"capacity": "1Ti", "volume": {"hostPath": {"path": "/mnt/nvme/kvtier"}}}


def test_a_host_directory_only_what_the_admin_allows():
    tpc = cache(localDisk=HOST)
    refused = inject(tpc, vllm_pod(), CTX)
    assert not refused.changed
    assert any("localDisk.allowedHostPaths: none" in c for c in refused.conflicts)
    # Exactly an allowed directory, never one below it: a path under an allowed
    # directory could name another cache's directory (<allowed>/<ns>/<name>), whose pods
    # can plant a symlink there, or another namespace's (review finding).
    for allowed_dirs in (("/mnt/nv",), ("/mnt/nvme",), ("/mnt",)):
        elsewhere = inject(tpc, vllm_pod(), RenderContext(allowed_host_paths=allowed_dirs))
        assert not elsewhere.changed, allowed_dirs
        assert any(f"allowedHostPaths: {allowed_dirs[0]};" in c
                   for c in elsewhere.conflicts), elsewhere.conflicts
    allowed = inject(tpc, vllm_pod(), RenderContext(allowed_host_paths=("/mnt/nvme/kvtier",)))
    assert allowed.changed, allowed.conflicts
    volume = next(v for v in allowed.pod["spec"]["volumes"]
                  if v["name"] == names.VOLUME_LOCAL_DISK)
    # A directory per cache: two caches on one node never count or evict each other's.
    assert volume["hostPath"] == {"path": "/mnt/nvme/kvtier/ml/cache",
                                  "type": "DirectoryOrCreate"}


def test_the_validating_webhook_refuses_a_host_directory_not_allowed():
    from kvtier_operator.admission import validate_request

    class NoCaches:
        def in_namespace(self, namespace):
            return []

    body = tpc_doc({"localDisk": HOST})
    request = {"uid": "u", "operation": "CREATE", "object": body}
    answer = validate_request(request, NoCaches())["response"]
    assert answer["allowed"] is False
    assert "allowedHostPaths" in answer["status"]["message"]
    assert not validate_request(request, NoCaches(), ("/mnt/nvme",))["response"]["allowed"]
    assert validate_request(request, NoCaches(), ("/mnt/nvme/kvtier",))["response"]["allowed"]


def test_the_operator_refuses_to_start_on_a_bad_allowed_path():
    from kvtier_operator.app import config_from_env

    ctx = config_from_env({"KVTIER_ALLOWED_HOST_PATHS": "/mnt/nvme, /data/ssd"}).render
    assert ctx.allowed_host_paths == ("/mnt/nvme", "/data/ssd")
    with pytest.raises(ValueError, match=r"KVTIER_ALLOWED_HOST_PATHS.*absolute"):
        config_from_env({"KVTIER_ALLOWED_HOST_PATHS": "mnt/nvme"})
    # Nested directories would let a cache's path be inside another's directory.
    with pytest.raises(ValueError, match=r"/mnt/nvme/ml and /mnt/nvme nest"):
        config_from_env({"KVTIER_ALLOWED_HOST_PATHS": "/mnt/nvme,/mnt/nvme/ml"})
    assert config_from_env({"KVTIER_ALLOWED_HOST_PATHS": "/mnt/nvme,/mnt/nvme2"})


def test_kvtier_render_reads_the_allowed_list_as_the_operator_does(tmp_path):
    """`kvtier render --allow-host-path` refuses what the operator would refuse to start
    on (a trailing '/', nested directories), instead of matching nothing."""
    from kvtier_operator.cli import main

    path = tmp_path / "tpc.yaml"
    path.write_text(yaml.safe_dump(tpc_doc({"localDisk": HOST})))
    assert main(["render", "-f", str(path), "--allow-host-path", "/mnt/nvme/kvtier/"]) != 0
    assert main(["render", "-f", str(path), "--allow-host-path", "/mnt/nvme/kvtier",
                 "--allow-host-path", "/mnt/nvme"]) != 0
    assert main(["render", "-f", str(path), "--allow-host-path", "/mnt/nvme/kvtier"]) == 0


@pytest.mark.parametrize(("spec", "message"), [
    ({"cpu": None, "localDisk": LOCAL}, "chain behind the CPU tier"),
    ({"cpu": None, "objectStore": OBJECTS}, "chain behind the CPU tier"),
    ({"connector": "lmcache", "storage": None, "localDisk": LOCAL},
     "spec.localDisk: engine vllm and connector lmcache cannot chain"),
    ({"connector": "kvbm", "storage": None, "objectStore": OBJECTS},
     "spec.objectStore: engine vllm and connector kvbm cannot chain"),
    ({"localDisk": {"capacity": "1Ti", "volume": {"emptyDir": {}, "hostPath": {
        "path": "/mnt/nvme"}}}}, "exactly one of ephemeral"),
    ({"localDisk": {"capacity": "1Ti", "volume": {}}}, "exactly one of ephemeral"),
    ({"localDisk": {"capacity": "1Mi", "volume": {"emptyDir": {}}}}, "too small"),
    ({"localDisk": {"capacity": "1Ti", "volume": {"hostPath": {"path": "/mnt/../etc"}}}},
     "normalised host directory"),
    ({"objectStore": {**OBJECTS, "bucket": "Bad_Bucket"}}, "S3 bucket name"),
    ({"objectStore": {**OBJECTS, "endpoint": "https://rgw/$(whoami)"}}, "http(s)://"),
    ({"objectStore": {**OBJECTS, "prefix": "/kvtier//x"}}, "object key prefix"),
    ({"objectStore": {k: v for k, v in OBJECTS.items() if k != "budget"}},
     "objectStore.budget: required"),
    ({"objectStore": {**OBJECTS, "accessKeyId": "AKIA"}}, "objectStore.accessKeyId: unknown"),
    ({"peerSharing": {"mechanism": "lmcache-p2p"}}, "spec.peerSharing is not available"),
    ({"peerSharing": {}}, "vLLM's p2p tier needs NIXL"),
])
def test_refusals_name_the_field_and_the_fix(spec, message):
    with pytest.raises(InvalidResource) as refused:
        cache(**spec)
    assert message in "; ".join(refused.value.messages)


def test_router_weights_name_the_new_tiers_and_share_their_medium():
    tpc = cache(localDisk=LOCAL, objectStore=OBJECTS,
                router={"enabled": True, "scoring": "precise",
                        "tierWeights": {"localDisk": 0.7, "objectStore": 0.1}})
    adapter = adapter_for(tpc.spec)
    assert adapter.offloaded_tiers(tpc.spec) == ("cpu", "localDisk", "storage", "objectStore")
    tiers = adapter.router_tiers(tpc.spec)
    # vLLM announces all three as STORAGE: one router entry, the fastest tier's weight.
    assert [(t.tier, t.router_name, t.weight) for t in tiers] == [
        ("gpu", "gpu", 1.0), ("cpu", "cpu", 0.8), ("localDisk", "storage", 0.7)]
    only_objects = cache(storage=None, objectStore=OBJECTS)
    assert [(t.tier, t.weight) for t in adapter.router_tiers(only_objects.spec)][-1] == \
        ("objectStore", 0.2)


def test_changing_a_secret_reference_restarts_pods_a_new_value_does_not():
    one = inject(cache(objectStore=OBJECTS), vllm_pod(), CTX).config_hash
    again = inject(cache(objectStore=OBJECTS), vllm_pod(), CTX).config_hash
    other = inject(cache(objectStore={**OBJECTS, "credentialsSecret": {"name": "kv-s3-2"}}),
                   vllm_pod(), CTX).config_hash
    assert one == again != other


PAGE_THREE_TIERS = """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 100
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 300
# TYPE kvtier_offload_bytes counter
kvtier_offload_bytes_total{tier="localDisk",direction="load"} 4000
kvtier_offload_bytes_total{tier="storage",direction="load"} 200
kvtier_offload_bytes_total{tier="objectStore",direction="load"} 10
kvtier_offload_bytes_total{tier="objectStore",direction="store"} 77
# TYPE kvtier_offload_operations counter
kvtier_offload_operations_total{tier="localDisk",direction="load",outcome="ok"} 40
kvtier_offload_operations_total{tier="storage",direction="load",outcome="ok"} 2
kvtier_offload_operations_total{tier="objectStore",direction="load",outcome="ok"} 1
kvtier_offload_operations_total{tier="objectStore",direction="load",outcome="corrupt"} 3
"""


def test_each_kvtier_tier_reads_its_own_series_never_their_sum():
    from kvtier_operator.engines.vllm.metrics import read
    from kvtier_operator.observe.page import parse

    samples = parse(PAGE_THREE_TIERS, 20000).samples
    f = read(samples, ("cpu", "localDisk", "storage", "objectStore"))
    assert f.counters[("bytes_loaded", "localDisk")] == 4000
    assert f.counters[("bytes_loaded", "storage")] == 200
    assert f.counters[("bytes_loaded", "objectStore")] == 10
    assert f.counters[("bytes_stored", "objectStore")] == 77
    assert f.counters[("failed_loads", "objectStore")] == 3
    assert f.counters[("failed_loads", "localDisk")] == 0
    assert f.counters[("loads", "storage")] == 2
    # vLLM says "disk" for a hit on any of them: it is not pinned on one by the reader;
    # kept whole for the tiers it covers (status splits it by their bytes loaded).
    assert ("hit_tokens", "storage") not in f.counters
    assert ("hit_tokens", "offloaded") not in f.counters
    assert f.counters[("shared_hit_tokens", "localDisk,storage,objectStore")] == 300
    # One tier of files alone: vLLM's disk hits are that tier's.
    only = read(samples, ("cpu", "objectStore"))
    assert only.counters[("hit_tokens", "objectStore")] == 300


def test_a_bounded_tier_says_how_full_it_is():
    """The local disk's capacity and use (kvtier_offload_capacity_bytes / _used_bytes,
    as tests/offload/test_vllm_local_tier.py sees the tier export them) become its
    capacity and used percent in status; the shared tier, unbounded, gets neither."""
    from kvtier_operator.engines.vllm.metrics import read
    from kvtier_operator.observe.page import parse

    page = PAGE_THREE_TIERS + (
        "# TYPE kvtier_offload_capacity_bytes gauge\n"
        'kvtier_offload_capacity_bytes{tier="localDisk"} 8000\n'
        "# TYPE kvtier_offload_used_bytes gauge\n"
        'kvtier_offload_used_bytes{tier="localDisk"} 2000\n')
    f = read(parse(page, 20000).samples, ("cpu", "localDisk", "storage"))
    assert f.gauges[("capacity_bytes", "localDisk")] == 8000
    assert f.gauges[("used_percent", "localDisk")] == 25.0
    assert ("capacity_bytes", "storage") not in f.gauges
    assert ("used_percent", "storage") not in f.gauges


def test_a_backend_without_the_tier_label_counts_as_the_shared_tier():
    from kvtier_operator.engines.vllm.metrics import read
    from kvtier_operator.observe.page import parse

    old = PAGE_THREE_TIERS.replace('tier="localDisk",', "").replace('tier="storage",', "")
    old = "\n".join(line for line in old.splitlines() if "objectStore" not in line)
    f = read(parse(old, 20000).samples, ("cpu", "storage"))
    assert f.counters[("bytes_loaded", "storage")] == 4200


def test_reconcile_applies_the_object_cronjob_and_removes_it_with_the_field():
    from tests.operator.unit.test_reconcile import FakeGateway, body, run

    aws = {k: v for k, v in OBJECTS.items() if k != "endpoint"}  # AWS: no list to pass
    gw = FakeGateway()
    run(gw, body({"objectStore": aws}))
    cron = gw.store[("CronJob", "ml", "cache-objects")]
    assert cron["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert ("CronJob", "ml", "cache-evictor") in gw.store  # the shared volume's, beside it
    outcome = run(gw, body({"objectStore": None}))
    assert ("CronJob", "ml", "cache-objects") not in gw.store
    assert ("CronJob", "ml", "cache-evictor") in gw.store
    assert ("Normal", "Deleted", "deleted CronJob cache-objects") in outcome.events
    # Nothing of the Secret is in the status kvtier writes: it never reads the Secret.
    status = run(gw, body({"objectStore": aws})).status.model_dump_json(by_alias=True)
    assert "kv-s3" not in status and "AWS_" not in status


def test_an_object_endpoint_the_admin_does_not_allow_gets_no_secret():
    """The endpoint receives the access key id and session token of the Secret the cache
    names: one the admin has not listed (objectStore.allowedEndpoints) gets no pod
    injected, no eviction CronJob, and a refusal from the webhook and `kvtier render`
    (review finding: a cache author could send two values of any Secret to their own
    server)."""
    from kvtier_operator.admission import validate_request
    from kvtier_operator.validation.object_endpoints import parse_allowed_endpoints

    evil = {**OBJECTS, "endpoint": "https://attacker.example:443",
            "credentialsSecret": {"name": "db-admin", "accessKeyIdKey": "password"}}
    tpc = cache(objectStore=evil)
    refused = inject(tpc, vllm_pod(), CTX)
    assert not refused.changed
    assert any("objectStore.allowedEndpoints: https://rgw.storage.svc:443" in c
               for c in refused.conflicts), refused.conflicts
    assert render_object_evictor(tpc, CTX) is None
    assert render_object_evictor(cache(objectStore=OBJECTS), CTX) is not None

    class NoCaches:
        def in_namespace(self, namespace):
            return []

    request = {"uid": "u", "operation": "CREATE", "object": tpc_doc({"objectStore": evil})}
    answer = validate_request(request, NoCaches(), (), CTX.allowed_object_endpoints)
    assert answer["response"]["allowed"] is False
    assert "allowedEndpoints" in answer["response"]["status"]["message"]
    ok = {"uid": "u", "operation": "CREATE", "object": tpc_doc({"objectStore": OBJECTS})}
    assert validate_request(ok, NoCaches(), (), CTX.allowed_object_endpoints)["response"][
        "allowed"]
    with pytest.raises(ValueError, match="KVTIER_ALLOWED_OBJECT_ENDPOINTS"):
        parse_allowed_endpoints("https://rgw.storage.svc:443/path")


def test_kvtier_render_refuses_an_object_endpoint_not_allowed(tmp_path):
    from kvtier_operator.cli import main

    path = tmp_path / "tpc.yaml"
    path.write_text(yaml.safe_dump(tpc_doc({"objectStore": OBJECTS})))
    assert main(["render", "-f", str(path)]) != 0
    assert main(["render", "-f", str(path), "--allow-object-endpoint",
                 "https://rgw.storage.svc:443"]) == 0
