"""No cross-namespace existence oracle (audit v2, N7): a reference into another namespace
(spec.mooncake.masterService.namespace) is looked up only where the install allows it;
elsewhere the cache's status reads the same whether the object exists or not, and the
operator makes no call there."""

from __future__ import annotations

from kvtier_operator.reconcile import check_prerequisites
from kvtier_operator.validation import parse_tpc
from tests.helpers import example

SERVICE = ("Service", "kube-secrets", "vault")


class RecordingGateway:
    def __init__(self, existing):
        self.existing, self.calls = existing, []

    def get(self, kind, namespace, name):
        self.calls.append((kind, namespace, name))
        if (kind, namespace, name) in self.existing:
            return {"data": {"mooncake_config.json": "{}"}}
        return None


def cache():
    doc = example("mooncake-store.yaml")
    doc["spec"]["mooncake"]["masterService"] = {"name": "vault", "namespace": "kube-secrets"}
    return parse_tpc(doc)


def test_another_namespace_reads_the_same_whether_or_not_the_object_exists():
    tpc = cache()
    config_map = ("ConfigMap", tpc.namespace, "mooncake-store-config")
    answers = []
    for existing in ({config_map, SERVICE}, {config_map}):
        gw = RecordingGateway(existing)
        answers.append(check_prerequisites(tpc, gw))
        assert SERVICE not in gw.calls, "the operator looked into another namespace"
    assert answers[0] == answers[1]
    assert answers[0].status == "False" and answers[0].reason == "ReferenceNotAllowed"
    assert "spec.mooncake.masterService" in answers[0].message
    assert "referenceNamespaces" in answers[0].message


def test_an_allowed_namespace_is_looked_up():
    tpc = cache()
    config_map = ("ConfigMap", tpc.namespace, "mooncake-store-config")
    allowed = frozenset({"kube-secrets"})
    found = check_prerequisites(tpc, RecordingGateway({config_map, SERVICE}), allowed)
    absent = check_prerequisites(tpc, RecordingGateway({config_map}), allowed)
    assert found.reason == "Found"
    assert absent.reason == "PrerequisitesMissing" and "kube-secrets/vault" in absent.message


def test_the_cache_s_own_namespace_needs_no_allowance():
    doc = example("mooncake-store.yaml")
    doc["spec"]["mooncake"]["masterService"] = {"name": "master"}
    tpc = parse_tpc(doc)
    gw = RecordingGateway({("ConfigMap", tpc.namespace, "mooncake-store-config"),
                           ("Service", tpc.namespace, "master")})
    assert check_prerequisites(tpc, gw).reason == "Found"


def test_the_install_setting_reaches_the_operator():
    from kvtier_operator.app import config_from_env

    config = config_from_env({"KVTIER_REFERENCE_NAMESPACES": "mooncake, infra,"})
    assert config.reference_namespaces == frozenset({"mooncake", "infra"})
    assert config_from_env({}).reference_namespaces == frozenset()
