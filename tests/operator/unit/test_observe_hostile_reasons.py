"""Reason labels a pod puts on kvtier's dropped-write and skip series reach status and
advice only as the backend's known reasons, the rest counted as "other", and no advice
message grows without bound (#32 review)."""

from __future__ import annotations

from kvtier_operator.engines.vllm.metrics import FAMILIES, read
from kvtier_operator.observe.page import parse
from kvtier_operator.status import MAX_MESSAGE, observed_tiers
from tests.operator.unit.test_observe_file_tiers import kvtier_tpc, offloaded, summed


def _page(reasons: dict[str, float], family: str = "kvtier_offload_dropped_writes") -> str:
    lines = [f"# TYPE {family} counter"]
    lines += [f'{family}_total{{tier="storage",reason="{r}"}} {v}' for r, v in reasons.items()]
    lines += ['kvtier_offload_operations_total{tier="storage",direction="store",outcome="ok"} '
              "100"]
    return "\n".join(lines) + "\n"


def test_unknown_drop_reasons_fold_into_other():
    hostile = {f"{'r' * 300}{i}": 1.0 for i in range(500)}
    p = parse(_page({"queue-full": 7.0, "free-space-floor": 3.0, **hostile}), 20000, FAMILIES)
    assert p.problem is None
    f = read(p.samples, ("cpu", "storage"))
    reasons = {k[0]: v for k, v in f.counters.items() if k[0].startswith("dropped_writes:")}
    assert reasons == {"dropped_writes:queue-full": 7.0, "dropped_writes:free-space-floor": 3.0,
                       "dropped_writes:other": 500.0}
    assert f.counters[("dropped_writes", "storage")] == 510.0


def test_unknown_skip_reasons_fold_into_other():
    p = parse(_page({"lookup-wait": 2.0, "x" * 200: 5.0}, "kvtier_offload_tier_skipped"),
              20000, FAMILIES)
    f = read(p.samples, ("cpu", "storage"))
    reasons = {k[0]: v for k, v in f.counters.items() if k[0].startswith("skipped_requests:")}
    assert reasons == {"skipped_requests:lookup-wait": 2.0, "skipped_requests:other": 5.0}


def test_advice_messages_are_bounded_whatever_the_figures():
    tpc = kvtier_tpc()
    c = {("prompt_tokens", ""): 400.0, ("recomputed_tokens", ""): 400.0,
         ("dropped_writes", "storage"): 5000.0, ("stores", "storage"): 5000.0}
    for i in range(5000):
        c[(f"dropped_writes:{'x' * 300}{i}", "storage")] = 1.0
    out = observed_tiers(tpc, offloaded(tpc), summed(c), None, enabled=True)
    assert out.advice.reason == "WritesDropped"
    assert len(out.advice.message) <= MAX_MESSAGE


def test_the_known_reasons_are_the_backend_s():
    """The reader keeps its own copy (it may not import the backend): the same set."""
    import re
    from pathlib import Path

    from kvtier_offload import recompute_bound
    from kvtier_operator.engines.vllm.metrics import DROP_REASONS, SKIP_REASONS

    src = Path(recompute_bound.__file__).parent
    labelled = set()
    for path in src.glob("*.py"):
        text = path.read_text()
        labelled |= set(re.findall(r'dropped\.labels\("([^"]+)"\)', text))
    admission = (src / "write_admission.py").read_text()
    late = admission[admission.index("def late"):admission.index("def ", admission.index(
        "def late") + 4)]
    labelled |= set(re.findall(r'return "([^"]+)"', late))
    assert labelled == DROP_REASONS
    assert {recompute_bound.LOOKUP_WAIT, recompute_bound.LOAD_SLOWER} == SKIP_REASONS
