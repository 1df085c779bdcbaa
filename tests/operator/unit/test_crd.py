"""The generated CRD: up to date, structural, documented, valid apiextensions/v1."""

from __future__ import annotations

import celpy
import kubernetes_validate
import pytest
import yaml

from kvtier_operator.crd import crd, lint, openapi_schema
from tests.helpers import BASE_TPC, ROOT, merge

CRD_FILE = ROOT / "crds" / "tieredprefixcaches.kvtier.dev.yaml"


def test_committed_crd_is_generated_one():
    committed = yaml.safe_load(CRD_FILE.read_text())
    assert committed == crd(), "crds/ is stale: run `make crds` and commit the result"


def test_generated_schema_is_structural_and_documented():
    assert lint(openapi_schema()) == []


def test_crd_validates_against_apiextensions_v1():
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(crd(), version, strict=True)


def test_apiextensions_validation_can_fail():
    broken = crd()
    broken["spec"]["versions"][0]["served"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_crd_shape():
    spec = crd()["spec"]
    assert spec["names"]["shortNames"] == ["tpc"]
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for name in ("Ready", "Storage", "Injected", "Usage", "Age"):
        assert name in columns
    props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["cpu"]["properties"]["size"]["x-kubernetes-int-or-string"] is True
    assert "type" not in props["cpu"]["properties"]["size"]
    assert props["storage"]["nullable"] is True
    assert props["storage"]["properties"]["blockSize"]["multipleOf"] == 16
    assert props["eviction"]["properties"]["highWatermark"]["maximum"] == 100
    assert props["eviction"]["properties"]["highWatermark"]["default"] == 85
    assert props["connector"]["enum"] == ["native", "lmcache", "mooncake-store", "kvbm"]
    assert props["engine"]["enum"] == ["vllm", "vllm-tpu", "sglang"]
    assert "nullable" not in props["storage"]["properties"]["backend"]


# One negative case for each rule of the lint: each must be caught.
@pytest.mark.parametrize(
    ("node", "needle"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/x", "description": "d"}}},
         "$ref is forbidden"),
        ({"type": "object", "$defs": {}}, "$defs is forbidden"),
        ({"type": "object", "definitions": {}}, "definitions is forbidden"),
        ({"type": "string", "const": "x"}, "const is forbidden"),
        ({"type": "array", "prefixItems": [], "items": {"type": "string"}}, "prefixItems"),
        ({"type": "array", "uniqueItems": True, "items": {"type": "string"}}, "uniqueItems"),
        ({"type": "object", "patternProperties": {}}, "patternProperties"),
        ({"type": "null"}, "type null is forbidden"),
        ({"type": "string", "enum": ["a"], "nullable": True}, "nullable enum refuses null"),
        ({"description": "no type"}, "every node needs a type"),
        ({"type": "object", "properties": {}, "additionalProperties": False},
         "mutually exclusive"),
        ({"type": "integer", "exclusiveMinimum": 0}, "exclusiveMinimum must be a boolean"),
        ({"type": "array", "items": [{"type": "string"}]}, "items must be one schema"),
        ({"type": "object", "x-kubernetes-preserve-unknown-fields": False},
         "must be true or absent"),
        ({"type": "array", "x-kubernetes-list-type": "map", "items": {"type": "object"}},
         "needs x-kubernetes-list-map-keys"),
        ({"type": "object", "anyOf": [{"type": "string"}]}, "type is forbidden inside anyOf"),
        ({"type": "object", "oneOf": [{"nullable": True}]}, "nullable is forbidden inside oneOf"),
        ({"type": "object", "properties": {"x": {"type": "object", "properties": {
            "y": {"type": "string"}}, "description": "d"}}}, "x.y: has no description"),
    ],
)
def test_lint_catches(node, needle):
    problems = lint(node)
    assert any(needle in p for p in problems), problems


def test_lint_accepts_int_or_string_and_preserve_unknown():
    assert lint({"x-kubernetes-int-or-string": True}) == []
    assert lint({"type": "object", "x-kubernetes-preserve-unknown-fields": True}) == []


# ------------------------------------------------ CEL rules, evaluated for real

