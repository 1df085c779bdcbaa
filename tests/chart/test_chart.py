"""The Helm chart, rendered by the real helm binary (make test unpacks it into .tools/)."""

from __future__ import annotations

import base64
import subprocess

import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from kvtier_operator import __version__
from tests.helpers import ROOT

HELM = ROOT / ".tools" / "helm"
CHART = ROOT / "charts" / "kvtier"
K8S = kubernetes_validate.latest_version()
NOT_CORE = {"Certificate", "Issuer", "ServiceMonitor"}  # CRDs of cert-manager / prometheus
pytestmark = [pytest.mark.helm,
              pytest.mark.skipif(not HELM.exists(), reason="run `make test` to unpack helm")]


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=False)


def render(*sets: str) -> list[dict]:
    args = ["template", "rel", str(CHART), "-n", "kvtier-system"]
    for s in sets:
        args += ["--set", s]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_lint_strict():
    result = helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


VALUE_SETS = {
    "default": (),
    "cert-manager + monitoring": ("webhook.certManager.enabled=true",
                                  "metrics.serviceMonitor.enabled=true",
                                  "networkPolicy.enabled=true"),
    "custom": ("image.tag=1.2.3", "offloadImage.tag=1.2.3", "watchNamespaces={ml,serving}",
               "webhook.certManager.enabled=true",
               "webhook.certManager.issuerRef.name=corp-ca",
               "webhook.certManager.issuerRef.kind=ClusterIssuer", "logFormat=text"),
}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid(name):
    objs = render(*VALUE_SETS[name])
    for obj in objs:
        if obj["kind"] in NOT_CORE:
            assert obj["apiVersion"] in ("cert-manager.io/v1", "monitoring.coreos.com/v1")
            continue
        kubernetes_validate.validate(obj, K8S, strict=True)
    kinds = {o["kind"] for o in objs}
    rbac = {"Role", "RoleBinding"} if "watchNamespaces" in " ".join(VALUE_SETS[name]) \
        else {"ClusterRole", "ClusterRoleBinding"}
    assert {"Deployment", "ServiceAccount", "Service", "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration", "ValidatingAdmissionPolicy", *rbac} <= kinds


def test_operator_deployment_is_locked_down():
    (dep,) = by_kind(render(), "Deployment")
    spec = dep["spec"]
    assert spec["strategy"]["type"] == "Recreate" and spec["replicas"] == 1
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
    assert c["image"] == f"ghcr.io/kvtier/kvtier-operator:{__version__}"  # appVersion
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["KVTIER_OFFLOAD_IMAGE"] == f"ghcr.io/kvtier/kvtier-offload:{__version__}"
    assert c["resources"]["limits"]["memory"]
    assert "--webhook-port=9443" in c["args"]


@pytest.mark.parametrize("values, image", [
    (("offloadImage.tag=1.2.3",), "ghcr.io/kvtier/kvtier-offload:1.2.3"),
    # sidecarImage: the value's name before 0.2, still read, overriding offloadImage
    (("sidecarImage.tag=0.9.0",), "ghcr.io/kvtier/kvtier-offload:0.9.0"),
    (("sidecarImage.repository=reg/off", "sidecarImage.tag=v2"), "reg/off:v2"),
])
def test_the_offload_image_value_and_its_deprecated_name(values, image):
    (dep,) = by_kind(render(*values), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in c["env"]}["KVTIER_OFFLOAD_IMAGE"] == image


def test_webhooks_are_scoped_and_fail_the_right_way():
    objs = render()
    (mutating,) = by_kind(objs, "MutatingWebhookConfiguration")
    (validating,) = by_kind(objs, "ValidatingWebhookConfiguration")
    (pods,) = mutating["webhooks"]
    assert pods["failurePolicy"] == "Ignore" and pods["timeoutSeconds"] <= 5
    assert pods["rules"][0]["resources"] == ["pods"] and pods["rules"][0]["operations"] == ["CREATE"]
    assert pods["namespaceSelector"] == {"matchLabels": {"kvtier.dev/injection": "enabled"}}
    assert pods["objectSelector"]["matchExpressions"][0]["key"] == "kvtier.dev/inject"
    assert pods["clientConfig"]["service"]["path"] == "/mutate-pods"
    (tpc,) = validating["webhooks"]
    assert tpc["failurePolicy"] == "Fail"
    assert tpc["clientConfig"]["service"]["path"] == "/validate-tieredprefixcaches"
    from kvtier_operator.webhook import MUTATE_PATH, VALIDATE_PATH

    assert (MUTATE_PATH, VALIDATE_PATH) == ("/mutate-pods", "/validate-tieredprefixcaches")


