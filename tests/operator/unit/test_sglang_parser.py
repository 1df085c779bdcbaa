"""The flags and env kvtier renders for SGLang, checked with SGLang's own argument parser
and env definitions (sglang 0.5.23: sglang.srt.server_args.prepare_server_args, the same
call `python -m sglang.launch_server` and `sglang serve` make).

Needs `pip install --no-deps sglang==0.5.23` plus orjson, ipython and traitlets (what its
parser module imports beyond this project's test environment; the Makefile's dev install
has them). Skips, saying which import failed, where they are missing.
"""

from __future__ import annotations

import itertools

import pytest

from kvtier_operator.api.v1alpha1 import SglangIoBackend as IoBackend
from kvtier_operator.api.v1alpha1 import SglangPrefetchPolicy as PrefetchPolicy
from kvtier_operator.api.v1alpha1 import SglangWritePolicy as WritePolicy
from kvtier_operator.engines.sglang import hicache as sglang_hicache
from kvtier_operator.engines.sglang.flags import add_flags

try:
    from sglang.srt import environ as sglang_environ
    from sglang.srt.server_args import prepare_server_args
except ImportError as err:  # sglang, or a module its parser imports, is not installed
    pytest.skip(f"SGLang's argument parser is not importable here ({err}); `make` installs "
                "sglang==0.5.23 --no-deps with orjson, ipython and traitlets",
                allow_module_level=True)

GIB = 2**30


def parse(words: list[str]):
    return prepare_server_args(words)


@pytest.mark.parametrize(("policy", "io", "file_tier"), list(itertools.product(
    list(WritePolicy), list(IoBackend), [False, True])))
def test_rendered_flags_parse_with_sglangs_parser(policy, io, file_tier):
    rendered = sglang_hicache.flags(cpu_bytes=100 * GIB, rank_count=2, write_policy=policy,
                                    io_backend=io, page_size=64, file_tier=file_tier)
    container = {"name": "sglang", "command": ["python3", "-m", "sglang.launch_server"],
                 "args": ["--model-path=Qwen/Qwen3-32B", "--tensor-parallel-size=2"]}
    assert add_flags(container, rendered, sglang_hicache.forbidden(file_tier)) == []
    args = parse(container["args"])
    assert args.enable_hierarchical_cache is True
    assert args.hicache_size == 53  # 107.37 GB over 2 ranks, rounded down
    assert args.hicache_write_policy == str(policy)
    assert args.hicache_io_backend == str(io)
    assert args.page_size == 64
    assert args.hicache_storage_backend == ("file" if file_tier else None)
    assert args.tp_size == 2


def test_flags_kvtier_keeps_from_the_user_parse_the_same():
    rendered = sglang_hicache.flags(cpu_bytes=8 * 10**9, rank_count=1,
                                    write_policy=WritePolicy.write_through,
                                    io_backend=IoBackend.kernel, page_size=32, file_tier=True)
    container = {"name": "sglang", "command": ["sglang", "serve"],
                 "args": ["Qwen/Qwen3-0.6B", "--enable-hicache", "--page-size", "32"]}
    assert add_flags(container, rendered, sglang_hicache.forbidden(True)) == []
    args = parse(["--model-path", *container["args"]])
    assert (args.enable_hierarchical_cache, args.page_size, args.hicache_size) == (True, 32, 8)


def test_every_spelling_kvtier_reads_is_one_sglang_accepts():
    """kvtier reads these as the flags it manages and the rank flags: SGLang must too."""
    assert parse(["--model-path=m", "--enable-hicache"]).enable_hierarchical_cache is True
    for spelling in ("--tp-size", "--tensor-parallel-size", "--tp"):
        assert parse(["--model-path=m", f"{spelling}=4"]).tp_size == 4
    for spelling in ("--pp-size", "--pipeline-parallel-size"):
        assert parse(["--model-path=m", f"{spelling}=2"]).pp_size == 2
    for spelling in ("--dp-size", "--data-parallel-size"):
        assert parse(["--model-path=m", f"{spelling}=2"]).dp_size == 2
    for flag in sglang_hicache.RANK_FLAGS:
        for spelling in (flag.name, *flag.aliases):
            parse(["--model-path=m", f"{spelling}=1"])  # no SystemExit: SGLang takes it


