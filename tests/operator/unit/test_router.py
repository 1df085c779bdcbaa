"""The router config kvtier renders (issue #33): dialects, every tier weighted, scoring
modes, the pods' KV-events wiring, capacity from the engine.

The plugin and parameter names pinned here are the llm-d router's own at
render.router.ROUTER_COMMIT (its PluginType constants and json tags); a change to one
of them must be checked against the router again.
"""

from __future__ import annotations

import json

import pytest
import yaml

from kvtier_operator.engines.base import DEFAULT_TIER_WEIGHTS
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.render.objects import render_objects
from kvtier_operator.render.pod import config_hash, inject
from kvtier_operator.render.router import (
    ROUTER_COMMIT,
    backend_configs,
    endpoint_picker_config,
    render_router_configmap,
)
from kvtier_operator.validation import parse_tpc
from tests.helpers import example, tpc_doc, vllm_pod
from tests.operator.unit.test_render import CTX, kv_flag

PRECISE = {"enabled": True, "scoring": "precise"}
SGLANG = {"engine": "sglang", "sglang": {}}


def tpc(spec=None, **meta):
    return parse_tpc(tpc_doc(spec, **meta))


def plugin(cfg, type_, name=None):
    return next(p for p in cfg["plugins"]
                if p["type"] == type_ and (name is None or p.get("name") == name))


# ---------------------------------------------------------------- dialects

def test_default_dialect_is_v1_and_v1alpha1_is_selectable():
    assert endpoint_picker_config(tpc({"router": {"enabled": True}}))["apiVersion"] == \
        "llm-d.ai/v1"
    old = endpoint_picker_config(
        tpc({"router": {"enabled": True, "apiVersion": "llm-d.ai/v1alpha1"}}))
    assert old["apiVersion"] == "llm-d.ai/v1alpha1"


@pytest.mark.parametrize("scoring", ["approximate", "precise"])
def test_dialects_differ_only_in_api_version(scoring):
    router = {"enabled": True, "scoring": scoring}
    v1 = endpoint_picker_config(tpc({"router": router}))
    old = endpoint_picker_config(tpc({"router": router | {"apiVersion": "llm-d.ai/v1alpha1"}}))
    assert {k: v for k, v in v1.items() if k != "apiVersion"} == \
        {k: v for k, v in old.items() if k != "apiVersion"}


def test_unknown_dialect_is_refused():
    with pytest.raises(ValueError, match="apiVersion"):
        tpc({"router": {"enabled": True, "apiVersion": "llm-d.ai/v2"}})


def test_router_commit_is_recorded():
    assert len(ROUTER_COMMIT) == 40


# ------------------------------------------------------ approximate (pinned)

def test_approximate_keys_pinned():
    cfg = endpoint_picker_config(tpc({"router": {"enabled": True}}))
    assert set(cfg) == {"apiVersion", "kind", "plugins", "schedulingProfiles"}
    assert cfg["kind"] == "EndpointPickerConfig"
    assert [(p["type"], p.get("name")) for p in cfg["plugins"]] == [
        ("no-hit-lru-scorer", None),
        ("approx-prefix-cache-producer", "gpu-prefix-cache-producer"),
        ("approx-prefix-cache-producer", "cpu-prefix-cache-producer"),
        ("queue-scorer", None),
        ("kv-cache-utilization-scorer", None),
        ("prefix-cache-scorer", "gpu-prefix-cache-scorer"),
        ("prefix-cache-scorer", "cpu-prefix-cache-scorer"),
    ]
    cpu = plugin(cfg, "approx-prefix-cache-producer", "cpu-prefix-cache-producer")
    assert cpu["parameters"] == {"autoTune": False, "blockSizeTokens": 16,
                                 "lruCapacityPerServer": 25600}
    scorer = plugin(cfg, "prefix-cache-scorer", "cpu-prefix-cache-scorer")
    assert scorer["parameters"] == {"prefixMatchInfoProducerName": "cpu-prefix-cache-producer"}


# ----------------------------------------------------------- capacity observed

