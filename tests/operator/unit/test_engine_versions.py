"""The engine version as an input (#30): spec.engineVersion or the image's release tag,
vLLM's feature table, the refusals (parse_tpc = webhook and `kvtier render`, and the
CRD's CEL rules evaluated for real), per-version rendering and the pod conflict."""

from __future__ import annotations

import json

import pytest

from kvtier_operator.context import RenderContext
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.engines.versions import Version, cel_at_least
from kvtier_operator.engines.vllm.versions import SYNC_LOAD_BUDGET, VLLM_VERSIONS
from kvtier_operator.render.pod import inject
from kvtier_operator.status import engine_version_condition
from kvtier_operator.validation import InvalidResource, parse_tpc
from tests.helpers import tpc_doc, vllm_pod
from tests.operator.unit.test_crd import _failed_messages


@pytest.mark.parametrize(("image", "version"), [
    ("vllm/vllm-openai:v0.33.0", Version(0, 33)),
    ("vllm/vllm-openai:0.33.0", Version(0, 33)),
    ("docker.io/vllm/vllm-openai:v0.32.1", Version(0, 32, 1)),
    ("registry.example.com:5000/vllm/vllm-openai:v0.26.0", Version(0, 26)),
    ("vllm/vllm-openai:latest", None),
    ("vllm/vllm-openai:v0.33.0-cu129", None),  # a build variant, not the release tag
    ("vllm/vllm-openai@sha256:" + "a" * 64, None),
    ("ghcr.io/llm-d/llm-d-cuda:v0.3.0", None),  # llm-d's version, not vLLM's
    ("example.com/team/vllm:v0.33.0", None),
    (None, None),
])
def test_image_release_tag(image, version):
    assert VLLM_VERSIONS.image_version(image) == version


@pytest.mark.parametrize("minimum", [Version(0, 27), Version(0, 33), Version(0, 9),
                                     Version(0, 100), Version(1, 0)])
def test_cel_version_regex_agrees_with_the_ordering(minimum):
    import celpy
    env = celpy.Environment()
    program = env.program(env.compile(cel_at_least("self", minimum)))
    for text in ["0.8", "0.9", "0.26", "0.27", "0.27.5", "0.32", "0.33", "0.34", "0.99",
                 "0.100", "0.101", "1.0", "1.2.3", "2.0", "10.1"]:
        version = Version.parse(text)
        assert version is not None
        want = (version.major, version.minor) >= (minimum.major, minimum.minor)
        got = bool(program.evaluate({"self": celpy.json_to_cel(text)}))
        assert got == want, (text, minimum)


def _refusal(spec: dict) -> str:
    with pytest.raises(InvalidResource) as err:
        parse_tpc(tpc_doc(spec))
    return "; ".join(err.value.messages)


def test_sync_load_budget_needs_0_33_declared():
    why = _refusal({"engineVersion": "0.32", "syncLoadBudget": "256Mi"})
    assert "spec.syncLoadBudget" in why and "0.33" in why and "0.32" in why
    cel = _failed_messages(tpc_doc({"engineVersion": "0.32", "syncLoadBudget": "256Mi"}))
    assert any("sync_load_budget_bytes" in m and "0.33" in m for m in cel), cel
    assert _failed_messages(tpc_doc({"engineVersion": "0.33", "syncLoadBudget": "256Mi"})) == []
    parse_tpc(tpc_doc({"engineVersion": "0.33.1", "syncLoadBudget": "256Mi"}))


def test_engine_version_below_the_oldest_is_refused():
    why = _refusal({"engineVersion": "0.26"})
    assert "0.26" in why and "0.32" in why
    assert any("0.32 and later" in m for m in _failed_messages(tpc_doc({"engineVersion": "0.26"})))


def test_engine_version_only_where_the_engine_has_a_table():
    spec = {"engine": "sglang", "sglang": {}, "engineVersion": "0.5"}
    assert "engine vllm only" in _refusal(spec)
    assert any("spec.engineVersion applies only" in m for m in _failed_messages(tpc_doc(spec)))


def test_sync_load_budget_refused_for_hybrid_models():
    spec = {"engineVersion": "0.33", "syncLoadBudget": "256Mi",
            "model": {"name": "m", "kvBytesPerToken": 65536, "kvCacheGroups": 4}}
    assert "kvCacheGroups" in _refusal(spec)
    assert any("kvCacheGroups" in m for m in _failed_messages(tpc_doc(spec)))


