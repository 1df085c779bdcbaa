"""docs/llm-d-guides.md against what kvtier renders: each guide-equivalent example under
examples/ is injected into its sample workload (what `make demo EXAMPLE=...` admits
through the webhook) and rendered with its objects, and the settings the table's kvtier
column names are pinned here. Every example the table names is rendered here, and each
value below appears both in the rendering and in that example's rows of the table."""

from __future__ import annotations

import json
import re

import pytest

from kvtier_demo.samples import sample_workload
from kvtier_operator.context import RenderContext
from kvtier_operator.render.objects import render_objects
from kvtier_operator.render.pod import TEMPLATE_PATHS, inject_workload
from kvtier_operator.validation import parse_tpc
from kvtier_operator.yamlio import dump
from tests.helpers import ROOT, example

CTX = RenderContext(offload_image="reg/kvtier-offload:1")
GUIDES = ROOT / "docs" / "llm-d-guides.md"

# The kvtier column's values, per example: each must be in the example's rendering and in
# its rows of the table.
PINNED = {
    "native-cpu.yaml": ["107374182400", "120Gi", "201Gi", "301Gi",
                        "lruCapacityPerServer: 25600", "llm-d.ai/v1"],
    "lmcache-cpu.yaml": ["LMCacheConnectorV1", "200.0", "/tmp/lmcache_prometheus",
                         "kvtier-lmcache-prometheus"],
    "native-kvtier.yaml": ["TieringOffloadingSpec", "256", "203Gi", "303Gi", "120Gi"],
    # (test_native_fs_is_the_guides_tiering_config_exactly pins the whole JSON)
    "native-vllm-fs.yaml": ["TieringOffloadingSpec", "107374182400", "/mnt/files-storage",
                            "llm-d-kv-cache-storage", "120Gi", "201Gi", "301Gi"],
    "lmcache-disk.yaml": ["file:///mnt/files-storage/lmcache/", '{"use_odirect": true}',
                          "1120.0"],
    "sglang-hicache.yaml": ["--hicache-write-policy=write_through",
                            "--hicache-io-backend=kernel", "--page-size=64",
                            "--hicache-storage-backend=file",
                            "--hicache-storage-prefetch-policy=wait_complete",
                            "/mnt/files-storage/sglang", "214", "lruCapacityPerServer: 25600"],
    "vllm-tpu-single-host.yaml": ["TPUOffloadConnector",
                                  "tpu_inference.offload.tpu_offload_connector", "25000",
                                  "1000"],
    "vllm-tpu-multi-host.yaml": ["10000", "1024", "80000", "model-servers.yaml"],
    "mooncake-store.yaml": ["MooncakeStoreConnector", "/etc/kvtier/mooncake", "rdma/ib"],
    "mooncake-offload.yaml": ["load_async", "/data/mooncake-offload"],
}


def rows() -> dict[str, str]:
    """The table's rows by the examples their second column names."""
    out: dict[str, str] = {}
    every = ""  # rows for all examples
    for line in GUIDES.read_text().splitlines():
        cells = line.split("|")
        if len(cells) < 8 or cells[1].strip() in ("guide variant", "---"):
            continue
        if cells[2].strip() == "all":
            every += line + "\n"
        for name in re.findall(r"`([a-z0-9-]+\.yaml)`", cells[2]):
            out[name] = out.get(name, "") + line + "\n"
    return {name: text + every for name, text in out.items()}


def rendered(name: str) -> tuple[dict, list[dict], str]:
    """(the example's pod template after injection, its objects, all of it as text)."""
    doc = example(name)
    tpc = parse_tpc(doc)
    workload = example(sample_workload(doc))
    out, conflicts = inject_workload(tpc, workload, CTX)
    assert conflicts == [], conflicts
    parent = out
    for key in TEMPLATE_PATHS[out["kind"]][0]:
        parent = parent[key]
    objects = render_objects(tpc, CTX)
    return parent, objects, dump(out) + "".join(dump(o) for o in objects)


def env(template: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in template["spec"]["containers"][0]["env"]}


def test_the_table_names_exactly_the_examples_rendered_here():
    assert set(rows()) == set(PINNED)
    for name in PINNED:
        assert (ROOT / "examples" / name).exists(), name


@pytest.mark.parametrize("name", sorted(PINNED))
def test_each_pinned_value_is_rendered_and_documented(name):
    _, _, text = rendered(name)
    documented = rows()[name]
    for value in PINNED[name]:
        assert value in text, f"{name}: kvtier no longer renders {value}"
        assert value in documented, f"docs/llm-d-guides.md: {name}'s rows lost {value}"


def test_native_fs_is_the_guides_tiering_config_exactly():
    template, _, _ = rendered("native-vllm-fs.yaml")
    config = json.loads(env(template)["KVTIER_KV_TRANSFER_CONFIG"])
    assert config == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {
                          "spec_name": "TieringOffloadingSpec",
                          "cpu_bytes_to_use": 107374182400, "block_size": 256,
                          "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/files-storage",
                                               "n_read_threads": 16,
                                               "n_write_threads": 16}]}}
    c = template["spec"]["containers"][0]
    assert (c.get("securityContext") or {}).get("runAsUser") is None  # never root
    assert {"name": "kvtier-cache", "mountPath": "/mnt/files-storage"} in c["volumeMounts"]


def test_lmcache_and_sglang_file_tiers_carry_the_guides_env():
    template, _, _ = rendered("lmcache-disk.yaml")
    e = env(template)
    assert json.loads(e["LMCACHE_EXTRA_CONFIG"]) == {"use_odirect": True}
    assert e["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/lmcache_prometheus"
    assert "lazy_offload" not in json.dumps(e)  # not a key vLLM's tiers read (see the doc)
    template, _, _ = rendered("sglang-hicache.yaml")
    e = env(template)
    assert e["SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE"] == "true"
    assert e["SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL"] == "5.0"


def test_mooncake_variants_request_rdma_and_the_ssd_variant_loads_async():
    for name in ("mooncake-store.yaml", "mooncake-offload.yaml"):
        template, _, _ = rendered(name)
        resources = template["spec"]["containers"][0]["resources"]
        assert resources["requests"]["rdma/ib"] == resources["limits"]["rdma/ib"] == "1"
    template, _, _ = rendered("mooncake-offload.yaml")
    assert json.loads(env(template)["KVTIER_KV_TRANSFER_CONFIG"])[
        "kv_connector_extra_config"] == {"load_async": True}


def test_guides_settings_kvtier_leaves_alone_are_not_rendered():
    # n.a. rows: node tuning and GKE workarounds stay the workload's; kvtier adds none.
    for name in PINNED:
        template, _, text = rendered(name)
        assert "NCCL_TUNER_PLUGIN" not in text and "fix-lustre-permissions" not in text
        assert not any(c.get("securityContext", {}).get("privileged")
                       for c in template["spec"].get("initContainers", []))