def test_observed_cpu_capacity_replaces_the_computed_one():
    t = tpc({"router": {"enabled": True}})
    cfg = endpoint_picker_config(t, observed_cpu_blocks=31000)
    cpu = plugin(cfg, "approx-prefix-cache-producer", "cpu-prefix-cache-producer")
    assert cpu["parameters"]["lruCapacityPerServer"] == 31000
    cm = render_router_configmap(t, observed_cpu_blocks=31000)
    assert "lruCapacityPerServer: 31000" in cm["data"]["tiered-prefix-cache-plugins.yaml"]
    objects = render_objects(t, CTX, observed_cpu_blocks=31000)
    assert "lruCapacityPerServer: 31000" in objects[-1]["data"][
        "tiered-prefix-cache-plugins.yaml"]
    # Absent: the computed value.
    assert "lruCapacityPerServer: 25600" in render_router_configmap(t)["data"][
        "tiered-prefix-cache-plugins.yaml"]


def test_observed_capacity_adds_no_cpu_scorer_without_a_cpu_tier():
    cfg = endpoint_picker_config(tpc({"cpu": None, "router": {"enabled": True}}),
                                 observed_cpu_blocks=1000)
    assert not any(p.get("name", "").startswith("cpu-") for p in cfg["plugins"])


# --------------------------------------------------------- tiers and weights

def test_every_configured_tier_is_named_with_its_default_weight():
    assert backend_configs(tpc({"router": PRECISE})) == [
        {"name": "gpu", "weight": 1.0}, {"name": "cpu", "weight": 0.8},
        {"name": "storage", "weight": 0.4}]
    assert backend_configs(tpc({"storage": None, "router": PRECISE})) == [
        {"name": "gpu", "weight": 1.0}, {"name": "cpu", "weight": 0.8}]
    assert backend_configs(tpc({"cpu": None, "router": PRECISE})) == [
        {"name": "gpu", "weight": 1.0}, {"name": "storage", "weight": 0.4}]


def test_default_weights_follow_tier_speed():
    assert DEFAULT_TIER_WEIGHTS["gpu"] > DEFAULT_TIER_WEIGHTS["cpu"] > \
        DEFAULT_TIER_WEIGHTS["storage"] > 0


def test_weight_override_per_tier():
    t = tpc({"router": PRECISE | {"tierWeights": {"storage": 0.6}}})
    assert backend_configs(t) == [
        {"name": "gpu", "weight": 1.0}, {"name": "cpu", "weight": 0.8},
        {"name": "storage", "weight": 0.6}]
    with pytest.raises(ValueError):
        tpc({"router": PRECISE | {"tierWeights": {"storage": 1.5}}})


def test_sglang_tiers_carry_hicache_media():
    t = tpc(SGLANG | {"router": {"enabled": True}})
    tiers = adapter_for(t.spec).router_tiers(t.spec)
    assert [(x.medium, x.router_name, x.weight) for x in tiers] == [
        ("GPU", "gpu", 1.0), ("CPU_TIER1", "cpu_tier1", 0.8), ("CPU_TIER2", "cpu_tier2", 0.4)]


def test_precise_refused_where_kvtier_cannot_wire_events():
    with pytest.raises(ValueError, match="scoring precise"):
        tpc(SGLANG | {"router": PRECISE})


# ------------------------------------------------------------------ precise

