"""Events the handlers post: the drift loop is a task of kvtier's own, outside kopf's
per-object processing, where kopf has no event queue; posting there must not fail the
repair (make demo showed a traceback per drift round)."""

from __future__ import annotations

import logging

from kvtier_operator import handlers
from kvtier_operator.api.v1alpha1 import TieredPrefixCacheStatus
from kvtier_operator.reconcile import Outcome


def test_events_outside_kopfs_processing_are_logged_not_raised(caplog):
    outcome = Outcome(status=TieredPrefixCacheStatus(),
                      events=[("Warning", "DeprecatedField", "spec.storage.stagingSize")])
    body = {"metadata": {"namespace": "llm-d", "name": "c"}}
    with caplog.at_level(logging.INFO, logger="kvtier_operator"):
        handlers._post(body, outcome)  # no kopf context here, as in the drift loop
    assert "llm-d/c Warning DeprecatedField: spec.storage.stagingSize" in caplog.text
