"""Reading TieredPrefixCache documents and turning validation errors into field messages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import ValidationError

from kvtier_operator import KIND
from kvtier_operator.models import TieredPrefixCache


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


def parse_tpc(doc: dict[str, Any]) -> TieredPrefixCache:
    name = str(((doc or {}).get("metadata") or {}).get("name", "<unnamed>"))
    try:
        return TieredPrefixCache.model_validate(doc)
    except ValidationError as err:
        raise InvalidResource(name, error_messages(err)) from None


def load_documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def split_tpcs(docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(TieredPrefixCache documents, everything else)."""
    tpcs = [d for d in docs if d.get("kind") == KIND]
    return tpcs, [d for d in docs if d.get("kind") != KIND]