def test_precise_config_pinned():
    cfg = endpoint_picker_config(tpc({"router": PRECISE}))
    assert set(cfg) == {"apiVersion", "kind", "plugins", "dataLayer", "schedulingProfiles"}
    assert [p["type"] for p in cfg["plugins"]] == [
        "token-producer", "endpoint-notification-source", "metrics-data-source",
        "core-metrics-extractor", "precise-prefix-cache-producer", "prefix-cache-scorer",
        "queue-scorer", "kv-cache-utilization-scorer"]
    assert plugin(cfg, "token-producer")["parameters"] == {"modelName": "Qwen/Qwen3-32B"}
    producer = plugin(cfg, "precise-prefix-cache-producer")["parameters"]
    assert set(producer) == {"tokenProcessorConfig", "indexerConfig", "kvEventsConfig"}
    assert producer["tokenProcessorConfig"] == {"blockSize": 16}
    assert producer["indexerConfig"] == {"kvCacheBackendConfigs": [
        {"name": "gpu", "weight": 1.0}, {"name": "cpu", "weight": 0.8},
        {"name": "storage", "weight": 0.4}]}
    assert producer["kvEventsConfig"] == {
        "topicFilter": "kv@", "discoverPods": True,
        "podDiscoveryConfig": {"podLabelSelector": "llm-d.ai/role=decode",
                               "podNamespace": "ml", "socketPort": 5557}}
    assert plugin(cfg, "prefix-cache-scorer")["parameters"] == {
        "prefixMatchInfoProducerName": "precise-prefix-cache-producer"}
    assert cfg["dataLayer"]["sources"][1] == {
        "pluginRef": "endpoint-notification-source",
        "extractors": [{"pluginRef": "precise-prefix-cache-producer"}]}
    refs = [p["pluginRef"] for p in cfg["schedulingProfiles"][0]["plugins"]]
    assert set(refs) <= {p.get("name") or p["type"] for p in cfg["plugins"]}


def test_precise_binds_the_eviction_events_port():
    t = tpc({"router": PRECISE | {"evictionEventsEndpoint": "tcp://epp.ml.svc:5590"}})
    producer = plugin(endpoint_picker_config(t), "precise-prefix-cache-producer")
    assert producer["parameters"]["kvEventsConfig"]["zmqEndpoint"] == "tcp://*:5590"


@pytest.mark.parametrize("endpoint", ["tcp://a b:1", "ipc:///x", "tcp://h", "tcp://h:1;rm",
                                      "tcp://-h:1"])
def test_eviction_events_endpoint_is_checked(endpoint):
    with pytest.raises(ValueError, match="tcp://"):
        tpc({"router": PRECISE | {"evictionEventsEndpoint": endpoint}})


def test_precise_pod_publishes_kv_events_and_the_tier_announces():
    t = tpc({"router": PRECISE | {"kvEventsPort": 5600}})
    inj = inject(t, vllm_pod(), CTX)
    assert inj.conflicts == []
    c = inj.pod["spec"]["containers"][0]
    args = c["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:5600", "topic": "kv@cache@Qwen/Qwen3-32B"}
    tier = kv_flag(c)["kv_connector_extra_config"]["secondary_tiers"][0]
    assert tier["enable_kv_events"] is True


@pytest.mark.parametrize("scoring", ["approximate", "precise"])
def test_gpu_direct_announces_the_volume_in_precise_mode_only(scoring):
    """No CPU tier (kvtier's own OffloadingSpec): its manager announces the blocks on the
    volume on the engine's KV events where the router indexes them."""
    doc = example("native-gpu-direct.yaml")
    doc["spec"]["router"] = {"enabled": True, "scoring": scoring}
    t = parse_tpc(doc)
    c = inject(t, vllm_pod(), CTX).pod["spec"]["containers"][0]
    extra = kv_flag(c)["kv_connector_extra_config"]
    assert extra["spec_name"] == "KvtierOffloadingSpec"
    assert extra.get("enable_kv_events", False) is (scoring == "precise")
    assert ("--kv-events-config" in c["args"]) is (scoring == "precise")


