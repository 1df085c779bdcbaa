"""One vLLM CPU engine (its own process) that times the first token of prompts it is sent,
for the recompute-bound comparisons (tests/e2e/rounds.py): a model big enough that
recomputing a prompt costs a measurable time (about a few tenths of a second), so that 5%
of it is more than the engine's own jitter.

    python -m tests.e2e.ttft_engine MODEL_DIR MODE [ROOT_DIR]

MODE: off (no offloading), tier (vLLM's TieringOffloadingSpec: its CPU tier, then kvtier's
tier on ROOT_DIR, as the operator renders examples/native-kvtier.yaml; the CPU tier's
worker a no-op, see kv_config) or gpu-direct
(kvtier's own spec on ROOT_DIR, examples/native-gpu-direct.yaml); the recompute bound on.
First WARM_UP other prompts run (a serving engine has measured its prefill rate and the
volume's round trips), then it prints {"ready": true} and answers lines on stdin:

    ttft SEED    -> {"seed", "ttft", "cached", "tokens", "skipped"}: the prompt of SEED
                    (never seen by this engine), timed from submission to its first token
    store SEED   -> {"seed", "files"}: the prompt run, then its chunks waited for on ROOT_DIR
    quit

Environment (test knobs, not product settings): KVTIER_TEST_WRITER=1 warms up on
other prompts (a writer), KVTIER_TEST_RECOMPUTE_BOUND=0 gives the tier its fixed 1 s deadline instead
of the bound (to watch a comparison fail).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 1024
CHUNK_TOKENS = 64  # tokens per file in tier mode (kv-transfer-config block_size)
BLOCK_SIZE = 32  # vLLM's CPU backend needs a multiple of 32
MAX_MODEL_LEN = 2048
CPU_TIER_BYTES = 512 << 20  # about 40 prompts of this model: every round's stays
WARM_UP = (941, 942, 943, 944)
WRITER_WARM_UP = (951, 952)


def make_model(path: str) -> None:
    """A random-weight Llama (no download) whose 1024-token prefill costs a few tenths
    of a second on two cores: 4 layers, hidden 512, head_dim 64, 8 KiB of KV a token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=MAX_MODEL_LEN)
    LlamaForCausalLM(config).save_pretrained(path)


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(1, 500), k=PROMPT_TOKENS)


def kv_config(mode: str, root: str | None) -> Any:
    from vllm.config import KVTransferConfig

    from kvtier_operator.render.connector import kv_transfer_config
    from kvtier_operator.validation import parse_tpc
    from tests.helpers import example

    if mode == "off":
        return None
    # KVTIER_TEST_RECOMPUTE_BOUND=0: the fixed 1 s deadline instead, to watch the
    # comparisons fail without the bound
    bound = os.environ.get("KVTIER_TEST_RECOMPUTE_BOUND", "1") != "0"
    # KVTIER_TEST_STORE_NICE: the store threads' priority (store.StoreConfig.store_nice;
    # 0: loads and stores share threads at the engine's priority), to compare the two
    nice = {"store_nice": int(os.environ["KVTIER_TEST_STORE_NICE"])} if os.environ.get(
        "KVTIER_TEST_STORE_NICE") else {}
    if mode == "gpu-direct":
        rendered = kv_transfer_config(parse_tpc(example("native-gpu-direct.yaml")))
        extra = rendered["kv_connector_extra_config"] | {
            "root_dir": root, "n_read_threads": 2, "n_write_threads": 2,
            "recompute_bound": bound, **nice}
    else:
        rendered = kv_transfer_config(parse_tpc(example("native-kvtier.yaml")))
        extra = dict(rendered["kv_connector_extra_config"])
        (tier,) = extra["secondary_tiers"]
        # vLLM refuses its CPU tier's worker on the CPU platform: one that moves no bytes
        # between GPU and CPU region stands in (tests/e2e/noop_cpu_spec.py); kvtier's
        # tier, vLLM's tiering manager and the files stay real. A hit's tokens are then
        # not the recompute's (zeros were loaded): compare() checks tokens only where
        # nothing was loaded.
        extra |= {"cpu_bytes_to_use": CPU_TIER_BYTES, "block_size": CHUNK_TOKENS,
                  "spec_name": "NoopTieringOffloadingSpec",
                  "spec_module_path": "tests.e2e.noop_cpu_spec",
                  "secondary_tiers": [tier | {"root_dir": root, "n_read_threads": 2,
                                              "n_write_threads": 2,
                                              "recompute_bound": bound, **nice}]}
    return KVTransferConfig(**(rendered | {"kv_connector_extra_config": extra}))


def build_llm(model: str, mode: str, root: str | None) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(model=model, skip_tokenizer_init=True, block_size=BLOCK_SIZE,
               enforce_eager=True, max_model_len=MAX_MODEL_LEN, dtype="float32",
               enable_prefix_caching=True, kv_transfer_config=kv_config(mode, root))


def generate(llm: Any, token_ids: list[int], max_tokens: int = 1) -> tuple[list[int], int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=token_ids)],
                       SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False),
                       use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def _bound(llm: Any) -> Any:
    """The object that holds the recompute bound's rates: tier mode's tier, GPU-direct
    mode's manager (in process: no multiprocessing)."""
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.get_kv_connector().connector_scheduler.manager
    tiers = getattr(manager, "secondary_tiers", None)
    return tiers[0] if tiers else manager


