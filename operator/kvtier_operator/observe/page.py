"""One metrics page, parsed with prometheus_client's parser and bounded: the series kvtier
reads (engines' prefixes), at most `max_series` samples looked at, NaN and infinite values
kept as they are and counted: the readers' helpers (engines/figures.py) turn any sum
that touches one into an absent figure, never into a zero or a partial sum."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


def select(text: str, families: frozenset[str]) -> tuple[str, int]:
    """The lines of the families a reader reads (samples, HELP and TYPE), for the parser,
    and how many sample lines the whole page has. A page is mostly histograms nobody
    reads here; parsing only what is read keeps 1,000 pods under a fifth of a core."""
    kept, series = [], 0
    for line in text.splitlines():
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) >= 3 and words[1] in ("HELP", "TYPE") and \
                    _family(words[2]) in families:
                kept.append(line)
            continue
        if not line.strip():
            continue
        series += 1
        end = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if at != -1:
                end = min(end, at)
        if _family(line[:end]) in families:
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
