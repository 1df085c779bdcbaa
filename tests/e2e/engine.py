"""One vLLM engine run (its own process): prints the generated token ids and how many
prompt tokens came from a prefix cache, as JSON on the last line.

    python -m tests.e2e.engine MODEL_DIR [ROOT_DIR]   (ROOT_DIR: use kvtier's spec)
"""

from __future__ import annotations

import json
import os
import random
import sys

PROMPT_TOKENS = 200  # six full 32-token blocks and a tail
BLOCK_SIZE = 32  # vLLM's CPU backend needs a multiple of 32
GPU_DIRECT_EXAMPLE = "native-gpu-direct.yaml"
FILE_TOKENS_ENV = "KVTIER_E2E_FILE_TOKENS"  # tokens per GPU-direct file (default BLOCK_SIZE)


def gpu_direct_doc(file_tokens: int | None = None) -> dict:
    """The example without a CPU tier, its files of file_tokens tokens (storage.blockSize;
    default one engine block, $KVTIER_E2E_FILE_TOKENS or BLOCK_SIZE): the tiny engine's
    200-token prompts are shorter than the operator's default 256-token files."""
    from tests.helpers import example

    doc = example(GPU_DIRECT_EXAMPLE)
    tokens = file_tokens or int(os.environ.get(FILE_TOKENS_ENV) or BLOCK_SIZE)
    doc["spec"]["storage"]["blockSize"] = tokens
    return doc


def make_model(path: str) -> None:
    """A tiny random-weight Llama (no download): 2 layers, head_dim 64."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(path)


def build_llm(model: str, root: str | None = None, **overrides):
    """An engine on the tiny model; with root, in GPU-direct mode, exactly as the operator
    renders kv-transfer-config for the example without a CPU tier, pointed at root
    (overrides: more kv_connector_extra_config, or top-level keys such as kv_connector)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if root:
        from kvtier_operator.render.connector import kv_transfer_config
        from kvtier_operator.validation import parse_tpc

        rendered = kv_transfer_config(parse_tpc(gpu_direct_doc()))
        # recompute_bound off: these runs guard the load path, and on this tiny model
        # recomputing is nearly free, so the bound would (rightly) skip the tier at
        # random on a loaded machine; tests/e2e/slow_volume.py turns it on.
        extra = rendered["kv_connector_extra_config"] | {
            "root_dir": root, "n_read_threads": 2, "n_write_threads": 2,
            "recompute_bound": False, **overrides.pop("extra", {})}
        kv = KVTransferConfig(**(rendered | overrides | {"kv_connector_extra_config": extra}))
    return LLM(model=model, skip_tokenizer_init=True, block_size=BLOCK_SIZE,
               enforce_eager=True, max_model_len=512, dtype="float32",
               enable_prefix_caching=True, kv_transfer_config=kv)


def prompt(seed: int = 1, tokens: int = PROMPT_TOKENS) -> list[int]:
    return random.Random(seed).choices(range(1, 500), k=tokens)


def generate(llm, token_ids: list[int], max_tokens: int = 8):
    """(generated token ids, prompt tokens that came from a prefix cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=token_ids)],
                       SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False),
                       use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def main() -> None:
    model, root = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    seeds = [int(s) for s in os.environ.get("KVTIER_E2E_SEEDS", "1").split(",")]
    llm = build_llm(model, root)
    runs = [generate(llm, prompt(seed)) for seed in seeds]
    print(json.dumps({"tokens": runs[0][0], "cached": runs[0][1],
                      "all_tokens": [tokens for tokens, _ in runs]}))


if __name__ == "__main__":
    main()