def rates(llm: Any, mode: str) -> dict[str, float | None]:
    """The bound's estimates now: seconds per prompt token to recompute, to load."""
    if mode == "off":
        return {}
    holder = _bound(llm)
    store = holder.stores[0] if mode == "gpu-direct" else holder.store
    return {"prefill": holder.prefill.per_unit, "load": holder.load_rate.per_unit,
            "stat": store.stat_seconds(), "answer": store._background.answer_seconds(),
            "late": holder.waits.late}


def skipped(llm: Any, mode: str) -> dict[str, float]:
    """kvtier's skips so far, by reason (the bound's own count: in tier mode the metric
    travels in vLLM's stats to an API server this process does not run)."""
    from prometheus_client import REGISTRY

    from kvtier_offload.recompute_bound import REASONS

    if mode == "gpu-direct":
        return {reason: REGISTRY.get_sample_value("kvtier_offload_tier_skipped_total",
                                                  {"tier": "storage", "reason": reason}) or 0.0
                for reason in REASONS}
    if mode == "tier":
        return {reason: float(_bound(llm).waits.skips[reason]) for reason in REASONS}
    return {}


class LookupTrace:
    """When the recompute bound answered this round's lookups (RequestWaits.answer
    wrapped): the first answer, the last "wait" (None) and the first "recompute"
    (False), on time.perf_counter, for the round's report (where the time went)."""

    def __init__(self, llm: Any, mode: str) -> None:
        self.calls: list[tuple[float, bool | None]] = []
        if mode == "off":
            return
        waits = _bound(llm).waits
        answer = waits.answer

        def traced(*args: Any, **kwargs: Any) -> bool | None:
            result = answer(*args, **kwargs)
            self.calls.append((time.perf_counter(), result))
            return result

        waits.answer = traced

    def since(self, began: float) -> dict[str, float | int | None]:
        calls, self.calls = self.calls, []

        def first(kind: object) -> float | None:
            return next((round(t - began, 3) for t, r in calls if r is kind), None)

        waits = [t for t, r in calls if r is None]
        return {"first": round(calls[0][0] - began, 3) if calls else None,
                "last_wait": round(waits[-1] - began, 3) if waits else None,
                "first_miss": first(False), "first_hit": first(True),
                "waits": len(waits)}


def unlink_cpu_region(llm: Any, mode: str) -> None:
    """Remove the CPU tier's shared-memory file now that the engine has mapped it: this
    process ends with os._exit (or a test's kill), which never runs vLLM's cleanup, and
    each file left in /dev/shm holds CPU_TIER_BYTES of the machine's memory."""
    if mode != "tier":
        return
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.get_kv_connector().connector_scheduler.manager
    with contextlib.suppress(OSError, AttributeError):
        os.unlink(manager.primary_tier._mmap_region.mmap_path)


def block_files(root: str) -> int:
    return sum(1 for _ in Path(root).rglob("*.kvb"))


def main() -> None:
    model, mode = sys.argv[1], sys.argv[2]
    root = sys.argv[3] if len(sys.argv) > 3 else None
    llm = build_llm(model, mode, root)
    unlink_cpu_region(llm, mode)
    # A writer (KVTIER_TEST_WRITER=1) warms up on other prompts, so that the volume never
    # holds the measuring engine's warm-ups: one whose warm-ups were all hits would
    # compute nothing, and so measure no prefill.
    writer = os.environ.get("KVTIER_TEST_WRITER", "0") == "1"
    for seed in WRITER_WARM_UP if writer else WARM_UP:
        generate(llm, prompt(seed))
    trace = LookupTrace(llm, mode)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "quit":
            break
        seed = int(arg)
        if command == "store":
            assert root is not None
            before = block_files(root)
            generate(llm, prompt(seed))
            deadline, last, steady = time.monotonic() + 60, -1, 0.0
            while time.monotonic() < deadline:  # until its files stop appearing
                now = block_files(root)
                steady = steady + 0.1 if now == last and now > before else 0.0
                if steady >= 1.0:
                    break
                last = now
                time.sleep(0.1)
            print(json.dumps({"seed": seed, "files": block_files(root) - before}), flush=True)
            continue
        if mode == "off":  # one engine without offloading serves many comparisons
            llm.reset_prefix_cache()
        before = skipped(llm, mode)
        trace.since(0.0)  # forget the stores' and earlier rounds' lookups
        began = time.perf_counter()
        tokens, cached = generate(llm, prompt(seed))
        ttft = time.perf_counter() - began
        after = skipped(llm, mode)
        print(json.dumps({"seed": seed, "ttft": ttft, "cached": cached, "tokens": tokens,
                          "skipped": {k: after[k] - before[k] for k in after},
                          "rates": rates(llm, mode), "lookups": trace.since(began)}),
              flush=True)
    # Exit now: lookup threads may still be in a slow volume's stats, which shutdown
    # would wait for; nothing after this is under test.
    os._exit(0)


if __name__ == "__main__":
    main()
