"""Generate the TieredPrefixCache CRD from the pydantic models, and lint it as structural.

pydantic emits JSON Schema 2020-12; a CRD wants a structural OpenAPI v3 subset. The
conversion inlines $refs, turns Optional into nullable, keeps x-kubernetes-* extensions
and drops keywords the API server rejects. `lint()` re-checks the output so a model
change that produces a forbidden construct fails the tests rather than `kubectl apply`.
"""

from __future__ import annotations

import copy
from typing import Any

from kvtier_operator import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from kvtier_operator.api.rules import CR_NAME
from kvtier_operator.api.v1alpha1 import TieredPrefixCacheSpec, TieredPrefixCacheStatus
from kvtier_operator.validation.engine_rules import spec_rules

# Keywords pydantic may emit that are not JSONSchemaProps fields, or that the API server
# forbids in structural schemas.
_DROP = {"title", "examples", "$schema"}
FORBIDDEN = {
    "$ref": "inline the definition",
    "$defs": "inline the definition",
    "definitions": "inline the definition",
    "const": "use enum with one value",
    "prefixItems": "tuples are not expressible; use an object",
    "uniqueItems": "use x-kubernetes-list-type: set",
    "id": "not supported",
    "dependencies": "not supported",
    "patternProperties": "not supported",
    "additionalItems": "not supported",
    "discriminator": "not supported",
    "readOnly": "not supported",
}
_JUNCTORS = ("allOf", "anyOf", "oneOf", "not")


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs)
    return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}


