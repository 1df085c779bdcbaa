"""One GPU-direct engine (its own process) with a sync-load budget
(kv_connector_extra_config.sync_load_budget_bytes): vLLM 0.33 loads a hit within the
engine step (submit_load(..., expedited=True), waited for before the forward pass); 0.32
ignores the key and loads between steps. Prints JSON on the last line.

- "hit": a prompt cached to files, the GPU prefix cache reset, the prompt again: its first
  hit from files (0.33 died here with a TypeError before kvtier took `expedited`);
- "flipped": another prompt cached block by block, one byte flipped in the payload of one
  block file in the middle, the GPU prefix cache reset, then the prompt three times:
  "first" (from files: the bad block fails its check), "again" (straight after, from the
  GPU prefix cache, which the failed block must not have poisoned), "fresh" (after another
  reset). Each must be the tokens of an engine without offloading: before kvtier reported
  failed sync loads by block id, 0.33 answered wrong tokens on the first two.

    python -m tests.e2e.sync_load MODEL_DIR ROOT_DIR
"""

from __future__ import annotations

import json
import sys
import time

from tests.e2e.engine import BLOCK_SIZE, PROMPT_TOKENS, build_llm, generate, prompt
from tests.e2e.recompute import BROKEN_BLOCK, break_file, cache_block_by_block, files

SEEDS = {"hit": 21, "flipped": 22}  # a prompt of their own (tests/e2e/fixtures.py)
SYNC_BUDGET = 64 << 20  # bytes per step: any hit of the tiny model fits


def count_calls() -> dict[str, int]:
    """Expedited loads the worker was given and sync loads the connector failed (the
    engine runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker)."""
    from kvtier_offload.vllm_connector import KvtierConnectorWorker
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker

    counts = {"expedited": 0, "sync_failures": 0}
    submit_load, fail_sync = KvtierOffloadingWorker.submit_load, KvtierConnectorWorker._fail_sync

    def counted_submit(self, *args, **kwargs):
        counts["expedited"] += bool(kwargs.get("expedited"))
        return submit_load(self, *args, **kwargs)

    def counted_fail(self, *args, **kwargs):
        counts["sync_failures"] += 1
        return fail_sync(self, *args, **kwargs)

    KvtierOffloadingWorker.submit_load = counted_submit
    KvtierConnectorWorker._fail_sync = counted_fail
    return counts


def main() -> None:
    import vllm

    model, root = sys.argv[1], sys.argv[2]
    counts = count_calls()
    # lookup_hit_ttl: the manager trusts the hit it saw, so the flipped file reaches a load.
    llm = build_llm(model, root, extra={"lookup_hit_ttl": 3600,
                                        "sync_load_budget_bytes": SYNC_BUDGET})
    out: dict = {"vllm": vllm.__version__}

    tokens = prompt(SEEDS["hit"])
    before = files(root)
    generate(llm, tokens)
    deadline = time.monotonic() + 30
    while len(files(root) - before) < PROMPT_TOKENS // BLOCK_SIZE:
        assert time.monotonic() < deadline, "the prompt's blocks were never stored"
        time.sleep(0.01)
    llm.reset_prefix_cache()
    hit, cached = generate(llm, tokens)
    out["hit"] = {"tokens": hit, "cached": cached, "expedited": counts["expedited"]}

    tokens = prompt(SEEDS["flipped"])
    order = cache_block_by_block(llm, root, tokens)
    break_file(order[BROKEN_BLOCK - 1], "flipped")
    llm.reset_prefix_cache()
    first, cached = generate(llm, tokens)
    again, _ = generate(llm, tokens)
    llm.reset_prefix_cache()
    fresh, _ = generate(llm, tokens)
    out["flipped"] = {"first": first, "cached": cached, "again": again, "fresh": fresh,
                      "victim_exists": order[BROKEN_BLOCK - 1].exists()}
    out |= counts
    print(json.dumps(out))


if __name__ == "__main__":
    main()