def _rules(schema: dict, path: str = "") -> list[tuple[str, dict]]:
    found = [(path, r) for r in schema.get("x-kubernetes-validations", [])]
    for name, sub in (schema.get("properties") or {}).items():
        found += _rules(sub, f"{path}.{name}" if path else name)
    return found


def _at(doc: dict, path: str) -> dict | None:
    node = doc
    for part in path.split("."):
        node = node.get(part)
        if node is None:
            return None
    return node


def _failed_messages(doc: dict, old: dict | None = None) -> list[str]:
    """The messages of the rules `doc` fails; with `old`, as an update from `old` (the
    API server runs transition rules, those naming oldSelf, on updates only)."""
    env = celpy.Environment()
    failed = []
    for path, rule in _rules(openapi_schema()):
        target = _at(doc, path)
        if target is None:
            continue
        binding = {"self": celpy.json_to_cel(target)}
        if "oldSelf" in rule["rule"]:
            before = _at(old, path) if old is not None else None
            if before is None:
                continue
            binding["oldSelf"] = celpy.json_to_cel(before)
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate(binding)):
            failed.append(rule["message"])
    return failed


def _schema_defaults(doc: dict) -> dict:
    """The API server applies defaults before CEL runs; mimic that for eviction."""
    eviction = {"highWatermark": 85, "lowWatermark": 70, "inodeHighWatermark": 90,
                "inodeLowWatermark": 80}
    storage = {"mountPath": "/mnt/files-storage"}
    out = merge(doc, {"spec": {"eviction": {**eviction, **doc["spec"].get("eviction", {})},
                               "connector": doc["spec"].get("connector", "native")}})
    if "storage" in out["spec"]:
        out["spec"]["storage"] = {**storage, **out["spec"]["storage"]}
    return out


def test_cel_rules_exist_for_cross_field_checks():
    found = _rules(openapi_schema())
    cross_field = [r for path, r in found if "self." in r["rule"].replace("self.matches", "")]
    # stagingSize with a CPU tier, ReadWriteOncePod alone; the registry's engine and
    # connector pair, shared tier, backend, and one per settings block (tpu, mooncake);
    # the transition rules keeping engine, connector and storage backend fixed; a deprecated
    # name and its new one not both given (storage, tpu); precise router scoring only
    # where the engine publishes KV events; engineVersion only with a version table, not
    # below its oldest, not below a field's feature (syncLoadBudget: 0.33); syncLoadBudget
    # only with connector native, and not with several KV cache groups; localDisk and
    # objectStore only behind a CPU tier and only with the adapters that chain them,
    # exactly one local-disk volume source, peerSharing refused; no '@' in the model name
    # under precise scoring (the router's KV-events topic); evictionEventsEndpoint only
    # with the precise config
    assert len(cross_field) == 32
    field_rules = {path for path, r in found if r["rule"].lstrip("!").startswith("self.matches")}
    assert field_rules == {"spec.containerName", "spec.model.name",
                           "spec.storage.pvc.storageClassName", "spec.storage.existingClaim",
                           "spec.storage.mountPath", "spec.eviction.schedule",
                           "spec.router.configMapName", "spec.mooncake.configMapName",
                           "spec.router.evictionEventsEndpoint",
                           "spec.mooncake.configKey", "spec.mooncake.masterService.name",
                           "spec.mooncake.masterService.namespace",
                           "spec.mooncake.rdmaResource",
                           "spec.mooncake.offload.clientDaemonSet.name",
                           "spec.mooncake.offload.clientDaemonSet.namespace",
                           "spec.mooncake.offload.rootDir",
                           "spec.localDisk.mountPath", "spec.localDisk.volume.hostPath.path",
                           "spec.localDisk.volume.ephemeral.storageClassName",
                           "spec.objectStore.bucket", "spec.objectStore.prefix",
                           "spec.objectStore.endpoint", "spec.objectStore.region",
                           "spec.objectStore.evictionSchedule",
                           "spec.objectStore.credentialsSecret.name",
                           "spec.objectStore.credentialsSecret.accessKeyIdKey",
                           "spec.objectStore.credentialsSecret.secretAccessKeyKey",
                           "spec.objectStore.credentialsSecret.sessionTokenKey"}


