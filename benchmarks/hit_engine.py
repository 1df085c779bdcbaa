"""One vLLM CPU engine for the busy-volume hit benchmark (benchmarks/busy_hit.py), in a
process of its own, on kvtier's GPU-direct tier at ROOT_DIR.

    python -m benchmarks.hit_engine MODEL_DIR ROOT_DIR write   # prefill the prompt once
    python -m benchmarks.hit_engine MODEL_DIR ROOT_DIR serve   # then one line per command

`write` generates the prompt once (its KV blocks go to ROOT_DIR) and exits once they are
written. `serve` prints `ready`, then answers each line on stdin: `hit` empties the
engine's own prefix cache and times the prompt to its first token (its prefix then comes
from ROOT_DIR); `miss` times a prompt of the same length that was never stored
(recompute). Each answer is one JSON line: seconds to the first token and the prompt
tokens that came from a cache. The tier's recompute bound is off and lookups may take up
to 60 s: this measures the hit itself, not the decision whether to take it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

PROMPT_TOKENS = 4000
BLOCK_SIZE = 32  # tokens per GPU block, one block per file: 2 MiB at this model's 64 KiB
MAX_MODEL_LEN = PROMPT_TOKENS + 64
HIT_SEED, MISS_SEED = 7, 1000
STAGING_BYTES = 384 << 20  # the whole hit (250 MiB) in one piece; two engines share 2 cores


def make_model(path: str) -> None:
    """A random-weight Llama whose KV is 64 KiB a token in float32 (16 layers, 8 KV heads
    of 64): a 4000-token prompt is about 250 MiB of KV, as in issue #37's measurements."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=MAX_MODEL_LEN)
    LlamaForCausalLM(config).save_pretrained(path)  # type: ignore[no-untyped-call]


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(1, 500), k=PROMPT_TOKENS)


def build(model: str, root: str) -> Any:  # vllm.LLM, imported late
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: 4 prompts' worth
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier_operator.render.connector import kv_transfer_config
    from kvtier_operator.validation import parse_tpc
    from tests.helpers import example

    rendered = kv_transfer_config(parse_tpc(example("native-gpu-direct.yaml")))
    # Lookups wait as long as they take (the fixed 1 s deadline would make a slow one a
    # miss, and the hit a recompute): this measures the hit. The wait is capped at half
    # the hit TTL, so hits stay cached for 120 s: rounds after the first find their
    # lookups answered (the block store case in busy_hit times the stats).
    extra = rendered["kv_connector_extra_config"] | {
        "root_dir": root, "recompute_bound": False, "lookup_pending_seconds": 60,
        "lookup_hit_ttl": 120, "max_staging_bytes": STAGING_BYTES}
    kv = KVTransferConfig(**(rendered | {"kv_connector_extra_config": extra}))
    return LLM(model=model, skip_tokenizer_init=True, block_size=BLOCK_SIZE,
               enforce_eager=True, max_model_len=MAX_MODEL_LEN, dtype="float32",
               enable_prefix_caching=True, kv_transfer_config=kv)


def first_token(llm: Any, seed: int, tokens: int = 1) -> dict[str, float]:
    """Seconds until the prompt's first token (the whole run where tokens > 1), with
    the engine's own prefix cache emptied first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    began = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt(seed))],
                       SamplingParams(max_tokens=tokens, temperature=0, detokenize=False),
                       use_tqdm=False)[0]
    return {"seconds": time.perf_counter() - began, "cached": out.num_cached_tokens or 0}


def main() -> None:
    model, root, role = sys.argv[1:4]
    llm = build(model, root)
    if role == "write":
        # A few decode steps: the connector submits a finished prefill's stores on the
        # engine's next steps; the engine's shutdown then drains them.
        print(json.dumps(first_token(llm, HIT_SEED, tokens=8)), flush=True)
        return
    print("ready", flush=True)
    misses = 0
    for line in sys.stdin:
        command = line.strip()
        if command == "hit":
            answer = first_token(llm, HIT_SEED)
        elif command == "miss":
            misses += 1
            answer = first_token(llm, MISS_SEED + misses)
        else:
            break
        print(json.dumps(answer), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
