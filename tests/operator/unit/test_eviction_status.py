"""status.lastEviction from the evictor's report: the BlockRemoved counters (#33) are
carried where the run published, and left out where it did not."""

from __future__ import annotations

from kvtier_evictor.report import EvictionReport
from kvtier_operator.observe import EvictorRun
from kvtier_operator.status import eviction_status


def run_with(report: EvictionReport) -> EvictorRun:
    return EvictorRun(namespace="ns", cache="c", pod="c-evictor-1", job="c-evictor",
                      finished_at="2026-11-27T05:00:00Z", exit_code=0, report=report,
                      problem=None)


def test_the_events_counters_reach_last_eviction():
    report = EvictionReport(outcome="freed", layout="kvtier", files_deleted=10,
                            events_published=7, events_dropped=2, events_ignored=1,
                            events_problem="dropped events: " + "x" * 2000)
    last, _ = eviction_status(run_with(report))
    assert last is not None
    assert (last.events_published, last.events_dropped, last.events_ignored) == (7, 2, 1)
    assert last.events_problem is not None and len(last.events_problem) == 500
    doc = last.model_dump(by_alias=True, exclude_none=True)
    assert doc["eventsPublished"] == 7 and doc["eventsDropped"] == 2


def test_a_run_that_published_nothing_shows_no_events():
    last, _ = eviction_status(run_with(EvictionReport(outcome="freed", layout="kvtier")))
    assert last is not None
    doc = last.model_dump(by_alias=True, exclude_none=True)
    assert not [k for k in doc if k.startswith("events")]