def _structural(node: Any, *, in_properties: bool = False) -> Any:
    """Rewrite one (inlined) schema node into the structural subset."""
    if isinstance(node, list):
        return [_structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    if in_properties:
        return {name: _structural(schema) for name, schema in node.items()}
    out: dict[str, Any] = {}
    any_of = node.get("anyOf")
    if any_of is not None:
        branches = [b for b in any_of if b != {"type": "null"}]
        if len(branches) != len(any_of) and len(branches) == 1:
            # Optional[X]: X itself, nullable, without pydantic's default: null.
            merged = {**branches[0], **{k: v for k, v in node.items() if k != "anyOf"}}
            if merged.get("default", 0) is None:
                merged.pop("default")
            # kube-openapi checks enum even on null data, so a nullable enum would refuse
            # an explicit null; a non-nullable field has nulls pruned (= unset) instead.
            if "enum" not in merged:
                merged["nullable"] = True
            return _structural(merged)
        raise ValueError(f"union types are not structural: {node}")
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "additionalProperties" and value is False:
            continue  # extra='forbid'; the API server prunes unknown fields anyway
        if key == "properties":
            out[key] = _structural(value, in_properties=True)
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"], out["exclusiveMaximum"] = value, True
        else:
            out[key] = _structural(value)
    if "x-kubernetes-int-or-string" in out:
        out.pop("type", None)
    if out.get("type") == "object" and "additionalProperties" in out:
        ap = out["additionalProperties"]
        if isinstance(ap, dict) and not ap:
            out["additionalProperties"] = True
    return out


def _schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    defs = raw.pop("$defs", {})
    return _structural(_inline(raw, defs))


def openapi_schema() -> dict[str, Any]:
    spec = _schema_of(TieredPrefixCacheSpec)
    # The API's engine-neutral rules, among the engines' (validation/engine_rules.py).
    # Keys sorted, as pydantic writes the schema it generates.
    spec["x-kubernetes-validations"] = [
        dict(sorted(r.items())) for r in spec_rules(spec["x-kubernetes-validations"])]
    status = _schema_of(TieredPrefixCacheStatus)
    return {
        "type": "object",
        "description": "A tiered prefix (KV) cache for vLLM and SGLang model servers: GPU "
        "HBM, CPU RAM and an optional shared filesystem volume.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "kvtier.dev/v1alpha1"},
            "kind": {"type": "string", "description": "TieredPrefixCache"},
            # A CRD may constrain metadata.name (and generateName) only.
            "metadata": {"type": "object", "properties": {
                "name": {"type": "string", **CR_NAME.pattern_schema()}}},
            "spec": {
                **spec,
                "description": "Which pods get the cache and how its tiers are sized.",
            },
            "status": {**status, "description": "What kvtier observed and did."},
        },
    }


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Storage", "type": "string", "jsonPath": ".status.pvc.phase"},
    {"name": "Injected", "type": "integer", "jsonPath": ".status.injectedPods"},
    {"name": "Pending", "type": "integer", "jsonPath": ".status.pendingPods", "priority": 1},
    {"name": "Usage", "type": "number", "jsonPath": ".status.usage.percent"},
    # Share of prompt tokens served from the offloaded tiers, %; -o wide: each tier's.
    {"name": "Hit", "type": "number", "jsonPath": ".status.hitPercent"},
    *({"name": f"{title}-Hit", "type": "number",
       "jsonPath": f'.status.tiers[?(@.name=="{tier}")].hitPercent', "priority": 1}
      for tier, title in (("gpu", "GPU"), ("cpu", "CPU"), ("localDisk", "LocalDisk"),
                          ("storage", "Storage"), ("objectStore", "ObjectStore"))),
    {"name": "Recompute", "type": "number", "jsonPath": ".status.recompute.percent",
     "priority": 1},
    {"name": "Last-Eviction", "type": "string", "jsonPath": ".status.lastEviction.outcome",
     "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["kvtier"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


# ------------------------------------------------------------------- lint


def lint(schema: dict[str, Any], path: str = "") -> list[str]:
    """Every reason `schema` is not a structural schema with documented fields."""
    problems: list[str] = []
    where = path or "<root>"
    for key, fix in FORBIDDEN.items():
        if key in schema:
            problems.append(f"{where}: {key} is forbidden ({fix})")
    if schema.get("nullable") and "enum" in schema:
        problems.append(f"{where}: a nullable enum refuses null; drop nullable so nulls prune")
    if schema.get("type") == "null":
        problems.append(f"{where}: type null is forbidden (use nullable: true)")
    free = schema.get("x-kubernetes-preserve-unknown-fields")
    if free is not None and free is not True:
        problems.append(f"{where}: x-kubernetes-preserve-unknown-fields must be true or absent")
    if "type" not in schema and not schema.get("x-kubernetes-int-or-string") and not free:
        problems.append(f"{where}: every node needs a type")
    if "properties" in schema and schema.get("additionalProperties") not in (None, True):
        problems.append(f"{where}: properties and additionalProperties are mutually exclusive")
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if bound in schema and not isinstance(schema[bound], bool):
            problems.append(f"{where}: {bound} must be a boolean in OpenAPI v3")
    if isinstance(schema.get("items"), list):
        problems.append(f"{where}: items must be one schema, not a list")
    if schema.get("x-kubernetes-list-type") == "map" and not schema.get(
        "x-kubernetes-list-map-keys"
    ):
        problems.append(f"{where}: list-type map needs x-kubernetes-list-map-keys")
    for junctor in _JUNCTORS:
        branches = schema.get(junctor)
        if branches is None:
            continue
        for branch in branches if isinstance(branches, list) else [branches]:
            for key in ("type", "default", "description", "additionalProperties", "nullable"):
                if key in branch:
                    problems.append(f"{where}: {key} is forbidden inside {junctor}")
    for name, sub in (schema.get("properties") or {}).items():
        child = f"{path}.{name}" if path else name
        if path and path != "metadata" and not sub.get("description"):
            problems.append(f"{child}: has no description (kubectl explain shows nothing)")
        problems += lint(sub, child)
    if isinstance(schema.get("items"), dict):
        problems += lint(schema["items"], f"{path}[]")
    ap = schema.get("additionalProperties")
    if isinstance(ap, dict):
        problems += lint(ap, f"{path}{{}}")
    return problems