def test_generated_ca_signed_the_serving_certificate():
    objs = render()
    (secret,) = [o for o in by_kind(objs, "Secret") if o["type"] == "kubernetes.io/tls"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "rel-kvtier-webhook.kvtier-system.svc" in names.get_values_for_type(x509.DNSName)
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (cfg,) = by_kind(objs, kind)
        assert cfg["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]


def test_cert_manager_mode_injects_the_ca():
    objs = render("webhook.certManager.enabled=true")
    assert by_kind(objs, "Certificate") and by_kind(objs, "Issuer")
    assert not [o for o in by_kind(objs, "Secret") if o["type"] == "kubernetes.io/tls"]
    (cfg,) = by_kind(objs, "MutatingWebhookConfiguration")
    assert cfg["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        "kvtier-system/rel-kvtier-webhook"
    assert "caBundle" not in cfg["webhooks"][0]["clientConfig"]


@pytest.mark.parametrize(("values", "allowed"), [
    ((), ""), (("localDisk.allowedHostPaths={/mnt/nvme,/data/ssd}",), "/mnt/nvme,/data/ssd")])
def test_the_allowed_host_paths_reach_the_operator(values, allowed):
    from kvtier_operator.app import config_from_env

    (dep,) = by_kind(render(*values), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["KVTIER_ALLOWED_HOST_PATHS"] == allowed
    assert ",".join(config_from_env(env).render.allowed_host_paths) == allowed


@pytest.mark.parametrize(("value", "message"), [
    ("webhook.timeoutSeconds=30", "at '/webhook/timeoutSeconds': maximum: got 30, want 5"),
    ("logFormat=xml", "at '/logFormat'"),
    ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ("driftIntervalSeconds=0", "at '/driftIntervalSeconds'"),
    ("webhook.timeoutSecond=3", "additional properties 'timeoutSecond' not allowed"),
    ("podSecurityContext.runAsNonRoot=false", "at '/podSecurityContext/runAsNonRoot'"),
    ("watchNamespaces={Bad_Name}", "at '/watchNamespaces/0'"),
    ("localDisk.allowedHostPaths={mnt/nvme}", "at '/localDisk/allowedHostPaths/0'"),
    ("localDisk.allowedHostPaths={/mnt/../etc}", "at '/localDisk/allowedHostPaths/0'"),
])
def test_bad_values_are_rejected_with_the_field(value, message):
    result = helm("template", "rel", str(CHART), "--set", value)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_chart_crd_is_the_generated_one():
    chart_crd = (CHART / "crds" / "tieredprefixcaches.kvtier.dev.yaml").read_text()
    assert chart_crd == (ROOT / "crds" / "tieredprefixcaches.kvtier.dev.yaml").read_text(), \
        "charts/kvtier/crds is stale: run `make crds`"


def test_dashboard_queries_only_metrics_that_exist():
    import json
    import re

    dashboard = json.loads((CHART / "dashboards" / "kvtier.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r.get("repeat") for r in rows] == ["tier"]  # a row per tier (#32)
    used = {m for e in exprs for m in re.findall(r"\b(kvtier_[a-z0-9_]+)", e)}
    sources = "".join(p.read_text() for p in (ROOT / "operator").rglob("metrics.py")) + \
        "".join(p.read_text() for p in (ROOT / "offload").rglob("metrics.py"))
    declared = set(re.findall(r'"(kvtier_[a-z0-9_]+)"', sources))
    exported = declared | {f"{m}_total" for m in declared} | {f"{m}_bucket" for m in declared}
    assert used and used <= exported, sorted(used - exported)
    objs = render("grafana.dashboard.enabled=true")
    (cm,) = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("dashboard")]
    assert json.loads(cm["data"]["kvtier.json"]) == dashboard
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_the_prometheus_url_value_reaches_the_observer_s_reads():
    """observe.prometheusURL (Helm values) -> the Deployment's env -> the settings the
    operator starts with (app.observe_settings) -> the reads (ReadSettings): read from
    that Prometheus. Unset: the env is absent and the pods are read."""
    from kvtier_operator.app import observe_settings

    def settings(*sets: str):
        (deployment,) = by_kind(render(*sets), "Deployment")
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        return observe_settings({e["name"]: e["value"] for e in c["env"]})

    url = "http://prometheus-operated.monitoring:9090"
    assert settings(f"observe.prometheusURL={url}").reads.prometheus_url == url
    assert settings().reads.prometheus_url is None
    refused = helm("template", "rel", str(CHART), "--set", "observe.prometheusURL=prom:9090")
    assert refused.returncode != 0 and "prometheusURL" in refused.stderr
