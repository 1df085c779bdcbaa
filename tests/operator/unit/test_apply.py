"""Server-side apply: the gateway sends an apply request for owned objects, hands over
once the fields older kvtier wrote with merge patches, and the test servers' emulation
(kvtier_demo/ssa.py: kmock 0.8 has no SSA) behaves as a real server does for what kvtier
relies on: removed fields leave, others' fields stay, an unchanged apply writes nothing."""

from __future__ import annotations

import copy

from kvtier_demo import ssa
from kvtier_operator.gateway import APPLY, FIELD_MANAGER, Gateway, handed_over
from kvtier_operator.names import ANNOTATION_APPLIED_FIELDS
from tests.helpers import merge


def cronjob(**security):
    return {"apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": {"name": "c", "namespace": "ml", "labels": {"app": "kvtier"}},
            "spec": {"schedule": "* * * * *", "template": {"securityContext": {
                "runAsUser": 1, **security}, "containers": [{"name": "e", "args": ["a"]}]}}}


def apply(live, render):
    return ssa.apply(live or None, render, FIELD_MANAGER) or live


# ------------------------------------------------------------ the emulation


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


def test_the_record_is_the_managers_apply_entry_and_an_unchanged_apply_writes_nothing():
    live = apply({}, cronjob(fsGroup=7))
    (entry,) = live["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"]) == (FIELD_MANAGER, "Apply")
    security = entry["fieldsV1"]["f:spec"]["f:template"]["f:securityContext"]
    assert security == {"f:runAsUser": {}, "f:fsGroup": {}}
    assert entry["fieldsV1"]["f:spec"]["f:template"]["f:containers"] == {}  # atomic lists
    assert ssa.apply(live, cronjob(fsGroup=7), FIELD_MANAGER) is None
    assert live["metadata"]["resourceVersion"] == "1"


# ------------------------------------------------------------- the hand-over


def merge_patched(**security):
    """A CronJob as kvtier before server-side apply left it: created and merge-patched as
    manager kvtier-operator (operation Update), its record in the annotation."""
    obj = cronjob(**security)
    obj["metadata"]["annotations"] = {ANNOTATION_APPLIED_FIELDS: '{"spec": {}}', "note": "x"}
    obj["metadata"]["resourceVersion"] = "41"
    obj["metadata"]["managedFields"] = [
        {"manager": FIELD_MANAGER, "operation": "Update", "apiVersion": "batch/v1",
         "fieldsType": "FieldsV1", "fieldsV1": ssa.to_fields_v1(ssa.field_tree({
             "metadata": {"labels": {"app": {}}, "annotations": {ANNOTATION_APPLIED_FIELDS: {}}},
             "spec": obj["spec"]}))},
        {"manager": "someone", "operation": "Update", "apiVersion": "batch/v1",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {"f:note": {}}}}},
        {"manager": FIELD_MANAGER, "operation": "Update", "subresource": "status",
         "fieldsV1": {"f:status": {}}},
    ]
    return obj


def test_the_hand_over_moves_the_update_entrys_fields_into_the_apply_entry():
    live = merge_patched(fsGroup=7)
    managed = handed_over(live)
    assert managed is not None
    ours = [e for e in managed if e["manager"] == FIELD_MANAGER and not e.get("subresource")]
    assert [e["operation"] for e in ours] == ["Apply"]
    fields = ours[0]["fieldsV1"]
    assert "f:fsGroup" in fields["f:spec"]["f:template"]["f:securityContext"]
    assert f"f:{ANNOTATION_APPLIED_FIELDS}" in fields["f:metadata"]["f:annotations"]
    # others' entries and our status subresource entry stay as they were
    assert [e["manager"] for e in managed if e not in ours] == ["someone", FIELD_MANAGER]
    handed = merge(live, {"metadata": {"managedFields": managed}})
    assert handed_over(handed) is None  # once


def test_after_the_hand_over_an_apply_drops_the_old_fields_and_the_annotation():
    live = merge(merge_patched(fsGroup=7), {})
    live["metadata"]["managedFields"] = handed_over(live)
    after = apply(live, cronjob())
    assert "fsGroup" not in after["spec"]["template"]["securityContext"]
    assert after["metadata"]["annotations"] == {"note": "x"}  # theirs stays


def test_nothing_to_hand_over_on_objects_kvtier_applied():
    assert handed_over(apply({}, cronjob())) is None
    assert handed_over(cronjob()) is None


def test_the_gateway_sends_server_side_apply_forced_as_its_field_manager():
    sent = {}

    class Api:
        def patch_namespaced_cron_job(self, name, namespace, body, **kwargs):
            sent.update(name=name, namespace=namespace, body=body, **kwargs)

            class Response:
                data = b'{"metadata": {"resourceVersion": "2"}}'
            return Response()

    gw = Gateway.__new__(Gateway)
    gw.retries, gw.backoff, gw.sleep = 0, 0.0, lambda _: None
    gw._ops = {"CronJob": (None, None, Api().patch_namespaced_cron_job, None)}
    gw.apply(copy.deepcopy(cronjob()))
    assert sent["_content_type"] == APPLY == "application/apply-patch+yaml"
    assert sent["field_manager"] == FIELD_MANAGER and sent["force"] is True
    assert sent["body"]["kind"] == "CronJob" and (sent["name"], sent["namespace"]) == ("c", "ml")
