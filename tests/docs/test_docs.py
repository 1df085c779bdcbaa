"""Numbers written in docs/ are the numbers the code computes; `make demo` runs."""

from __future__ import annotations

import re

import pytest

from kvtier_operator.api.quantity import GIB, MIB
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.engines.tpu import sizing as tpu_sizing
from kvtier_operator.engines.vllm import sizing
from kvtier_operator.validation import parse_tpc
from tests.helpers import ROOT, tpc_doc

SIZING = (ROOT / "docs" / "sizing.md").read_text()
LAYERS = {"Llama-3.1-8B": 32, "Qwen3-32B": 64, "Llama-3.3-70B": 80}


def _num(cell: str) -> float:
    return float(re.sub(r"[^0-9.]", "", cell.split("(")[0]))


@pytest.mark.parametrize("model", sorted(LAYERS))
def test_worked_example_row_matches_code(model):
    row = next(line for line in SIZING.splitlines()
               if line.startswith(f"| {model} |") and "MiB" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    spec = parse_tpc(tpc_doc({"model": {"name": model, "kvBytesPerToken": None,
                                        "layers": LAYERS[model], "kvHeads": 8, "headDim": 128,
                                        "dtype": "bfloat16"}})).spec
    fresh, resized = sizing.pod_sizing(spec, None), sizing.pod_sizing(spec, 20 * GIB)
    assert _num(cells[1]) == sizing.block_bytes(spec) / MIB
    assert _num(cells[2]) == sizing.io_buffer_bytes(spec) / GIB
    assert _num(cells[3]) == fresh.shm_bytes / GIB
    assert _num(cells[4]) == fresh.memory_increase_bytes / GIB
    assert _num(cells[5]) == resized.shm_bytes / GIB
    assert _num(cells[6]) == resized.memory_increase_bytes / GIB
    assert _num(cells[7]) == adapter_for(spec).router_cpu_blocks(spec)


@pytest.mark.parametrize("model", sorted(LAYERS))
def test_geometry_table_matches_code(model):
    row = next(line for line in SIZING.splitlines()
               if line.startswith(f"| {model} |") and "bfloat16" in line)
    spec = parse_tpc(tpc_doc({"model": {"name": model, "kvBytesPerToken": None,
                                        "layers": LAYERS[model], "kvHeads": 8, "headDim": 128,
                                        "dtype": "bfloat16"}})).spec
    assert _num(row.strip("|").split("|")[-1]) == spec.model.bytes_per_token




@pytest.mark.parametrize("name", ["vllm-tpu-single-host.yaml", "vllm-tpu-multi-host.yaml"])
def test_tpu_worked_example_row_matches_code(name):
    """docs/sizing.md's TPU rows are what kvtier computes for the examples."""
    from kvtier_operator.engines.base import PodRole
    from kvtier_operator.engines.registry import adapter_for
    from tests.helpers import example

    row = next(line for line in SIZING.splitlines() if line.startswith(f"| {name} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    spec = parse_tpc(example(name)).spec
    adapter = adapter_for(spec)
    pod = adapter.pod_sizing(spec, None, {}, PodRole.server)
    assert pod.shm_bytes is None  # /dev/shm is left alone
    assert _num(cells[1]) == tpu_sizing.tpu_chunk_bytes(spec) / MIB
    assert _num(cells[2]) == tpu_sizing.tpu_cpu_chunks(spec)
    assert _num(cells[3]) == tpu_sizing.tpu_staging_blocks(spec)
    assert _num(cells[4]) == round(pod.memory_increase_bytes / GIB, 2)
    assert _num(cells[5]) == adapter.router_cpu_blocks(spec)
