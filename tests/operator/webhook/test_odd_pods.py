"""Odd but parseable pods (audit v2, N9): explicit nulls are treated as absent, and a
quantity kvtier cannot read becomes a conflict naming the container's field. Neither
reaches the webhook's catch-all ("the webhook failed on this pod"), and neither logs a
traceback."""

from __future__ import annotations

import base64
import copy
import json

import jsonpatch
import pytest

from kvtier_operator.admission import MUTATE_PATH, admit
from kvtier_operator.webhook import CacheRegistry
from tests.operator.webhook.test_webhook import CTX, busy_pod, load_example, review


@pytest.fixture
def caches():
    registry = CacheRegistry()
    registry.observe("ADDED", load_example("native-kvtier.yaml"))
    return registry


def _admit(pod, caches):
    outcome = admit(MUTATE_PATH, json.dumps(review(pod)).encode(), caches, CTX)
    assert outcome.problem is None, outcome.problem  # the catch-all, with its traceback
    answer = json.loads(outcome.body)["response"]
    assert answer["allowed"] is True
    assert not any("the webhook failed" in w for w in answer.get("warnings", [])), answer
    return answer, outcome


def _patched(pod, answer):
    ops = json.loads(base64.b64decode(answer["patch"]))
    return jsonpatch.apply_patch(copy.deepcopy(pod), ops)


def _server(pod):
    return next(c for c in pod["spec"]["containers"] if c["name"] == "modelserver")


NULLS = {
    "resources": lambda p: _server(p).__setitem__("resources", None),
    "resources.requests": lambda p: _server(p).__setitem__("resources", {"requests": None}),
    "env": lambda p: _server(p).__setitem__("env", None),
    "volumeMounts": lambda p: _server(p).__setitem__("volumeMounts", None),
    "volumes": lambda p: p["spec"].__setitem__("volumes", None),
    "initContainers": lambda p: p["spec"].__setitem__("initContainers", None),
    "annotations": lambda p: p["metadata"].__setitem__("annotations", None),
}


@pytest.mark.parametrize("field", sorted(NULLS))
def test_an_explicit_null_is_treated_as_absent(caches, field):
    pod = busy_pod()
    NULLS[field](pod)
    answer, outcome = _admit(pod, caches)
    assert outcome.conflicts == (), outcome.conflicts
    server = _server(_patched(pod, answer))
    assert any(e["name"] == "PYTHONHASHSEED" for e in server["env"])
    assert server["resources"]["requests"]["memory"]  # the CPU tier was added


@pytest.mark.parametrize(("where", "value"), [
    ("requests", 2**63 - 1), ("limits", "9223372036854775807"), ("requests", "9Ei"), ("limits", "1e400000"),
    ("limits", "lots"), ("requests", 2**70),
])
def test_an_unreadable_memory_quantity_is_a_conflict_naming_the_field(caches, where, value):
    pod = busy_pod()
    _server(pod)["resources"] = {where: {"memory": value}}
    answer, outcome = _admit(pod, caches)
    assert "patch" not in answer
    reasons = [c.reason for c in outcome.conflicts]
    assert len(reasons) == 1, reasons
    assert f"container 'modelserver' resources.{where}.memory: " in reasons[0], reasons


def test_an_unreadable_shm_size_is_a_conflict_naming_the_volume(caches):
    pod = busy_pod()
    pod["spec"]["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                                "sizeLimit": "1e400000"}})
    _server(pod)["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    _, outcome = _admit(pod, caches)
    reasons = [c.reason for c in outcome.conflicts]
    assert any("volume 'dshm' sizeLimit" in r for r in reasons), reasons


def test_a_container_that_is_not_an_object_is_a_conflict(caches):
    pod = busy_pod()
    pod["spec"]["containers"].append(None)
    _, outcome = _admit(pod, caches)
    assert any("spec.containers holds NoneType" in c.reason for c in outcome.conflicts)


async def test_a_failure_logs_its_traceback_once_not_per_request(tmp_path, monkeypatch, caplog):
    """A bug reached by a request logs its traceback the first time; the same bug reached
    again (a client repeating a tiny body) adds one DEBUG line, not another traceback."""
    import logging

    from kvtier_operator import admission
    from tests.operator.webhook.test_hostile import start
    from tests.operator.webhook.test_webhook import minimal_pod

    def broken(*_):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(admission, "inject", broken)
    caplog.set_level(logging.DEBUG, logger="kvtier_operator.webhook")
    runner, hook = await start(tmp_path)
    try:
        hook.caches.observe("ADDED", load_example("native-kvtier.yaml"))
        for uid in ("u-1", "u-2", "u-3"):
            status, answer = await hook.post(MUTATE_PATH, review(minimal_pod(), uid=uid))
            assert status == 200 and answer["response"]["allowed"] is True
    finally:
        await runner.cleanup()
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1, len(tracebacks)
    again = [r for r in caplog.records if "failed again" in r.getMessage()]
    assert len(again) == 2 and all(r.levelno == logging.DEBUG for r in again)
