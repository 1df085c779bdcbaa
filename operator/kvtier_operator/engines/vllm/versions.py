"""vLLM's versions: which vLLM has what kvtier renders (docs/support-matrix.md).

The minimums come from vLLM's history (docs/support-matrix.md cites each); kvtier is
tested on 0.32 and 0.33 (tests/vllm runs in both environments), so an unknown version
is treated as 0.32 and a spec may declare 0.32 or later.
"""

from __future__ import annotations

from kvtier_operator.engines.versions import Feature, Version, VersionTable

V0_32, V0_33 = Version(0, 32), Version(0, 33)

# vLLM's own fs tier under an external evictor: before 0.27 a file deleted under a
# running engine was still reported as stored (vllm #49328).
FS_TIER_EXTERNAL_EVICTOR = Feature(
    "fs-tier-external-evictor", "vLLM's fs tier with kvtier's external evictor",
    Version(0, 27), "vllm #49328 (files deleted by another process are noticed)",
    "has(self.storage) && has(self.storage.backend) && self.storage.backend == 'vllm-fs'")
# An out-of-tree secondary tier named by module_path (kvtier's KvtierStorageTier).
OUT_OF_TREE_TIER = Feature(
    "out-of-tree-tier", "out-of-tree secondary tiers (module_path), kvtier's storage tier",
    Version(0, 28), "vLLM 0.28 TieringOffloadingSpec loads a tier by module_path")
# Per-tier KV events (enable_kv_events and locality on a secondary tier, medium STORAGE).
PER_TIER_KV_EVENTS = Feature(
    "per-tier-kv-events", "per-tier KV events (enable_kv_events, locality, medium STORAGE)",
    Version(0, 27), "vLLM 0.27 media STORAGE + locality")
# kv_transfer_config.kv_load_failure_policy (no CPU tier: kvtier's connector reports a
# block it could not load and vLLM recomputes). Present in 0.32 (config/kv_transfer.py);
# its first release was not checked here, so the table says the oldest kvtier tests.
KV_LOAD_FAILURE_POLICY = Feature(
    "kv-load-failure-policy", "kv_load_failure_policy: recompute (no CPU tier)",
    V0_32, "vLLM 0.32 config/kv_transfer.py (earlier releases not checked)")
BACKPRESSURE = Feature(
    "backpressure", "tier backpressure (backpressure)", Version(0, 31),
    "vLLM 0.31 BackpressureDetector")
BACKPRESSURE_FAILURE_THRESHOLD = Feature(
    "backpressure-failure-threshold", "backpressure failure_threshold", V0_33,
    "vLLM 0.33 backpressure.py (a TypeError on 0.32)")
SYNC_LOAD_BUDGET = Feature(
    "sync-load-budget", "vLLM's in-step loads (sync_load_budget_bytes)", V0_33,
    "vLLM 0.33 offloading/scheduler.py", "has(self.syncLoadBudget)")
TIER_POLL_INTERVAL = Feature(
    "tier-poll-interval", "tier polling thread (tier_poll_interval_s)", V0_33,
    "vLLM 0.33 tiering/manager.py")

VLLM_VERSIONS = VersionTable(
    engine="vLLM",
    oldest=V0_32,
    newest_tested=V0_33,
    features=(FS_TIER_EXTERNAL_EVICTOR, OUT_OF_TREE_TIER, PER_TIER_KV_EVENTS,
              KV_LOAD_FAILURE_POLICY, BACKPRESSURE, BACKPRESSURE_FAILURE_THRESHOLD,
              SYNC_LOAD_BUDGET, TIER_POLL_INTERVAL),
    # vLLM's release images; llm-d's (ghcr.io/llm-d/...) tags are llm-d's versions.
    release_repositories=frozenset({"vllm/vllm-openai"}),
)