def test_precise_in_a_shell_script_goes_through_env():
    t = tpc({"router": PRECISE})
    pod = vllm_pod(command=["/bin/sh", "-c"], args=["exec vllm serve Qwen/Qwen3-32B"])
    inj = inject(t, pod, CTX)
    assert inj.conflicts == []
    c = inj.pod["spec"]["containers"][0]
    assert '--kv-events-config "$KVTIER_KV_EVENTS_CONFIG"' in c["args"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert json.loads(env["KVTIER_KV_EVENTS_CONFIG"])["publisher"] == "zmq"


def test_approximate_pods_do_not_publish():
    inj = inject(tpc({"router": {"enabled": True}}), vllm_pod(), CTX)
    assert "--kv-events-config" not in inj.pod["spec"]["containers"][0]["args"]
    assert "enable_kv_events" not in kv_flag(inj.pod["spec"]["containers"][0])[
        "kv_connector_extra_config"]["secondary_tiers"][0]


def test_own_kv_events_flag_is_a_conflict():
    pod = vllm_pod(args=["Qwen/Qwen3-32B", "--kv-events-config", "{}"])
    inj = inject(tpc({"router": PRECISE}), pod, CTX)
    assert any("--kv-events-config" in c for c in inj.conflicts)


def test_scoring_mode_changes_the_pods_config_hash():
    assert config_hash(tpc({"router": PRECISE}), CTX) != \
        config_hash(tpc({"router": {"enabled": True}}), CTX)
    # Approximate scoring leaves pods exactly as before (no restart on upgrade).
    assert config_hash(tpc({"router": {"enabled": True}}), CTX) == config_hash(tpc(), CTX)


def test_configmap_yaml_round_trips():
    cm = render_router_configmap(tpc({"router": PRECISE}))
    assert yaml.safe_load(cm["data"]["tiered-prefix-cache-plugins.yaml"]) == \
        endpoint_picker_config(tpc({"router": PRECISE}))


def test_evictor_publishes_where_the_router_binds():
    from kvtier_operator.render.cronjob import evictor_args

    args = evictor_args(tpc({"router": PRECISE | {"evictionEventsEndpoint": "tcp://epp:5590"}}))
    assert args[args.index("--events-endpoint") + 1] == "tcp://epp:5590"
    assert args[args.index("--events-topic") + 1] == "kv@cache@Qwen/Qwen3-32B"
    assert "--events-endpoint" not in evictor_args(tpc({"router": PRECISE}))


# ------------------------------------------------- the router's name of a pod

def test_target_ports_default_to_the_engines_serving_port():
    """vLLM's --port default, which is also the llm-d router chart's default targetPorts
    (config/charts/routerlib/values.yaml at ROUTER_COMMIT)."""
    t = tpc({"router": PRECISE})
    assert adapter_for(t.spec).router_target_ports(t.spec) == [8000]
    assert "model-servers.yaml" not in render_router_configmap(t)["data"]


def test_target_ports_go_into_the_routers_model_servers_values():
    """One field for the InferencePool's targetPorts and the pods' names kvtier publishes
    removals under: the router chart's modelServers values carry the same ports."""
    t = tpc({"router": PRECISE | {"targetPorts": [8200, 8201]}})
    assert adapter_for(t.spec).router_target_ports(t.spec) == [8200, 8201]
    values = yaml.safe_load(render_router_configmap(t)["data"]["model-servers.yaml"])
    assert values["modelServers"]["targetPorts"] == [{"number": 8200}, {"number": 8201}]
    assert values["modelServers"]["matchLabels"] == t.spec.selector.match_labels


@pytest.mark.parametrize("ports", [[], [8000, 8000], [0], [70000], list(range(8000, 8009))])
def test_bad_target_ports_are_refused(ports):
    with pytest.raises(ValueError, match=r"targetPorts|target_ports"):
        tpc({"router": PRECISE | {"targetPorts": ports}})


def test_precise_refuses_a_model_name_the_routers_topic_cannot_carry():
    """The router splits kv@<pod>@<model> at '@' and takes exactly three parts
    (engineadapter/common.go:36-45 at ROUTER_COMMIT): an '@' in the model empties it."""
    doc = tpc_doc({"router": PRECISE})
    doc["spec"]["model"]["name"] = "org/model@v2"
    with pytest.raises(ValueError, match=r"spec\.model\.name.*'@'"):
        parse_tpc(doc)
    doc["spec"]["router"] = {"enabled": True}
    assert parse_tpc(doc).spec.model.name == "org/model@v2"  # approximate: no topic


@pytest.mark.parametrize("router", [{"enabled": True}, {"enabled": False, "scoring": "precise"},
                                    {"scoring": "precise"}])
def test_eviction_events_need_the_precise_config(router):
    """Without kvtier's precise config nothing binds the endpoint and the pods publish no
    events to index: every run would drop every removal. Refused with the fix."""
    with pytest.raises(ValueError, match=r"set spec\.router\.enabled: true and scoring: precise"):
        tpc({"router": router | {"evictionEventsEndpoint": "tcp://epp:5590"}})
