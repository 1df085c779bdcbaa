"""The SGLang HiCache adapter: spec refusals naming the field, the evictor CronJob's
layout, the router's page-sized blocks, and the sizing docs' worked example."""

from __future__ import annotations

import re

import pytest

from kvtier_evictor import cli as evictor_cli
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.sglang import hicache as sglang_hicache
from kvtier_operator.render.cronjob import render_cronjob
from kvtier_operator.render.pod import inject_workload
from kvtier_operator.render.router import endpoint_picker_config
from kvtier_operator.validation import InvalidResource, parse_tpc
from tests.helpers import ROOT, example, tpc_doc

SGLANG = {"engine": "sglang", "sglang": {}}


def tpc(spec):
    return parse_tpc(tpc_doc({**SGLANG, **spec}))


@pytest.mark.parametrize(("spec", "needle"), [
    ({"engine": "sglang", "sglang": None}, "spec.sglang is required with engine sglang"),
    ({"engine": "vllm", "sglang": {}}, "spec.sglang applies only to engine sglang"),
    ({"storage": {"backend": "kvtier", "pvc": {"size": "1Ti"}}}, "spec.storage.backend"),
    ({"storage": {"blockSize": 256, "pvc": {"size": "1Ti"}}}, "spec.storage.blockSize"),
    ({"router": {"blockSize": 16}}, "spec.router.blockSize 16 differs from spec.sglang.pageSize"),
    ({"cpu": {"size": "900M"}}, "under 1 GB"),
    ({"cpu": None}, "spec.cpu is required"),
    ({"connector": "lmcache"}, "engine sglang takes connector native"),
    ({"sglang": {"writePolicy": "write_around"}}, "writePolicy"),
])
def test_invalid_sglang_specs_name_the_field(spec, needle):
    doc = tpc_doc({**SGLANG, **spec})
    doc["spec"] = {k: v for k, v in doc["spec"].items() if v is not None}
    with pytest.raises(InvalidResource) as err:
        parse_tpc(doc)
    assert needle in str(err.value)


def test_evictor_cronjob_runs_the_sglang_layout():
    cj = render_cronjob(tpc({}), RenderContext())
    container = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    args = evictor_cli.build_parser().parse_args(container["args"])
    assert args.layout == "sglang" and args.root == "/kv-cache"
    doc = tpc_doc(SGLANG)
    del doc["spec"]["storage"]
    assert render_cronjob(parse_tpc(doc), RenderContext()) is None  # no shared tier


def test_router_scores_in_sglang_pages():
    config = endpoint_picker_config(tpc({"sglang": {"pageSize": 32},
                                         "router": {"enabled": True}}))
    params = [p.get("parameters") or {} for p in config["plugins"]]
    assert {p["blockSizeTokens"] for p in params if "blockSizeTokens" in p} == {32}
    # 100Gi / (256 KiB per token x 32 tokens)
    assert [p["lruCapacityPerServer"] for p in params if "lruCapacityPerServer" in p] == [12800]