def test_flags_kvtier_refuses_exist_in_sglang():
    """--config and --hicache-storage-backend-extra-config are SGLang flags: refusing them
    guards something real (a renamed flag would make the refusal dead code)."""
    args = parse(["--model-path=m", "--hicache-storage-backend=file",
                  '--hicache-storage-backend-extra-config={"max_size": "1G"}'])
    assert args.hicache_storage_backend_extra_config == '{"max_size": "1G"}'
    assert sglang_hicache.EXTRA_CONFIG.name == "--hicache-storage-backend-extra-config"


def test_env_names_are_sglangs(monkeypatch, tmp_path):
    rendered = sglang_hicache.env(str(tmp_path))
    for name, value in rendered.items():
        monkeypatch.setenv(name, value)
    assert sglang_environ.envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.get() == str(
        tmp_path / "sglang")
    for name in sglang_hicache.ENV_OWN_EVICTOR:  # the env kvtier refuses is SGLang's own
        assert hasattr(sglang_environ.envs, name), name


@pytest.mark.parametrize(("settings", "cache", "ttl"), [
    ({}, True, 5.0),  # llm-d's guide: on, 5 s
    ({"metadataCache": True, "metadataCacheTTLSeconds": 0.25}, True, 0.25),
    ({"metadataCache": False}, False, 5.0),  # off: no TTL written, SGLang's default stays
])
def test_metadata_cache_env_reads_back_with_sglangs_own_definitions(monkeypatch, tmp_path,
                                                                   settings, cache, ttl):
    from kvtier_operator.api.v1alpha1 import SglangSettings

    rendered = sglang_hicache.env(str(tmp_path), SglangSettings.model_validate(settings))
    for name, value in rendered.items():
        monkeypatch.setenv(name, value)
    envs = sglang_environ.envs
    assert envs.SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE.get() is cache
    assert envs.SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL.get() == ttl
    assert getattr(envs, sglang_hicache.ENV_METADATA_CACHE).name == \
        sglang_hicache.ENV_METADATA_CACHE


@pytest.mark.parametrize("policy", list(PrefetchPolicy))
def test_prefetch_policy_parses_with_sglangs_parser(policy):
    rendered = sglang_hicache.flags(cpu_bytes=100 * GIB, rank_count=2,
                                    write_policy=WritePolicy.write_through,
                                    io_backend=IoBackend.kernel, page_size=64, file_tier=True,
                                    prefetch_policy=policy)
    container = {"name": "sglang", "command": ["python3", "-m", "sglang.launch_server"],
                 "args": ["--model-path=Qwen/Qwen3-32B", "--tensor-parallel-size=2"]}
    assert add_flags(container, rendered, sglang_hicache.forbidden(True)) == []
    assert parse(container["args"]).hicache_storage_prefetch_policy == str(policy)


def test_hicache_file_writes_where_the_env_points(monkeypatch, tmp_path):
    # As if a ConfigMap (envFrom) turned SGLang's own evictor on: kvtier's env wins.
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "1G")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE", "1G")
    """SGLang's own file backend, constructed as a server rank would, writes its pages
    in the directory kvtier's env names, in names the evictor's sglang layout deletes."""
    torch = pytest.importorskip("torch")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    from kvtier_evictor.layouts import SGLANG, Kind

    for name, value in sglang_hicache.env(str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="Qwen/Qwen3-0.6B")
    store = HiCacheFile(config)
    assert not store._evictor.enabled  # kvtier's env keeps SGLang's own evictor off
    key = "ab" * 32
    assert store.set(key, torch.ones(8, dtype=torch.bfloat16))
    files = sorted(p.name for p in (tmp_path / "sglang").iterdir())
    assert files == [f"{key}_Qwen-Qwen3-0.6B_0_1.bin"]
    assert SGLANG.classify(files[0]) is Kind.BLOCK


def test_host_memory_reserve_is_sglangs():
    """The reserve kvtier adds to the memory is the one SGLang keeps free below the
    container's limit when it checks --hicache-size."""
    import ast
    import pathlib

    import sglang

    # Read from the source: importing the module pulls in SGLang's model zoo.
    source = pathlib.Path(sglang.__file__).parent / "srt/mem_cache/pool_host/base.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(getattr(t, "id", "") == "HICACHE_HOST_MEMORY_RESERVE_BYTES"
                   for t in targets):
                value = eval(compile(ast.Expression(node.value), str(source), "eval"))
                assert sglang_hicache.HOST_MEMORY_RESERVE_BYTES == value
                return
    raise AssertionError(f"HICACHE_HOST_MEMORY_RESERVE_BYTES not in {source}")
