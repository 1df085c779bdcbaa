"""Time to first token of one cached prompt on a slow volume, with kvtier's tier or
without any (one engine process per run). Prints JSON on the last line: the tokens, the
seconds to the first token, prompt tokens that came from a cache, and (with the tier)
how kvtier_offload_tier_skipped moved.

    python -m tests.e2e.slow_volume MODEL_DIR [ROOT_DIR]

With ROOT_DIR the engine runs in GPU-direct mode on it, recompute bound on; the caller
makes the volume slow (tests/e2e/shims/slow_volume.c preloaded) and has the prompt's
blocks written there beforehand. First WARM_UP other prompts run, so that the engine
has measured its prefill rate (and, with the tier, the volume's round trips), as a
serving engine has; then the cached prompt, timed from submission to its first token.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.e2e.engine import build_llm, generate, prompt

CACHED_SEED = 31  # the prompt whose blocks are on the volume
WARM_UP = (41, 42, 43, 44)  # other prompts, never cached


def skipped() -> dict[str, float]:
    from prometheus_client import REGISTRY

    from kvtier_offload.recompute_bound import REASONS

    return {reason: REGISTRY.get_sample_value("kvtier_offload_tier_skipped_total",
                                              {"tier": "storage", "reason": reason}) or 0.0
            for reason in REASONS}


def main() -> None:
    model, root = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    llm = build_llm(model, root, extra={"recompute_bound": True}) if root else build_llm(model)
    for seed in WARM_UP:
        generate(llm, prompt(seed), max_tokens=2)
    before = skipped() if root else {}
    llm.reset_prefix_cache()
    began = time.perf_counter()
    first, cached = generate(llm, prompt(CACHED_SEED), max_tokens=1)
    ttft = time.perf_counter() - began
    after = skipped() if root else {}
    print(json.dumps({"tokens": first, "ttft": ttft, "cached": cached,
                      "skipped": {k: after[k] - before[k] for k in after}}), flush=True)
    # Exit now: the lookup threads may still be in the slow volume's stats, which
    # shutdown would wait for; nothing after this is under test.
    os._exit(0)


if __name__ == "__main__":
    main()
