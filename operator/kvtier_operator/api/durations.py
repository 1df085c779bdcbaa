"""Go-style durations ("90s", "10m", "1h30m") as used across Kubernetes APIs."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+)(h|m|s)")
_WHOLE = re.compile(r"^(\d+(h|m|s))+$")
_UNIT = {"h": 3600, "m": 60, "s": 1}


def duration_seconds(text: str) -> int:
    if not isinstance(text, str) or not _WHOLE.match(text):
        raise ValueError(f"{text!r} is not a duration; write e.g. 90s, 10m or 1h30m")
    return sum(int(n) * _UNIT[u] for n, u in _PART.findall(text))
