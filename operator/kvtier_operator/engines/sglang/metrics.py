"""What SGLang's /metrics (`--enable-metrics`) says about HiCache's tiers (sglang 0.5.23's
metrics collector):

- prompt tokens `sglang:prompt_tokens`; cached ones by source
  `sglang:cached_tokens{cache_source=device|host|storage}`; computed = prompt - cached
  (SGLang counts no computed tokens of its own);
- the host tier (cpu): bytes `sglang:load_back_bytes` (to HBM) and
  `sglang:hicache_backup_bytes` (from HBM), load latency
  `sglang:load_back_duration_seconds`, capacity and use in tokens
  `sglang:hicache_host_total_tokens` / `_used_tokens`;
- the file tier (storage): tokens prefetched and backed up (`sglang:prefetched_tokens`,
  `sglang:backuped_tokens`); SGLang exports no bytes for it.

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
    cached: dict[str, float] = {}
    for labels, v in rank.get("sglang:cached_tokens_total", ()):
        tier = SOURCE_TIER.get(labels.get("cache_source", ""))
        if tier is not None:
            cached[tier] = cached.get(tier, 0.0) + v
    finite = all(math.isfinite(v) for v in cached.values())
    for tier, tokens in cached.items():
        if math.isfinite(tokens):
            f.counters[(HIT_TOKENS, tier)] = tokens
        else:
            f.missing[(HIT_TOKENS, tier)] = "a NaN or infinite sglang:cached_tokens"
    if prompt is not None and "sglang:cached_tokens_total" in rank and finite:
        f.counters[(RECOMPUTED_TOKENS, "")] = max(0.0, prompt - sum(cached.values()))
    elif prompt is not None:
        f.missing[(RECOMPUTED_TOKENS, "")] = "sglang:cached_tokens is absent"
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
