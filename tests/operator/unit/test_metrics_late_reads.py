"""A pod the operator did not read this round because its own parse budget ran out is
not the pod's fault: MetricsReadable says so, without blaming the pod's port (#32 review)."""

from __future__ import annotations

from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.observe.reads import LATE
from kvtier_operator.observe.window import WindowSum
from kvtier_operator.status import observed_tiers
from tests.operator.unit.test_observe_file_tiers import kvtier_tpc, offloaded
from tests.operator.unit.test_reconcile import NOW


def _metrics(unreadable: int, late: int, problems: list[str]):
    tpc = kvtier_tpc()
    obs = CacheObservation(window=WindowSum(), pods_read=1, pods_unreadable=unreadable,
                           problems=problems, observed_at=NOW, reads=True,
                           pods_selected=1 + unreadable, pods_late=late)
    return observed_tiers(tpc, offloaded(tpc), obs, None, enabled=True).metrics


def test_reads_skipped_for_the_operator_s_budget_blame_no_pod():
    cond = _metrics(1, 1, [f"pod p: {LATE}"])
    assert cond.reason == "MetricsReadLate" and cond.status == "Unknown"
    assert "metrics port" not in cond.message and "1 of 2" in cond.message


def test_a_pod_that_gave_no_figures_is_still_named_beside_late_ones():
    cond = _metrics(2, 1, ["pod q: connection refused", f"pod p: {LATE}"])
    assert cond.reason == "MetricsUnreadable" and cond.status == "False"
    assert "1 of 3 pod(s) gave no figures" in cond.message
    assert "connection refused" in cond.message and LATE not in cond.message


def observed(*problems: str) -> CacheObservation:
    """The observer's snapshot of a cache whose pods' reads came back with `problems`."""
    import asyncio

    from kvtier_operator.engines.registry import adapter_for
    from kvtier_operator.observe.observer import CacheTargets, Observer, ObserveSettings, Target
    from kvtier_operator.observe.reads import ReadResult, pack

    class Reading:
        async def read(self, jobs, settings):
            return [pack(ReadResult(problem=p)) for p in problems]

    tpc = kvtier_tpc()
    observer = Observer(ObserveSettings(), reading=Reading())
    targets = CacheTargets("ml", "c", adapter_for(tpc.spec), offloaded(tpc), tuple(
        Target(f"p{i}", f"p{i}", f"http://p{i}/metrics") for i in range(len(problems))))
    asyncio.run(observer.observe([targets], NOW))
    obs = observer.snapshot("ml", "c")
    assert obs is not None
    return obs


def test_the_observer_counts_the_pods_it_read_late():
    obs = observed(LATE, "refused")
    assert (obs.pods_unreadable, obs.pods_late) == (2, 1)
