"""One GPU-direct engine (its own process) through three broken block files: for each
case a prompt of its own is cached to files block by block, one block file in the
middle of that prefix is broken (flipped byte, truncated, deleted), the GPU prefix
cache is reset and the prompt runs again, then once more. Prints JSON on the last line:
per case the tokens of both runs, whether the broken file is still there, and how the
store's counters moved.

    python -m tests.e2e.recompute MODEL_DIR ROOT_DIR [CONNECTOR]

CONNECTOR: another kv_connector (e.g. vLLM's plain OffloadingConnector, to watch the
engine stop where kvtier's connector recomputes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tests.e2e.engine import BLOCK_SIZE, PROMPT_TOKENS, build_llm, generate, prompt

BROKEN_BLOCK = 3  # of the six full blocks of a prompt: the middle of the cached prefix
# (seed, how the file is broken): one prompt per case, so each case is on its own
CASES = {"flipped": 11, "truncated": 12, "deleted": 13}


def counters() -> dict[str, float]:
    from prometheus_client import REGISTRY

    def value(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, {"tier": "storage", **labels}) or 0.0

    return {
        "bad-checksum": value("kvtier_offload_corrupt_files_total", {"reason": "bad-checksum"}),
        "truncated": value("kvtier_offload_corrupt_files_total", {"reason": "truncated"}),
        "missing": value("kvtier_offload_operations_total",
                         {"direction": "load", "outcome": "missing"}),
    }


def files(root: str) -> set[Path]:
    return set(Path(root).rglob("*.kvb"))


def cache_block_by_block(llm, root: str, tokens: list[int]) -> list[Path]:
    """Run longer and longer prefixes so that each run stores exactly one new block
    file: the files of the prompt's blocks, in order. A few tokens each: a store is
    submitted at the start of the engine step after the one that computed its block."""
    order: list[Path] = []
    for n in range(1, PROMPT_TOKENS // BLOCK_SIZE + 1):
        before = files(root)
        generate(llm, tokens[:n * BLOCK_SIZE + 1], max_tokens=4)
        deadline = time.monotonic() + 30
        while not (new := files(root) - before):
            assert time.monotonic() < deadline, f"block {n} was never stored"
            time.sleep(0.01)
        assert len(new) == 1, new
        order += new
    return order


def break_file(path: Path, how: str) -> None:
    if how == "flipped":
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF  # the payload, not the header
        path.write_bytes(bytes(raw))
    elif how == "truncated":
        os.truncate(path, path.stat().st_size - 1)
    else:
        path.unlink()


def main() -> None:
    model, root = sys.argv[1], sys.argv[2]
    overrides = {"kv_connector": sys.argv[3]} if len(sys.argv) > 3 else {}
    # The manager trusts a hit it has seen for this long: a file deleted after the
    # lookup, as by the evictor racing a request, reaches the load, which must cope.
    # Lookups wait as long as they need: on a loaded machine a stat overdue at the usual
    # 1 s is a miss, the broken block is never read, and the load path is not tested.
    llm = build_llm(model, root, extra={"lookup_hit_ttl": 3600, "lookup_pending_seconds": 60},
                    **overrides)
    results = {}
    for how, seed in CASES.items():
        tokens = prompt(seed)
        order = cache_block_by_block(llm, root, tokens)
        victim = order[BROKEN_BLOCK - 1]
        break_file(victim, how)
        before = counters()
        llm.reset_prefix_cache()  # nothing left on the "GPU": the prefix is in files only
        first, cached = generate(llm, tokens)
        llm.reset_prefix_cache()
        again, _ = generate(llm, tokens)  # the engine still serves
        after = counters()
        results[how] = {"tokens": first, "again": again, "cached": cached,
                        "victim_exists": victim.exists(),
                        "counted": {k: after[k] - before[k] for k in after}}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
