"""One metrics page, parsed with prometheus_client's parser and bounded: the series kvtier
reads (engines' prefixes), at most `max_series` samples looked at, NaN and infinite values
kept as they are and counted: the readers' helpers (engines/figures.py) turn any sum
that touches one into an absent figure, never into a zero or a partial sum."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from urllib.parse import urlencode

from prometheus_client.parser import text_string_to_metric_families

from kvtier_operator.engines.figures import Labels

# The families any engine's reader looks at (engines/<engine>/metrics.py); the rest of a
# page (Python's process_*, HTTP histograms) is skipped without being kept.
PREFIXES = ("vllm:", "kvtier_offload_", "sglang:")


@dataclass
class Page:
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)
    series: int = 0  # samples looked at
    non_finite: int = 0  # NaN or infinite samples among those kept
    problem: str | None = None  # why the page could not be read (whole or in part)


_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@functools.lru_cache(maxsize=64)
def _sample_names(families: frozenset[str]) -> frozenset[str]:
    """Every name a sample line of one of families can start with (the family's own, and
    with each of _SUFFIXES): one set lookup a line instead of stripping suffixes."""
    return frozenset(family + suffix for family in families for suffix in ("", *_SUFFIXES))


def select(text: str, families: frozenset[str]) -> tuple[str, int]:
    """The lines of the families a reader reads (samples, HELP and TYPE), for the parser,
    and how many sample lines the whole page has. A page is mostly histograms nobody
    reads here; parsing only what is read keeps 1,000 pods under a fifth of a core."""
    names = _sample_names(families)
    kept, series = [], 0
    for line in text.splitlines():
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) >= 3 and words[1] in ("HELP", "TYPE") and \
                    _family(words[2]) in families:
                kept.append(line)
            continue
        if not line or line.isspace():
            continue
        series += 1
        # A sample's name ends at its labels' "{" or at the first blank, whichever first.
        brace, blank = line.find("{"), line.find(" ")
        end = blank if brace == -1 else brace if blank == -1 else min(brace, blank)
        if (line[:end] if end != -1 else line) in names:
            kept.append(line)
    return "\n".join(kept) + "\n", series


def parse(text: str, max_series: int, families: frozenset[str] | None = None) -> Page:
    """families: the metric families to read (None: every one with a kvtier prefix)."""
    page = Page()
    if families is not None:
        text, page.series = select(text, families)
        if page.series > max_series:
            page.problem = (f"more than {max_series} series on the page; read none "
                            "(raise observe.maxSeries if the page is genuine)")
            return page
    try:
        for family in text_string_to_metric_families(text):
            keep = family.name.startswith(PREFIXES)
            for sample in family.samples:
                if families is None:
                    page.series += 1
                if page.series > max_series:
                    page.problem = (f"more than {max_series} series on the page; read none "
                                    "(raise observe.maxSeries if the page is genuine)")
                    page.samples.clear()
                    return page
                if not keep:
                    continue
                if not math.isfinite(sample.value) and not sample.name.endswith("_bucket"):
                    page.non_finite += 1
                page.samples.setdefault(sample.name, []).append(
                    (dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError, KeyError) as err:
        page.problem = f"not Prometheus text: {str(err)[:120]}"
        page.samples.clear()
    return page


def prometheus_query_url(base: str, namespace: str, pod: str, families: frozenset[str]) -> str:
    """An instant query for one pod's series of the families a reader reads."""
    names = "|".join(sorted(re.escape(f) for f in families)) or ".+"
    query = (f'{{__name__=~"({names})({"|".join(_SUFFIXES)})?",'
             f'namespace="{_quote(namespace)}",pod="{_quote(pod)}"}}')
    return f"{base.rstrip('/')}/api/v1/query?{urlencode({'query': query})}"


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def from_prometheus(text: str, max_series: int) -> Page:
    """Prometheus's instant-query answer as a page: sample name -> (labels, value)."""
    page = Page()
    try:
        answer = json.loads(text)
        if answer.get("status") != "success":
            page.problem = f"Prometheus answered {str(answer.get('error'))[:120]}"
            return page
        result = answer["data"]["result"]
        if len(result) > max_series:
            page.problem = f"more than {max_series} series for the pod; read none"
            return page
        for series in result:
            labels = dict(series["metric"])
            name = labels.pop("__name__")
            value = float(series["value"][1])
            page.series += 1
            if not math.isfinite(value):
                page.non_finite += 1
            page.samples.setdefault(name, []).append((labels, value))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        page.problem = f"not a Prometheus query answer: {str(err)[:120]}"
        page.samples.clear()
    return page
