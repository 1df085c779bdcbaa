"""Reading YAML documents and picking out the TieredPrefixCaches (validation/ parses them)."""

from __future__ import annotations

from typing import Any

import yaml

from kvtier_operator.api.group import KIND


def load_documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def split_tpcs(docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(TieredPrefixCache documents, everything else)."""
    tpcs = [d for d in docs if d.get("kind") == KIND]
    return tpcs, [d for d in docs if d.get("kind") != KIND]
