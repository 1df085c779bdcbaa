"""Validation: a TieredPrefixCache body in, a checked resource out, or messages that name
the field and the fix.

`parse_tpc` is the one entry point (the webhook, reconcile, the cache registry, the CLI
and the demo call it): the API types' own, field-local checks (api/v1alpha1), then the
checks that need an engine's knowledge (engine_rules.check_spec). The same engine rules
become the CRD's CEL rules (engine_rules.spec_rules, immutable.transition_rules), so the
API server refuses what the webhook would.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.validation.engine_rules import check_spec


class InvalidResource(ValueError):
    """A TieredPrefixCache that fails validation; `messages` name field and fix."""

    def __init__(self, name: str, messages: list[str]) -> None:
        self.name = name
        self.messages = messages
        super().__init__(f"TieredPrefixCache {name}: " + "; ".join(messages))


def _loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def error_messages(err: ValidationError) -> list[str]:
    """'spec.eviction.lowWatermark: <what is wrong and the fix>' for each error."""
    messages = []
    for e in err.errors():
        # Skip pydantic's internal markers such as function-after[...] in locations.
        loc = [p for p in e["loc"] if not (isinstance(p, str) and "[" in p)]
        text = e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if e["type"] == "extra_forbidden":
            text = "unknown field; check its spelling against `kubectl explain tpc.spec`"
        elif e["type"] == "missing":
            text = "required field is missing"
        elif e["type"] == "literal_error" or e["type"] == "enum":
            text = f"{text} (got {e.get('input')!r})"
        messages.append(f"{_loc(loc) or '<root>'}: {text}")
    return messages


def deprecations(tpc: TieredPrefixCache) -> list[str]:
    """Fields set under a deprecated name (read as before): what to rename. The webhook
    returns them as warnings (kubectl prints them), the reconcile as Warning events."""
    return [f"{old} is deprecated: rename it {new} (the same setting)"
            for old, new in tpc.spec.deprecated_fields()]


def parse_tpc(doc: dict[str, Any]) -> TieredPrefixCache:
    name = str(((doc or {}).get("metadata") or {}).get("name", "<unnamed>"))
    try:
        tpc = TieredPrefixCache.model_validate(doc)
    except ValidationError as err:
        raise InvalidResource(name, error_messages(err)) from None
    try:
        check_spec(tpc.spec)
    except ValueError as err:
        # Worded as the spec's own refusals are ("spec: <what and the fix>").
        raise InvalidResource(name, [f"spec: {err}"]) from None
    return tpc

