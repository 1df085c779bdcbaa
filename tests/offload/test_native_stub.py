"""kvtier_offload/_native.pyi, the types mypy holds callers of the C extension to, says
what the built extension has: the same names, and each function's parameters in the
order its own docstring gives them."""

from __future__ import annotations

import ast
import pathlib

import pytest

from kvtier_offload import native

STUB = pathlib.Path(native.__file__).with_name("_native.pyi")
pytestmark = pytest.mark.skipif(native.module is None, reason=native.REASON or "-")


def stub() -> tuple[dict[str, list[str]], set[str]]:
    """The stub's functions (name: parameter names) and its other public names."""
    functions, names = {}, set()
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = [a.arg for a in node.args.posonlyargs + node.args.args]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return functions, {n for n in names if not n.startswith("_")}


def test_the_stub_names_what_the_extension_has():
    functions, constants = stub()
    public = {name for name in dir(native.module) if not name.startswith("_")}
    assert set(functions) | constants == public
    for name in constants:
        declared = ast.unparse(next(
            n.annotation for n in ast.parse(STUB.read_text()).body
            if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == name))
        assert type(getattr(native.module, name)).__name__ == declared, name


def test_each_function_takes_the_parameters_its_docstring_gives():
    functions, _ = stub()
    for name, params in functions.items():
        doc = getattr(native.module, name).__doc__
        signature = doc.split(")")[0].split("(", 1)[1]
        assert [p.strip() for p in signature.split(",")] == params, name
