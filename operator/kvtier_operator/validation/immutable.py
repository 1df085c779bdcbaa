"""What a live TieredPrefixCache may not change: the engine, the connector and the shared
tier's storage backend.

They decide the file layout on the shared volume, which files the evictor counts and
deletes, and what the webhook injected into running pods: changing one on a live cache
leaves the old layout's files counting toward usage forever and old pods configured for
the old engine. One definition, two enforcers: `transition_rules()` for the CRD (CEL with
oldSelf, which the API server runs on updates only) and `changed_fields()` for the
validating webhook on UPDATE. Both compare effective values: an unset field equals its
default (the engine's and connector's model defaults; the backend its adapter's first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier_operator.engines.registry import ADAPTERS, DEFAULT_CONNECTOR, DEFAULT_ENGINE

FIX = "create a new TieredPrefixCache (and PVC) for another engine; delete this one"
# The default backend of each engine/connector pair that has storage backends.
_DEFAULT_BACKEND = {f"{a.engine}/{a.connector}": str(a.storage_backends[0])
                    for a in ADAPTERS if a.storage_backends}


def message(field: str) -> str:
    """The refusal naming `field` (e.g. spec.engine) and the fix."""
    return f"{field} cannot change on a live TieredPrefixCache: {FIX}"


# ------------------------------------------------------------------- CEL (on spec)


def _engine(var: str) -> str:
    return f"(has({var}.engine) ? {var}.engine : '{DEFAULT_ENGINE}')"


def _connector(var: str) -> str:
    return f"(has({var}.connector) ? {var}.connector : '{DEFAULT_CONNECTOR}')"


def _backend(var: str) -> str:
    pair = f"{_engine(var)} + '/' + {_connector(var)}"
    defaults = "{" + ", ".join(f"'{p}': '{b}'" for p, b in _DEFAULT_BACKEND.items()) + "}"
    return (f"(has({var}.storage.backend) ? {var}.storage.backend : "
            f"({pair} in {defaults} ? {defaults}[{pair}] : ''))")


def transition_rules() -> list[dict[str, str]]:
    """CEL transition rules on spec: the API server evaluates them on updates only."""
    return [
        {"rule": f"{_engine('self')} == {_engine('oldSelf')}", "message": message("spec.engine")},
        {"rule": f"{_connector('self')} == {_connector('oldSelf')}",
         "message": message("spec.connector")},
        # The backend is compared where both old and new have a shared tier.
        {"rule": "!has(self.storage) || !has(oldSelf.storage) || "
                 f"{_backend('self')} == {_backend('oldSelf')}",
         "message": message("spec.storage.backend")},
    ]


# ------------------------------------------------------------------- the webhook


def _text(value: Any, default: str) -> str:
    return value if isinstance(value, str) and value else default


def _effective(spec: Mapping[str, Any]) -> dict[str, str | None]:
    engine = _text(spec.get("engine"), DEFAULT_ENGINE)
    connector = _text(spec.get("connector"), DEFAULT_CONNECTOR)
    storage = spec.get("storage")
    backend = None
    if isinstance(storage, Mapping):
        backend = _text(storage.get("backend"), _DEFAULT_BACKEND.get(f"{engine}/{connector}", ""))
    return {"engine": engine, "connector": connector, "storage.backend": backend}


def changed_fields(old_spec: Any, new_spec: Any) -> list[str]:
    """The immutable fields (spec.engine, ...) that differ between two raw specs, as the
    CEL rules see them (raw dicts: an old object stored by an older kvtier may not parse)."""
    if not isinstance(old_spec, Mapping) or not isinstance(new_spec, Mapping):
        return []
    old, new = _effective(old_spec), _effective(new_spec)
    return [f"spec.{f}" for f in old
            if old[f] != new[f] and not (f == "storage.backend" and None in (old[f], new[f]))]
