"""The real vLLM CPU engine on GlusterFS: engine A on node A's mount writes the prefix's
KV blocks, engine B (a fresh process) on node B's mount hits them and answers exactly as
without offloading. The engine harness and fixtures are tests/e2e's (tests/e2e/fixtures.py)."""

from __future__ import annotations

import pytest

from tests.e2e.fixtures import engine
from tests.e2e.test_vllm_engine import FULL_BLOCKS_TOKENS, blocks

pytestmark = [pytest.mark.glusterfs, pytest.mark.vllm, pytest.mark.timeout(900)]


def test_engine_b_on_node_b_hits_what_engine_a_wrote_on_node_a(model, baseline, nodes):
    a, b = nodes
    first = engine(model, a)
    assert first["tokens"] == baseline and first["cached"] == 0
    assert len(blocks(b)) == FULL_BLOCKS_TOKENS // 32  # node B sees node A's files
    second = engine(model, b)
    assert second["cached"] == FULL_BLOCKS_TOKENS, "engine B did not load A's blocks"
    assert second["tokens"] == baseline
