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


def make_model(path: str) -> None:
    """A tiny random-weight Llama (no download): 2 layers, head_dim 64."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(path)


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, root = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    kv = None
    if root:
        # Exactly what the operator renders for the example without a CPU tier, pointed
        # at this run's directory.
        from kvtier_operator.loading import parse_tpc
        from kvtier_operator.render.connector import kv_transfer_config
        from tests.helpers import example

        rendered = kv_transfer_config(parse_tpc(example(GPU_DIRECT_EXAMPLE)))
        extra = rendered["kv_connector_extra_config"] | {
            "root_dir": root, "n_read_threads": 2, "n_write_threads": 2}
        kv = KVTransferConfig(kv_connector=rendered["kv_connector"],
                              kv_role=rendered["kv_role"], kv_connector_extra_config=extra)
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=BLOCK_SIZE, enforce_eager=True,
              max_model_len=512, dtype="float32", enable_prefix_caching=True,
              kv_transfer_config=kv)
    prompt = random.Random(1).choices(range(1, 500), k=PROMPT_TOKENS)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=8, temperature=0, detokenize=False))[0]
    print(json.dumps({"tokens": list(out.outputs[0].token_ids),
                      "cached": out.num_cached_tokens or 0}))


if __name__ == "__main__":
    main()
