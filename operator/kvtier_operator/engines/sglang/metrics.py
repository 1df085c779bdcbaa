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

Not yet tested on a page from SGLang's own collector: sglang 0.5.23's
`srt/observability/metrics_collector.py` imports `srt/disaggregation/utils.py`, which
imports the package `srt/configs` (every model's config, multimodal ones with torchvision
and transformers' image processors) and, through `model_executor/forward_batch_info.py`,
SGLang's layers. PyPI's torchvision for torch 2.13 (0.28.0) cannot import over the CPU
torch the dev environment uses (`operator torchvision::nms does not exist`: its ops are
built against CUDA torch), the CPU builds of torchvision are not on PyPI, and a venv with
PyPI's CUDA torch is gigabytes. Loading the collector with `srt/configs`' `__init__` left
out fails on the names other modules import from it.

Every TP rank reports its own series; token counts are logical (the same on each rank),
so they are read from one rank (the smallest tp_rank label), bytes summed over ranks.
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
NOT_ENABLED = "sglang:prompt_tokens is absent (start SGLang with --enable-metrics)"


def _one_rank(samples: Samples) -> Samples:
    ranks = sorted({labels.get("tp_rank", "") for series in samples.values()
                    for labels, _ in series})
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
