"""Server-side apply, emulated for API servers that lack it: kmock 0.8 (the in-process
API server of `make demo` and the integration tests) treats every PATCH body as a JSON
merge patch, and the unit tests' in-memory gateway has no server at all.

The operator applies the objects it owns with server-side apply (gateway.Gateway.apply:
`application/apply-patch+yaml`, a field manager, force). This module reproduces the part
of it kvtier relies on, for those test servers only (never for a real cluster): the
fields the manager applied are recorded in `metadata.managedFields` (an `Apply` entry,
`fieldsV1` with `f:` keys, as a real server writes them); applying a new configuration
merges it in and takes out every field of the previous one that the new one lacks, unless
someone else's fields are inside it; an apply that changes nothing writes nothing (the
resourceVersion stays, as on a real server). Lists are atomic, as in a merge patch.
"""

from __future__ import annotations

import copy
from typing import Any

Tree = dict[str, Any]  # {key: subtree}; an empty dict is a leaf


def field_tree(obj: dict[str, Any]) -> Tree:
    return {key: field_tree(value) if isinstance(value, dict) and value else {}
            for key, value in obj.items()}


def to_fields_v1(tree: Tree) -> dict[str, Any]:
    return {f"f:{key}": to_fields_v1(sub) for key, sub in tree.items()}


def from_fields_v1(fields: Any) -> Tree:
    if not isinstance(fields, dict):
        return {}
    return {key[2:]: from_fields_v1(sub) for key, sub in fields.items()
            if isinstance(key, str) and key.startswith("f:")}


def applied_tree(live: dict[str, Any], manager: str) -> Tree:
    """The fields `manager` applied to live, from its Apply entry in managedFields."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply" \
                and not entry.get("subresource"):
            return from_fields_v1(entry.get("fieldsV1"))
    return {}


def _has_others(ours: Tree, live: Any) -> bool:
    if not isinstance(live, dict) or not ours:
        return False
    return any(key not in ours or _has_others(ours[key], value) for key, value in live.items())


def removals(previous: Tree, current: Tree, live: Any) -> dict[str, Any]:
    """A merge patch taking out of live every path of previous that current lacks (a map
    someone else also wrote into keeps their keys)."""
    live = live if isinstance(live, dict) else {}
    patch: dict[str, Any] = {}
    for key, old in previous.items():
        if key not in live:
            continue
        if key not in current:
            if not old or not _has_others(old, live[key]):
                patch[key] = None
            else:
                nested = removals(old, {}, live[key])
                if nested:
                    patch[key] = nested
        elif old and current[key]:
            nested = removals(old, current[key], live[key])
            if nested:
                patch[key] = nested
    return patch


def merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    meta = out.get("metadata") or {}
    meta.pop("managedFields", None)
    meta.pop("resourceVersion", None)
    return out


def apply(live: dict[str, Any] | None, config: dict[str, Any],
          manager: str) -> dict[str, Any] | None:
    """The object after `manager` applies `config` (force), or None when that changes
    nothing. `live`: the stored object, None when there is none."""
    base = live or {}
    tree = field_tree(_content(config))
    gone = removals(applied_tree(base, manager), tree, base)
    result = merge(merge(base, _content(config)), gone)
    entry = {"manager": manager, "operation": "Apply", "apiVersion": config.get("apiVersion"),
             "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(tree)}
    others = [e for e in (base.get("metadata") or {}).get("managedFields") or []
              if not (e.get("manager") == manager and e.get("operation") == "Apply"
                      and not e.get("subresource"))]
    managed = [*others, entry]
    if live is not None and _content(result) == _content(live) and \
            (live.get("metadata") or {}).get("managedFields") == managed:
        return None
    meta = result.setdefault("metadata", {})
    meta["managedFields"] = managed
    meta["resourceVersion"] = str(int(str(base.get("metadata", {}).get("resourceVersion")
                                          or 0)) + 1)
    return result


def as_merge_patch(live: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """A merge patch that turns live into result (for servers that merge-patch)."""
    if not isinstance(live, dict) or not isinstance(result, dict):
        return result
    patch: dict[str, Any] = {}
    for key in live.keys() - result.keys():
        patch[key] = None
    for key, value in result.items():
        if key not in live:
            patch[key] = value
        elif live[key] != value:
            patch[key] = as_merge_patch(live[key], value) if isinstance(value, dict) and \
                isinstance(live[key], dict) else value
    return patch
