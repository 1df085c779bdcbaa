"""Whether two selectors can pick the same pod: the validating webhook's overlap rule."""

from __future__ import annotations

import pytest

from kvtier_operator.models import LabelSelector
from kvtier_operator.webhook import selectors_may_overlap


def sel(labels=None, *exprs):
    return LabelSelector.model_validate({
        "matchLabels": labels,
        "matchExpressions": [{"key": k, "operator": op, **({"values": v} if v else {})}
                             for k, op, v in exprs] or None})


@pytest.mark.parametrize(("a", "b", "overlap"), [
    (sel({"role": "decode"}), sel({"role": "decode"}), True),
    (sel({"role": "decode"}), sel({"role": "prefill"}), False),
    (sel({"role": "decode"}), sel({"model": "qwen"}), True),  # a pod may carry both
    (sel({"role": "decode"}), sel(None, ("role", "In", ["decode", "x"])), True),
    (sel({"role": "decode"}), sel(None, ("role", "In", ["prefill"])), False),
    (sel({"role": "decode"}), sel(None, ("role", "NotIn", ["decode"])), False),
    (sel({"role": "decode"}), sel(None, ("role", "NotIn", ["prefill"])), True),
    (sel({"role": "decode"}), sel(None, ("role", "DoesNotExist", None)), False),
    (sel(None, ("role", "Exists", None)), sel(None, ("role", "DoesNotExist", None)), False),
    (sel(None, ("role", "NotIn", ["a"])), sel(None, ("role", "DoesNotExist", None)), True),
    (sel(None, ("role", "In", ["a", "b"])), sel(None, ("role", "In", ["b", "c"])), True),
    (sel(None, ("role", "In", ["a", "b"])), sel(None, ("role", "In", ["c"])), False),
    (sel(None, ("role", "In", ["a", "b"])), sel(None, ("role", "NotIn", ["a", "b"])), False),
    (sel(None, ("tier", "Exists", None)), sel({"role": "x"}), True),
])
def test_overlap(a, b, overlap):
    assert selectors_may_overlap(a, b) is overlap
    assert selectors_may_overlap(b, a) is overlap