@pytest.mark.slow
def test_cel_rules_accept_the_examples():
    for f in (ROOT / "examples").glob("*.yaml"):
        doc = yaml.safe_load(f.read_text())
        if doc["kind"] == "TieredPrefixCache":
            assert _failed_messages(_schema_defaults(doc)) == [], f.name


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"eviction": {"lowWatermark": 90}}, "lowWatermark must be below highWatermark"),
        ({"eviction": {"inodeLowWatermark": 95}}, "inodeLowWatermark must be below"),
        ({"storage": {"existingClaim": "x"}}, "exactly one of pvc"),
        ({"storage": {"mountPath": "relative"}}, "must be an absolute, normalised path"),
        ({"storage": {"mountPath": "//etc"}}, "must be an absolute, normalised path"),
        ({"storage": {"mountPath": "/etc"}}, "would shadow what the model server's image keeps"),
        ({"selector": {"matchLabels": None}}, "at least one label value"),
        *[({"selector": {"matchLabels": None, "matchExpressions": [term]}},
           "at least one label value") for term in (
            {"key": "zzz", "operator": "DoesNotExist"}, {"key": "app", "operator": "Exists"},
            {"key": "app", "operator": "NotIn", "values": ["postgres"]})],
        ({"model": {"kvBytesPerToken": None, "layers": 4}}, "needs kvBytesPerToken, or all"),
        ({"cpu": None, "storage": None}, "spec.cpu is required unless"),
        ({"cpu": None, "storage": {"backend": "vllm-fs"}}, "spec.cpu is required unless"),
        ({"cpu": None, "connector": "lmcache"}, "spec.cpu is required unless"),
        ({"model": {"name": "org/m@v2"}, "router": {"enabled": True, "scoring": "precise"}},
         "which the router splits at '@'"),
        ({"router": {"enabled": True, "evictionEventsEndpoint": "tcp://epp:5590"}},
         "takes the evictor's removals only with the precise config"),
    ],
)
def test_cel_rules_reject(patch, needle):
    doc = _schema_defaults(merge(BASE_TPC, {"spec": patch}))
    assert any(needle in m for m in _failed_messages(doc))


# ------------------------------------------------ what a live cache may not change

SGLANG = {"engine": "sglang", "sglang": {}, "storage": {"backend": None}}
IMMUTABLE_CHANGES = [
    ({}, SGLANG, "spec.engine cannot change"),
    ({}, {"connector": "lmcache", "storage": {"backend": None}}, "spec.connector cannot change"),
    ({"storage": {"backend": "kvtier"}}, {"storage": {"backend": "vllm-fs"}},
     "spec.storage.backend cannot change"),
    ({}, {"storage": {"backend": "vllm-fs"}}, "spec.storage.backend cannot change"),
]
IMMUTABLE_KEPT = [
    ({}, {"cpu": {"size": "200Gi"}}),  # other fields change freely
    ({}, {"engine": "vllm", "connector": "native"}),  # the defaults, now explicit
    ({}, {"storage": {"backend": "kvtier"}}),  # the backend's default, now explicit
    ({"storage": {"backend": "kvtier"}}, {"storage": {"backend": None}}),
    ({"storage": None, "cpu": {"size": "1Gi"}}, {"storage": {"backend": "vllm-fs", "pvc": {"size": "1Ti"}}}),
]


@pytest.mark.parametrize(("old", "new", "needle"), IMMUTABLE_CHANGES)
def test_cel_transition_rules_refuse_changing_the_engine(old, new, needle):
    before = merge(BASE_TPC, {"spec": old})
    after = merge(before, {"spec": new})
    failed = _failed_messages(after, old=before)
    assert any(needle in m and "create a new TieredPrefixCache (and PVC)" in m
               for m in failed), failed
    assert _failed_messages(after) == [], "a create of the same object is accepted"


@pytest.mark.parametrize(("old", "new"), IMMUTABLE_KEPT)
def test_cel_transition_rules_allow_updates_that_keep_the_engine(old, new):
    before = merge(BASE_TPC, {"spec": old})
    after = merge(before, {"spec": new})
    assert _failed_messages(after, old=before) == []
