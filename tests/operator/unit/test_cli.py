"""`kvtier render` and `kvtier crd`, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from kvtier_demo.samples import sample_workload
from kvtier_demo.sandbox import DEMO_OBJECT_ENDPOINTS
from kvtier_operator.cli import EXIT_CONFLICT, EXIT_INVALID, main
from tests.helpers import EXAMPLES, tpc_doc

CR_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*.yaml")
                     if yaml.safe_load(p.read_text())["kind"] == "TieredPrefixCache")
K8S = kubernetes_validate.latest_version()
# The sample workload each engine's examples are rendered into.


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier_operator.cli", *args],
                          capture_output=True, text=True, check=False)


def test_there_is_an_example_per_variant():
    assert len(CR_EXAMPLES) >= 10  # + TPU single/multi-host, Mooncake, KVBM


@pytest.mark.parametrize("name", CR_EXAMPLES)
def test_every_example_renders_valid_kubernetes_objects(name):
    workload = sample_workload(yaml.safe_load((EXAMPLES / name).read_text()))
    allow = [a for url in DEMO_OBJECT_ENDPOINTS for a in ("--allow-object-endpoint", url)]
    result = run("render", "-f", str(EXAMPLES / name), "--pod", str(EXAMPLES / workload),
                 *allow)
    assert result.returncode == 0, result.stderr
    objs = list(yaml.safe_load_all(result.stdout))
    if objs[-1]["kind"] == "LeaderWorkerSet":
        group = objs[-1]["spec"]["leaderWorkerTemplate"]
        templates = [group["leaderTemplate"], group["workerTemplate"]]
        for template in templates:  # no schema for the CRD kind: its pod templates
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": "t"}, "template": template},
                                         K8S, strict=True)
        objs = objs[:-1]
    else:
        assert objs[-1]["kind"] == "Deployment"
        templates = [objs[-1]["spec"]["template"]]
    for obj in objs:
        kubernetes_validate.validate(obj, K8S, strict=True)
    for template in templates:
        assert "kvtier.dev/config-hash" in template["metadata"]["annotations"]


def test_invalid_cr_exits_nonzero_with_field_messages(tmp_path):
    doc = tpc_doc({"eviction": {"lowWatermark": 90}, "storage": {"mountPath": "/etc"}})
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(doc))
    result = run("render", "-f", str(f))
    assert result.returncode == EXIT_INVALID
    assert "TieredPrefixCache cache is invalid" in result.stderr
    assert "spec.storage.mountPath: '/etc' would shadow" in result.stderr
    assert "spec.eviction: lowWatermark 90 must be below highWatermark 85" in result.stderr
    assert result.stdout == ""


def test_conflicting_pod_exits_with_conflict(tmp_path, capsys):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "vllm", "image": "x",
                                    "command": ["vllm", "serve", "m", "--kv-transfer-config",
                                                "{}"]}]}}
    (tmp_path / "pod.yaml").write_text(yaml.safe_dump(pod))
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(tpc_doc()))
    code = main(["render", "-f", str(tmp_path / "cr.yaml"), "--pod", str(tmp_path / "pod.yaml")])
    assert code == EXIT_CONFLICT
    assert "conflict: Pod p: container 'vllm' already passes" in capsys.readouterr().err


def test_a_deprecated_field_name_renders_alike_with_a_warning(tmp_path, capsys):
    outputs = []
    for name in ("stagingSize", "hostStagingSize"):
        (tmp_path / "cr.yaml").write_text(yaml.safe_dump(tpc_doc({
            "cpu": None, "storage": {name: "2Gi"}})))
        assert main(["render", "-f", str(tmp_path / "cr.yaml")]) == 0
        captured = capsys.readouterr()
        outputs.append(captured.out)
        warned = "spec.storage.stagingSize is deprecated: rename it hostStagingSize"
        assert (warned in captured.err) is (name == "stagingSize")
    assert outputs[0] == outputs[1]


def test_file_without_cr(tmp_path):
    (tmp_path / "x.yaml").write_text("kind: ConfigMap\n")
    assert main(["render", "-f", str(tmp_path / "x.yaml")]) == EXIT_INVALID


def test_crd_command_prints_the_crd():
    result = run("crd")
    assert result.returncode == 0
    doc = yaml.safe_load(result.stdout)
    assert doc["metadata"]["name"] == "tieredprefixcaches.kvtier.dev"


def test_watches_have_server_client_and_connect_timeouts():
    import kopf

    from kvtier_operator.handlers import configure

    settings = kopf.OperatorSettings()
    configure(settings)
    w = settings.watching
    assert w.server_timeout and w.client_timeout and w.connect_timeout
    assert w.client_timeout > w.server_timeout  # the server ends a healthy watch first
