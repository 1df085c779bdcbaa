"""Whether two selectors can pick the same pod: the validating webhook's overlap rule."""

from __future__ import annotations

import pytest

from kvtier_operator.api.v1alpha1 import LabelSelector
from kvtier_operator.webhook import selectors_may_overlap


def sel(labels=None, *exprs):
    """A selector needs one equality term (N6); where a case has none, both sides share
    `app: vllm`, which changes no overlap answer."""
    if not labels and not any(op == "In" for _, op, _ in exprs):
        labels = {"app": "vllm"}
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


def test_a_selector_is_bounded_in_size():
    from kvtier_operator.api.v1alpha1 import MAX_SELECTOR_TERMS, MAX_SELECTOR_VALUES

    too_many = [("k", "NotIn", [f"v{i}"]) for i in range(MAX_SELECTOR_TERMS + 1)]
    with pytest.raises(ValueError, match="at most"):
        sel(None, *too_many)
    with pytest.raises(ValueError, match="at most"):
        sel(None, ("k", "NotIn", [f"v{i}" for i in range(MAX_SELECTOR_VALUES + 1)]))


def test_the_overlap_check_stays_cheap_at_its_bounds():
    """The largest selectors the model allows, all on one key, against many other caches:
    building the rules is linear (a review found NotIn sets rebuilt per expression)."""
    import time

    from kvtier_operator.admission import rules_may_overlap, selector_rules
    from kvtier_operator.api.v1alpha1 import MAX_SELECTOR_TERMS, MAX_SELECTOR_VALUES

    big = sel(None, *[("k", "NotIn", [f"v{t}-{i}" for i in range(MAX_SELECTOR_VALUES)])
                      for t in range(MAX_SELECTOR_TERMS)])
    others = [sel(None, ("k", "In", [f"x{j}"])) for j in range(100)]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        mine = selector_rules(big)
        assert all(rules_may_overlap(mine, selector_rules(o)) for o in others)
        best = min(best, time.perf_counter() - start)
    assert best < 0.05, f"{best * 1000:.1f} ms"
