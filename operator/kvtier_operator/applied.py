"""What kvtier last applied to an object it owns, so a field the renderer stops writing
leaves the live object, while fields other parties own stay.

This is the part of server-side apply's field ownership that kvtier needs, kept on the
object itself (as `kubectl apply` keeps its last-applied configuration): the annotation
kvtier.dev/applied-fields holds the tree of field paths kvtier wrote last time. Applying
a new render then merge-patches the render plus `null` for every path in the old tree
that the new render no longer has. Fields kvtier never wrote (a label someone else
added, what the API server defaults) are in neither tree, so they are never touched.

Lists are atomic, as in a JSON merge patch: kvtier owns a list it renders whole.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from kvtier_operator.names import ANNOTATION_APPLIED_FIELDS

log = logging.getLogger("kvtier_operator")

# A field tree: {key: subtree}; an empty dict is a leaf (a scalar, a list, or {}).
FieldTree = dict[str, Any]


def field_tree(obj: dict[str, Any]) -> FieldTree:
    """The paths of every leaf of obj, as a tree of dicts."""
    return {key: field_tree(value) if isinstance(value, dict) else {}
            for key, value in obj.items()}


def removals(previous: FieldTree, current: FieldTree, live: Any) -> dict[str, Any]:
    """A merge patch that takes out of live every path of previous that current lacks.
    As server-side apply does, a field kvtier no longer renders goes whole when nothing
    in it belongs to anyone else, else only the parts kvtier wrote go (a map another
    party also wrote into, such as the annotations, keeps their keys)."""
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


def _has_others(ours: FieldTree, live: Any) -> bool:
    """Whether live holds any field outside the tree ours."""
    if not isinstance(live, dict) or not ours:
        return False
    return any(key not in ours or _has_others(ours[key], value) for key, value in live.items())


def encode(tree: FieldTree) -> str:
    return json.dumps(tree, sort_keys=True, separators=(",", ":"))


def recorded(live: dict[str, Any]) -> FieldTree:
    """The tree kvtier recorded on live, or {} when there is none (an object from before
    the record existed) or it is unreadable (someone edited it): then nothing is removed
    this once, and the next apply records a good tree again."""
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED_FIELDS)
    if not text:
        return {}
    try:
        tree = json.loads(text)
    except ValueError:
        tree = None
    if not _is_tree(tree):
        meta = live.get("metadata") or {}
        log.warning("%s %s/%s: unreadable %s annotation; removed fields stay this once",
                    live.get("kind"), meta.get("namespace"), meta.get("name"),
                    ANNOTATION_APPLIED_FIELDS)
        return {}
    return dict(tree)


def _is_tree(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and _is_tree(v) for k, v in value.items())


def with_record(obj: dict[str, Any]) -> tuple[dict[str, Any], FieldTree]:
    """obj carrying the record of its own fields (obj itself must not carry one), and
    that tree."""
    tree = field_tree(obj)
    out = copy.deepcopy(obj)
    meta = out.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}),
                           ANNOTATION_APPLIED_FIELDS: encode(tree)}
    return out, tree


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """base with extra's keys merged in, recursively (extra's removals never collide with
    base's fields: a removed path is one the render no longer has)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
