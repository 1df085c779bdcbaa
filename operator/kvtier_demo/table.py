"""`kubectl get tpc` and `-o wide`, as kubectl prints them from the CRD's printer columns (the
columns' JSONPaths: plain fields and one `[?(@.name=="x")]` filter, all kvtier uses)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from kvtier_operator.crd import PRINTER_COLUMNS

_STEP = re.compile(r'\.([A-Za-z]+)|\[\?\(@\.([A-Za-z]+)=="([^"]*)"\)\]')


def column_value(doc: Any, path: str) -> Any:
    value = doc
    for field, key, want in _STEP.findall(path):
        if value is None:
            return None
        if field:
            value = value.get(field) if isinstance(value, dict) else None
        else:
            value = next((x for x in value or [] if isinstance(x, dict)
                          and str(x.get(key)) == want), None)
    return value


def _age(stamp: str | None, now: datetime) -> str:
    if not stamp:
        return "<unknown>"
    seconds = int((now - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


def table(doc: dict[str, Any], wide: bool = False, now: datetime | None = None) -> str:
    """`kubectl get` (wide: `-o wide`, the columns of priority 1 too)."""
    now = now or datetime.now(UTC)
    header, row = ["NAME"], [doc["metadata"]["name"]]
    for column in PRINTER_COLUMNS:
        if column.get("priority", 0) and not wide:
            continue
        name, kind, path = str(column["name"]), column["type"], str(column["jsonPath"])
        header.append(name.upper())
        if kind == "date":
            row.append(_age(column_value(doc, path), now))
            continue
        value = column_value(doc, path)
        row.append("<none>" if value is None else str(value))
    widths = [max(len(h), len(v)) for h, v in zip(header, row, strict=True)]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                     .rstrip() for line in (header, row))
