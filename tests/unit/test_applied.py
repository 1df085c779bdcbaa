"""The applied-fields record: removed fields leave, others' fields stay (SSA-like)."""

from __future__ import annotations

import json

from kvtier_operator import applied
from kvtier_operator.names import ANNOTATION_APPLIED_FIELDS
from tests.helpers import merge


def apply(live, render):
    """What the live object becomes after kvtier applies render (a merge patch, as the
    API server applies it), or live itself when the gateway would send nothing."""
    desired, tree = applied.with_record(render)
    gone = applied.removals(applied.recorded(live), tree, live)
    return merge(live, applied.merge(desired, gone))


def cronjob(**security):
    return {"kind": "CronJob", "metadata": {"name": "c", "labels": {"app": "kvtier"}},
            "spec": {"schedule": "* * * * *", "template": {"securityContext": {
                "runAsUser": 1, **security}, "containers": [{"name": "e", "args": ["a"]}]}}}


def test_a_field_no_longer_rendered_leaves_the_live_object():
    live = apply({}, cronjob(fsGroup=7, fsGroupChangePolicy="OnRootMismatch"))
    assert live["spec"]["template"]["securityContext"]["fsGroup"] == 7
    live = apply(live, cronjob())
    assert live["spec"]["template"]["securityContext"] == {"runAsUser": 1}


def test_fields_of_other_parties_stay():
    live = apply({}, cronjob(fsGroup=7))
    live["metadata"]["labels"]["team"] = "a"  # another controller's label
    live["metadata"].setdefault("annotations", {})["note"] = "x"
    live["spec"]["template"]["securityContext"]["supplementalGroups"] = [5]  # a default
    live["spec"]["timeZone"] = "UTC"
    live = apply(live, cronjob())
    assert live["metadata"]["labels"] == {"app": "kvtier", "team": "a"}
    assert live["metadata"]["annotations"]["note"] == "x"
    assert live["spec"]["template"]["securityContext"] == {"runAsUser": 1,
                                                          "supplementalGroups": [5]}
    assert live["spec"]["timeZone"] == "UTC"


def test_a_removed_map_goes_whole_unless_someone_else_wrote_into_it():
    with_env = merge(cronjob(), {"spec": {"extra": {"a": 1}, "shared": {"b": 2}}})
    live = apply({}, with_env)
    live["spec"]["shared"]["theirs"] = 3
    live = apply(live, cronjob())
    assert "extra" not in live["spec"]
    assert live["spec"]["shared"] == {"theirs": 3}


def test_the_record_holds_the_paths_kvtier_wrote():
    desired, tree = applied.with_record(cronjob(fsGroup=7))
    record = json.loads(desired["metadata"]["annotations"][ANNOTATION_APPLIED_FIELDS])
    assert record == tree
    assert record["spec"]["template"]["securityContext"] == {"runAsUser": {}, "fsGroup": {}}
    assert record["spec"]["template"]["containers"] == {}  # lists are atomic


def test_an_unreadable_or_missing_record_removes_nothing():
    live = cronjob(fsGroup=7)
    assert applied.recorded(live) == {}
    live["metadata"]["annotations"] = {ANNOTATION_APPLIED_FIELDS: "{not json"}
    assert applied.recorded(live) == {}
    live["metadata"]["annotations"] = {ANNOTATION_APPLIED_FIELDS: '{"a": 1}'}
    assert applied.recorded(live) == {}
    after = apply(live, cronjob())
    assert after["spec"]["template"]["securityContext"]["fsGroup"] == 7  # kept this once
    assert "fsGroup" not in apply(apply(after, cronjob(fsGroup=8)), cronjob())["spec"][
        "template"]["securityContext"]
