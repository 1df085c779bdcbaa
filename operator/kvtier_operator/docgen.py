"""docs/reference.md, generated from the models (`make docs`; a test fails when stale)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvtier_operator.api.quantity import CR_MESSAGE
from kvtier_operator.api.rules import CR_NAME_MAX
from kvtier_operator.crd import openapi_schema


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "quantity"
    if node.get("type") == "array":
        return f"[]{_type(node.get('items') or {})}"
    if node.get("type") == "object" and "additionalProperties" in node:
        return "map[string]string"
    return str(node.get("type", "object"))


def _rules(node: dict[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for key, text in (("minimum", ">="), ("maximum", "<=")):
        if key in node:
            exclusive = node.get(f"exclusive{key[:3].capitalize()}imum")
            parts.append(f"{text.replace('=', '') if exclusive else text} {node[key]}")
    if "multipleOf" in node:
        parts.append(f"multiple of {node['multipleOf']}")
    if "maxLength" in node and not node.get("x-kubernetes-int-or-string"):
        parts.append(f"at most {node['maxLength']} character(s)")
    if "minLength" in node:
        parts.append(f"at least {node['minLength']} character(s)")
    if "minItems" in node:
        parts.append(f"at least {node['minItems']} item(s)")
    if node.get("x-kubernetes-int-or-string"):
        parts = [f"a positive Kubernetes quantity (e.g. `100Gi`); {CR_MESSAGE.split(', with ')[1]}"]
    elif "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    parts += [("refused if it " if rule["rule"].startswith("!") else "") + rule["message"]
              for rule in node.get("x-kubernetes-validations", [])
              if node.get("type") != "object"]
    return "; ".join(parts)


def _walk(node: dict[str, Any], path: str, required: set[str], rows: list[str],
          checks: list[str]) -> None:
    for rule in node.get("x-kubernetes-validations", []) if node.get("properties") else []:
        checks.append(f"- `{path}`: {rule['message']}")
    for name, sub in (node.get("properties") or {}).items():
        child = f"{path}.{name}"
        default = f"`{sub['default']}`" if "default" in sub else ("required" if name in required
                                                                  else "")
        description = " ".join(sub.get("description", "").split())
        rows.append(f"| `{child}` | {_type(sub)} | {default} | {description} | {_rules(sub)} |")
        target = sub.get("items") if sub.get("type") == "array" else sub
        if isinstance(target, dict) and target.get("properties"):
            suffix = "[]" if sub.get("type") == "array" else ""
            _walk(target, child + suffix, set(target.get("required", [])), rows, checks)


def reference() -> str:
    schema = openapi_schema()
    out = ["# TieredPrefixCache reference (kvtier.dev/v1alpha1)", "",
           "Generated from `operator/kvtier_operator/api/v1alpha1/` by `make docs`; do not edit.",
           "`kubectl explain tpc.spec` shows the same descriptions. Short name: `tpc`.", ""]
    for section in ("spec", "status"):
        node = schema["properties"][section]
        rows: list[str] = []
        checks: list[str] = []
        _walk(node, section, set(node.get("required", [])), rows, checks)
        out += [f"## {section}", "", node.get("description", ""), "",
                "| field | type | default | description | validation |",
                "|---|---|---|---|---|", *rows, ""]
        if checks:
            out += ["Cross-field rules the API server checks (CEL), with the message it "
                    "returns; the validating webhook and `kvtier render` check these and more "
                    "(see below):", "", *checks, ""]
    out += [
        "## Rules checked beyond the schema",
        "",
        "The validating webhook (and `kvtier render`, and the operator, which reports an "
        "`InvalidSpec` condition) also refuses, naming the field and the fix:",
        "",
        "- every rule in the table above, with the same message;",
        "- label keys in `selector.matchLabels` (a CRD cannot constrain map keys), and "
        "label-key prefixes longer than 253 characters;",
        "- an empty `selector`, or one that may select the same pods as another "
        "TieredPrefixCache in the namespace;",
        "- `pvc` together with `existingClaim`, or neither;",
        "- KV geometry that is incomplete, or `kvBytesPerToken` that disagrees with "
        "layers x kvHeads x headDim x 2 x dtype bytes;",
        "- `storage.backend` with `connector: lmcache`; `maxSizePerReplica` without it; "
        "`eviction.capacity: ClaimSize` with `existingClaim`;",
        "- an explicit empty `storageClassName`.",
        "",
        f"`metadata.name` must be a DNS-1123 subdomain of at most {CR_NAME_MAX} characters "
        "(the CRD says so too): kvtier names a CronJob `<name>-evictor`, capped at 52.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    target = Path(argv[0]) if argv else None
    text = reference()
    if target:
        target.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