def test_sync_load_budget_only_with_connector_native():
    spec = {"engineVersion": "0.33", "syncLoadBudget": "256Mi", "connector": "lmcache"}
    doc = tpc_doc(spec)
    doc["spec"].pop("storage", None)
    with pytest.raises(InvalidResource, match="syncLoadBudget applies only"):
        parse_tpc(doc)
    assert any("syncLoadBudget applies only" in m for m in _failed_messages(doc))


def _extra(tpc) -> dict:
    return adapter_for(tpc.spec).launch_options(tpc)["kv_connector_extra_config"]


def test_sync_load_budget_rendered_only_when_asked():
    assert "sync_load_budget_bytes" not in _extra(parse_tpc(tpc_doc({"engineVersion": "0.33"})))
    tpc = parse_tpc(tpc_doc({"engineVersion": "0.33", "syncLoadBudget": "256Mi"}))
    assert _extra(tpc)["sync_load_budget_bytes"] == 256 * 2**20
    # no CPU tier: kvtier's connector passes it to vLLM's scheduler the same way
    doc = tpc_doc({"engineVersion": "0.33", "syncLoadBudget": "64Mi"})
    del doc["spec"]["cpu"]
    assert _extra(parse_tpc(doc))["sync_load_budget_bytes"] == 64 * 2**20


def _injected(spec: dict, image: str):
    pod = vllm_pod(image=image)
    return inject(parse_tpc(tpc_doc(spec)), pod, RenderContext())


def test_pod_whose_image_lacks_the_feature_is_a_named_conflict():
    spec = {"syncLoadBudget": "256Mi"}
    result = _injected(spec, "vllm/vllm-openai:v0.32.0")
    assert not result.changed
    [conflict] = result.conflicts
    assert conflict.startswith("EngineVersionConflict:")
    assert "0.32" in conflict and "0.33" in conflict and "spec.syncLoadBudget" in conflict
    # even where the spec declares 0.33: the image is what runs
    assert _injected(spec | {"engineVersion": "0.33"}, "vllm/vllm-openai:v0.32.0").conflicts


def test_pod_whose_image_has_the_feature_is_injected():
    result = _injected({"syncLoadBudget": "256Mi"}, "vllm/vllm-openai:v0.33.0")
    assert result.changed and not result.conflicts
    args = result.pod["spec"]["containers"][0]["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1].replace("$$", "$"))
    assert config["kv_connector_extra_config"]["sync_load_budget_bytes"] == 256 * 2**20


def test_unknown_image_version_is_the_oldest():
    # an image without a vLLM release tag: spec.engineVersion decides, else 0.32
    result = _injected({"syncLoadBudget": "256Mi"}, "ghcr.io/llm-d/llm-d-cuda:v0.3.0")
    assert result.conflicts and "assumes the oldest it supports, 0.32" in result.conflicts[0]
    ok = _injected({"syncLoadBudget": "256Mi", "engineVersion": "0.33"},
                   "ghcr.io/llm-d/llm-d-cuda:v0.3.0")
    assert ok.changed and not ok.conflicts


def test_old_image_with_vllm_fs_tier_is_a_conflict():
    spec = {"storage": {"pvc": {"size": "1Ti"}, "backend": "vllm-fs"}}
    result = _injected(spec, "vllm/vllm-openai:v0.26.0")
    assert result.conflicts and "49328" in result.conflicts[0]
    assert _injected(spec, "vllm/vllm-openai:v0.27.0").changed


def test_features_without_a_spec_field_are_in_the_table():
    keys = {f.key for f in VLLM_VERSIONS.features}
    assert {"sync-load-budget", "tier-poll-interval", "backpressure-failure-threshold",
            "fs-tier-external-evictor", "kv-load-failure-policy",
            "per-tier-kv-events"} <= keys
    assert SYNC_LOAD_BUDGET.minimum == Version(0, 33)


def test_engine_version_condition():
    unknown = engine_version_condition(parse_tpc(tpc_doc()))
    assert (unknown.status, unknown.reason) == ("Unknown", "EngineVersionUnknown")
    assert "0.32" in unknown.message
    declared = engine_version_condition(parse_tpc(tpc_doc({"engineVersion": "0.33"})))
    assert (declared.status, declared.reason) == ("True", "Declared")
