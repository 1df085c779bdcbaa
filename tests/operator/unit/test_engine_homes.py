"""Nothing outside engines/ branches on the engine (docs/architecture.md): the rest of the
operator asks the spec's adapter. A grep over the source, so a new `if spec.tpu` or
`Connector.native` in render/, the webhook or the reconcile fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "kvtier_operator"
# The API defines the enums and the settings blocks (api/v1alpha1/settings.py); engines/
# is where they are read.
HOMES = ("engines/", "api/")
ENGINE_WORDS = {"vllm", "vllm-tpu", "sglang", "native", "lmcache", "mooncake-store", "kvbm",
                "vllm-fs"}
ENUMS = {"Engine", "Connector", "StorageBackend"}
SPEC_BLOCKS = {"tpu", "sglang", "mooncake", "engine", "connector"}
ENGINE_MODULE = re.compile(r"kvtier_operator\.engines\.(?:vllm|sglang|tpu)\b")


def _branches(text: str) -> list[str]:
    """Each place the code reads an engine: an enum member (Connector.native), a settings
    block or the pair on a spec (spec.tpu), an engine's value compared as a literal, an
    import of one engine's modules. Messages and docstrings may name engines."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in ENUMS:
            found.append(f"l.{node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in SPEC_BLOCKS and (
                (isinstance(node.value, ast.Name) and node.value.id == "spec")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "spec")):
            found.append(f"l.{node.lineno}: spec.{node.attr}")
        elif isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                values = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) \
                    else [operand]
                found += [f"l.{node.lineno}: compares {v.value!r}" for v in values
                          if isinstance(v, ast.Constant) and v.value in ENGINE_WORDS]
        elif isinstance(node, ast.ImportFrom | ast.Import):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom):
                modules += [f"{node.module}.{a.name}" for a in node.names]
            found += [f"l.{node.lineno}: imports {m}" for m in modules
                      if ENGINE_MODULE.match(m)]
    return found


@pytest.mark.parametrize("line", [
    "native = spec.connector == Connector.native",
    "tpu = spec.tpu is not None",
    "vllm = tpc.spec.engine == 'vllm'",
    "vllm = engine in ('vllm', 'sglang')",
    "from kvtier_operator.engines.vllm.launch import SCRIPT_OPTION",
])
def test_the_check_sees_a_branch(line):
    assert _branches(line)


def test_nothing_outside_engines_branches_on_the_engine():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(HOMES):
            continue
        found = _branches(path.read_text())
        if found:
            offenders[relative] = found
    assert not offenders, ("ask the spec's adapter (engines/registry.adapter_for) instead of "
                           f"branching on the engine: {offenders}")
