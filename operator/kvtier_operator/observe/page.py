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


def parse(text: str, max_series: int) -> Page:
    page = Page()
    try:
        for family in text_string_to_metric_families(text):
            keep = family.name.startswith(PREFIXES)
            for sample in family.samples:
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
