"""Every validation rule of the API, with the message a user sees."""

from __future__ import annotations

import pytest

from kvtier_operator.api.v1alpha1 import StorageBackend
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.validation import InvalidResource, parse_tpc
from tests.helpers import BASE_TPC, merge, tpc_doc


def messages(doc: dict) -> str:
    with pytest.raises(InvalidResource) as err:
        parse_tpc(doc)
    return "\n".join(err.value.messages)


def test_base_is_valid_and_defaults_apply():
    tpc = parse_tpc(BASE_TPC)
    s = tpc.spec
    assert s.connector == "native"
    assert adapter_for(s).storage_backend(s) == StorageBackend.kvtier
    assert s.storage.mount_path == "/mnt/files-storage"
    assert s.storage.block_size is None and s.storage.block_tokens == 256
    assert s.storage.pvc.access_modes == ["ReadWriteMany"]
    assert s.storage.pvc.delete_policy == "Retain"
    assert (s.eviction.high_watermark, s.eviction.low_watermark) == (85, 70)
    assert s.eviction.min_idle_seconds == 600
    assert s.rollout == "Manual"
    assert s.cpu.bytes == 100 * 1024**3


@pytest.mark.parametrize(
    ("patch", "field", "needle"),
    [
        ({"cpu": {"size": "lots"}}, "spec.cpu.size", "not a Kubernetes quantity; write e.g."),
        ({"cpu": {"size": "0"}}, "spec.cpu.size", "must be positive"),
        ({"cpu": {"size": "-5Gi"}}, "spec.cpu.size", "must be positive"),
        ({"cpu": {"size": True}}, "spec.cpu.size", "not a Kubernetes quantity"),
        ({"storage": {"pvc": {"size": "1Tb"}}}, "spec.storage.pvc.size", "not a Kubernetes quantity"),
        ({"eviction": {"highWatermark": 70, "lowWatermark": 70}}, "spec.eviction",
         "lowWatermark 70 must be below highWatermark 70"),
        ({"eviction": {"highWatermark": 60, "lowWatermark": 80}}, "spec.eviction",
         "lower lowWatermark"),
        ({"eviction": {"lowWatermark": 0}}, "spec.eviction.lowWatermark",
         "greater than or equal to 1"),
        ({"eviction": {"inodeLowWatermark": 0}}, "spec.eviction.inodeLowWatermark",
         "greater than or equal to 1"),
        ({"eviction": {"highWatermark": 101}}, "spec.eviction.highWatermark",
         "less than or equal to 100"),
        ({"eviction": {"inodeHighWatermark": 50, "inodeLowWatermark": 50}}, "spec.eviction",
         "inodeLowWatermark 50 must be below inodeHighWatermark 50"),
        ({"eviction": {"schedule": "every 5 minutes"}}, "spec.eviction.schedule",
         "must be a five-field cron schedule"),
        ({"eviction": {"schedule": "*/5 * * *"}}, "spec.eviction.schedule",
         "must be a five-field cron schedule"),
        ({"eviction": {"schedule": "61 * * * *"}}, "spec.eviction.schedule",
         "must be a five-field cron schedule"),
        ({"eviction": {"minIdle": "ten minutes"}}, "spec.eviction.minIdle", "pattern"),
        ({"storage": {"mountPath": "mnt/cache"}}, "spec.storage.mountPath",
         "must be an absolute, normalised path"),
        ({"storage": {"mountPath": "/"}}, "spec.storage.mountPath", "'/' would shadow what the model server"),
        ({"storage": {"mountPath": "/etc/kv"}}, "spec.storage.mountPath",
         "'/etc/kv' would shadow what the model server's image keeps there"),
        ({"storage": {"mountPath": "/usr/../dev"}}, "spec.storage.mountPath",
         "'/usr/../dev' must be an absolute, normalised path"),
        ({"storage": {"mountPath": "/proc"}}, "spec.storage.mountPath", "/proc"),
        ({"storage": {"mountPath": "/sys/x"}}, "spec.storage.mountPath", "/sys"),
        ({"storage": {"blockSize": 100}}, "spec.storage.blockSize", "multiple of 16"),
        ({"storage": {"blockSize": 0}}, "spec.storage.blockSize", "greater than or equal to 16"),
        ({"selector": {"matchLabels": None}}, "spec.selector", "at least one label value"),
        ({"selector": {"matchLabels": None, "matchExpressions": []}}, "spec.selector",
         "at least one label value"),
        ({"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
         "spec.selector.matchExpressions[0]", "needs at least one value"),
        ({"selector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}},
         "spec.selector.matchExpressions[0]", "takes no values"),
        ({"storage": {"existingClaim": "mine"}}, "spec.storage",
         "pvc and existingClaim are mutually exclusive"),
        ({"storage": {"pvc": None}}, "spec.storage", "needs pvc (a new claim) or existingClaim"),
        ({"storage": {"pvc": {"storageClassName": ""}}}, "spec.storage.pvc.storageClassName",
         "empty storageClassName disables dynamic provisioning"),
        ({"model": {"layers": 64, "kvHeads": 8, "headDim": 128, "dtype": "bfloat16",
                    "kvBytesPerToken": 1000}}, "spec.model",
         "kvBytesPerToken 1000 disagrees with layers x kvHeads x headDim x 2 x dtype bytes = 262144"),
        ({"model": {"kvBytesPerToken": None, "layers": 64}}, "spec.model",
         "incomplete KV geometry: kvHeads, headDim, dtype missing"),
        ({"model": {"kvBytesPerToken": None}}, "spec.model", "no KV geometry"),
        ({"model": {"kvBytesPerToken": 0}}, "spec.model.kvBytesPerToken", "greater than 0"),
        ({"model": {"dtype": "int3", "kvBytesPerToken": None, "layers": 1, "kvHeads": 1,
                    "headDim": 1}}, "spec.model.dtype", "got 'int3'"),
        ({"connector": "lmcache", "storage": {"backend": "kvtier"}}, "spec",
         "storage.backend must be unset with connector lmcache"),
        ({"connector": "lmcache", "storage": {"pvc": None, "existingClaim": "c"}}, "spec",
         "storage.maxSizePerReplica is required with connector lmcache and existingClaim"),
        ({"storage": {"maxSizePerReplica": "1Ti"}}, "spec",
         "storage.maxSizePerReplica applies to connector lmcache only"),
        ({"storage": {"pvc": None, "existingClaim": "c"}, "eviction": {"capacity": "ClaimSize"}},
         "spec", "eviction.capacity ClaimSize measures usage against storage.pvc.size"),
        ({"connector": "grpc"}, "spec.connector", "'native', 'lmcache', 'mooncake-store' or 'kvbm'"),
        ({"rollout": "Sometimes"}, "spec.rollout", "'Auto' or 'Manual'"),
        ({"cpu": {"sise": "1Gi"}}, "spec.cpu.sise", "unknown field"),
        ({"cpu": None, "storage": None}, "spec", "spec.cpu is required unless kvtier "
         "offloads straight from GPU memory"),
        ({"cpu": None, "storage": {"backend": "vllm-fs"}}, "spec", "add cpu.size, e.g. 100Gi"),
        ({"cpu": None, "connector": "lmcache", "storage": {"backend": None}}, "spec",
         "connector native with storage backend kvtier"),
        ({"cpu": None, "storage": {"blockSize": 1024, "hostStagingSize": "256Mi"}}, "spec",
         "spec.storage.blockSize: without a CPU tier kvtier's pinned staging "
         "(spec.storage.hostStagingSize, 268435456 bytes once rounded down to a power of "
         "two) must hold at least 2 files, and one file of 1024 tokens takes 268435968 "
         "bytes of this model's KV (spec.model); lower blockSize to 256 or less"),
        ({"cpu": None, "storage": {"blockSize": 64, "hostStagingSize": "4Mi"}}, "spec",
         "one file of 64 tokens takes 16777248 bytes of this model's KV (spec.model); even "
         "16-token files do not fit: raise hostStagingSize"),
        ({"hashSeed": -1}, "spec.hashSeed", "greater than or equal to 0"),
    ],
)
def test_rule_names_field_and_fix(patch, field, needle):
    doc = merge(BASE_TPC, {"spec": patch})
    text = messages(doc)
    assert f"{field}: " in text, text
    assert needle in text, text


def test_no_cpu_tier_means_no_cpu_tier():
    s = parse_tpc(merge(BASE_TPC, {"spec": {"cpu": None}})).spec
    assert s.no_cpu_tier and s.cpu_bytes == 0 and adapter_for(s).storage_backend(s) == StorageBackend.kvtier
    assert not parse_tpc(BASE_TPC).spec.no_cpu_tier


def test_name_too_long_for_cronjob():
    text = messages(tpc_doc(name="x" * 45))
    assert "metadata.name: " in text and "at most 44" in text


def test_geometry_computed_and_consistent():
    tpc = parse_tpc(tpc_doc({"model": {"kvBytesPerToken": None, "layers": 80, "kvHeads": 8,
                                       "headDim": 128, "dtype": "bfloat16"}}))
    assert tpc.spec.model.bytes_per_token == 327680  # Llama-3.3-70B
    both = tpc_doc({"model": {"kvBytesPerToken": 327680, "layers": 80, "kvHeads": 8,
                              "headDim": 128, "dtype": "bfloat16"}})
    assert parse_tpc(both).spec.model.bytes_per_token == 327680


def test_quantity_forms_accepted():
    for size in ("100Gi", "1.5Ti", "200G", 107374182400, "5e9"):
        tpc = parse_tpc(tpc_doc({"cpu": {"size": size}}))
        assert tpc.spec.cpu.bytes > 0


def test_cron_macros_and_valid_schedules():
    for schedule in ("@hourly", "0 */2 * * *", "*/5 * * * *", "15 3 * * 1-5"):
        assert parse_tpc(tpc_doc({"eviction": {"schedule": schedule}}))


def test_hash_seed_default_is_stable_and_namespace_scoped():
    a = parse_tpc(tpc_doc()).hash_seed
    assert a == parse_tpc(tpc_doc()).hash_seed
    assert a != parse_tpc(tpc_doc(namespace="other")).hash_seed
    assert parse_tpc(tpc_doc({"hashSeed": 42})).hash_seed == 42


def test_selector_matching():
    from kvtier_operator.api.v1alpha1 import LabelSelector

    sel = LabelSelector.model_validate({
        "matchLabels": {"role": "decode"},
        "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]},
                             {"key": "skip", "operator": "DoesNotExist"}],
    })
    assert sel.matches({"role": "decode", "tier": "a"})
    assert not sel.matches({"role": "decode", "tier": "c"})
    assert not sel.matches({"role": "prefill", "tier": "a"})
    assert not sel.matches({"role": "decode", "tier": "a", "skip": "1"})


def test_selector_query_in_the_api_syntax():
    from kvtier_operator.api.v1alpha1 import LabelSelector

    sel = LabelSelector.model_validate({
        "matchLabels": {"role": "decode", "app": "vllm"},
        "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]},
                             {"key": "zone", "operator": "NotIn", "values": ["x"]},
                             {"key": "gpu", "operator": "Exists"},
                             {"key": "skip", "operator": "DoesNotExist"}],
    })
    assert sel.query() == "app=vllm,role=decode,tier in (a,b),zone notin (x),gpu,!skip"


def test_selector_with_empty_match_labels_is_refused():
    doc = tpc_doc()
    doc["spec"]["selector"] = {"matchLabels": {}}
    assert "at least one label value" in messages(doc)