def test_example_deployment_gets_the_flags_offline():
    out, conflicts = inject_workload(parse_tpc(example("sglang-hicache.yaml")),
                                     example("sglang-deployment.yaml"), RenderContext())
    assert conflicts == []
    c = out["spec"]["template"]["spec"]["containers"][0]
    assert "--hicache-size=214" in c["args"] and "--page-size=64" in c["args"]
    assert c["resources"]["requests"]["memory"] == "611Gi"  # 200Gi + 400Gi + 10Gi SGLang reserve + 1Gi
    assert out["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "20Gi"


def test_file_tier_gets_the_guides_prefetch_policy_and_metadata_cache():
    # llm-d's SGLang fs guide: --hicache-storage-prefetch-policy=wait_complete, the file
    # backend's metadata cache on with a 5 s TTL, the storage dir on the volume.
    out, conflicts = inject_workload(parse_tpc(example("sglang-hicache.yaml")),
                                     example("sglang-deployment.yaml"), RenderContext())
    assert conflicts == []
    c = out["spec"]["template"]["spec"]["containers"][0]
    assert "--hicache-storage-prefetch-policy=wait_complete" in c["args"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE"] == "true"
    assert env["SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL"] == "5.0"
    assert env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == "/mnt/files-storage/sglang"
    doc = example("sglang-hicache.yaml")
    doc["spec"]["sglang"] |= {"prefetchPolicy": "timeout", "metadataCache": False}
    out, _ = inject_workload(parse_tpc(doc), example("sglang-deployment.yaml"),
                             RenderContext())
    c = out["spec"]["template"]["spec"]["containers"][0]
    assert "--hicache-storage-prefetch-policy=timeout" in c["args"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE"] == "false"
    assert "SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL" not in env
    # Without the file tier none of it: the CPU-only pods' flags and hash are as before.
    doc["spec"].pop("storage")
    out, _ = inject_workload(parse_tpc(doc), example("sglang-deployment.yaml"),
                             RenderContext())
    c = out["spec"]["template"]["spec"]["containers"][0]
    assert not any("prefetch" in a for a in c["args"])
    assert not any(e["name"].startswith("SGLANG_HICACHE_FILE") for e in c["env"])


def test_sizing_doc_worked_example_is_what_the_code_computes():
    section = (ROOT / "docs" / "sizing.md").read_text().split("## SGLang HiCache")[1]
    example_text = section.split("Example:")[1].split("\n\n")[0]
    size = int(re.search(r"--hicache-size=(\d+)", example_text).group(1))
    blocks = int(re.search(r"([\d,]+) router blocks", example_text).group(1).replace(",", ""))
    spec = tpc({"cpu": {"size": "400Gi"}}).spec
    assert size == sglang_hicache.hicache_size_gb(spec.cpu_bytes, 2)
    from kvtier_operator.engines.registry import adapter_for
    assert blocks == adapter_for(spec).router_cpu_blocks(spec)


def test_memory_covers_sglangs_host_reserve():
    """SGLang 0.5.23 checks an explicit --hicache-size against the container's cgroup
    headroom minus a 10 GiB reserve (mem_cache/pool_host/base.py
    host_memory_budget_bytes): the limit kvtier raises must cover the pools plus that
    reserve, or a pod whose own limit was tight refuses to start ("Not enough host memory
    available")."""
    spec = tpc({"cpu": {"size": "100Gi"}}).spec
    pod = {"name": "sglang", "command": ["sglang", "serve", "m"],
           "resources": {"limits": {"nvidia.com/gpu": "2", "memory": "16Gi"}}}
    from kvtier_operator.engines.base import PodRole
    from kvtier_operator.engines.registry import adapter_for
    increase = adapter_for(spec).pod_sizing(spec, None, pod, PodRole.server)
    pools = 2 * sglang_hicache.hicache_size_gb(spec.cpu_bytes, 2) * sglang_hicache.GB
    assert increase.memory_increase_bytes >= pools + sglang_hicache.HOST_MEMORY_RESERVE_BYTES
    assert sglang_hicache.HOST_MEMORY_RESERVE_BYTES == 10 * 2**30


def test_own_evictor_env_from_envfrom_is_overridden():
    """SGLang's own file evictor turns on with SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE or
    _MIN_FREE_SPACE, which a pod can take from a ConfigMap (envFrom) the webhook cannot
    read. kvtier sets both to "0" (SGLang: "0" disables) in env, which wins over envFrom."""
    t = tpc({})
    pod = {"metadata": {}, "spec": {"containers": [{
        "name": "sglang", "command": ["sglang", "serve", "m"],
        "envFrom": [{"configMapRef": {"name": "sglang-tuning"}}]}]}}
    from kvtier_operator.render.pod import inject
    result = inject(t, pod, RenderContext())
    assert result.conflicts == []
    env = {e["name"]: e.get("value") for e in result.pod["spec"]["containers"][0]["env"]}
    for name in sglang_hicache.ENV_OWN_EVICTOR:
        assert env[name] == "0"
    # Without a file tier there is no file evictor to hold off.
    doc = tpc_doc(SGLANG)
    del doc["spec"]["storage"]
    result = inject(parse_tpc(doc), pod, RenderContext())
    env = {e["name"] for e in result.pod["spec"]["containers"][0]["env"]}
    assert not env & set(sglang_hicache.ENV_OWN_EVICTOR)


def test_own_evictor_env_set_to_zero_by_the_user_is_accepted():
    pod = {"metadata": {}, "spec": {"containers": [{
        "name": "sglang", "command": ["sglang", "serve", "m"],
        "env": [{"name": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "value": "0"}]}]}}
    from kvtier_operator.render.pod import inject
    assert inject(tpc({}), pod, RenderContext()).conflicts == []
    pod["spec"]["containers"][0]["env"][0]["value"] = "200G"
    conflicts = inject(tpc({}), pod, RenderContext()).conflicts
    assert any("turns on SGLang's own file evictor" in c for c in conflicts)
