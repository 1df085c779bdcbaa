"""kvtier's vLLM tier vs vLLM 0.32's own fs tier, driven the way vLLM drives them.

`store` compares the two block-file layers called directly; this compares the tiers a
user actually configures: TieringOffloadingSpec builds each from its secondary-tier
config (`"type": "fs"` or kvtier's `module_path`), jobs of CPU-tier rows go in
through submit_store / submit_load, and get_finished_jobs is polled as the scheduler
polls it. Everything above the file I/O (job books, thread pools, lookups of results)
counts for both. Same directory, row size, thread count; each job must succeed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.store import (
    ROUNDS,
    THREADS,
    TOTAL,
    alternate,
    drop_caches,
    on_disk_and_in_ram,
    side_by_side,
)
from benchmarks.store import keys as store_keys

ROW_SIZES = (256 << 10, 2 << 20, 16 << 20)
ROWS = 64  # CPU-tier rows the jobs cycle through (the store bench's arena)
# Many requests' worth of 16 rows each, then the whole run as one job: one long prompt's
# prefix, which vLLM's fs tier moves on one thread and kvtier spreads over its threads.
JOB_SIZES = (16, 0)
GPU_BLOCKS_PER_ROW = 4  # 64-token rows of 16-token GPU blocks
POLL_SECONDS = float(os.environ.get("KVTIER_BENCH_POLL", "0.0005"))


def build(kind: str, root: str, row: int) -> tuple[Any, Any]:
    """(manager, tier) from vLLM's own spec and factory, as a vLLM process builds them."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    half = max(THREADS // 2, 1)
    tier: dict[str, Any] = {"root_dir": root, "n_read_threads": half,
                            "n_write_threads": THREADS - half}
    if kind == "kvtier":
        # The store bench's queue budget: measure every block, drop none.
        tier.update(type="KvtierStorageTier", module_path="kvtier_offload.vllm_tier",
                    write_queue_seconds=3600)
    else:
        tier.update(type="fs")
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",),
                                      group_id=0),),
        worker_kv_bytes_per_block=row // GPU_BLOCKS_PER_ROW, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": ROWS * row, "block_size": 16 * GPU_BLOCKS_PER_ROW,
                      "secondary_tiers": [tier]},
        engine_id=f"bench-{kind}-{os.getpid()}-{time.monotonic_ns()}",
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=GPU_BLOCKS_PER_ROW),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
    )
    manager = TieringOffloadingSpec(cfg).get_manager()
    (tier_obj,) = manager.secondary_tiers
    if tier_obj.block_size_bytes != row:
        raise RuntimeError(f"row of {tier_obj.block_size_bytes} bytes, wanted {row}")
    return manager, tier_obj


def run_jobs(tier: Any, jobs: list[Any], load: bool) -> float:
    """Submit every job, poll until all have finished; seconds taken."""
    start = time.perf_counter()
    for job in jobs:
        (tier.submit_load if load else tier.submit_store)(job)
    done: list[Any] = []
    while len(done) < len(jobs):
        done += list(tier.get_finished_jobs())
        time.sleep(POLL_SECONDS)
    seconds = time.perf_counter() - start
    failed = [r.job_id for r in done if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(jobs)} jobs failed, e.g. {failed[:3]}")
    return seconds


def one(kind: str, base: str, row: int, job_rows: int) -> tuple[float, float]:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    root = tempfile.mkdtemp(prefix=f"{kind}-", dir=base)
    manager, tier = build(kind, root, row)
    try:
        rows = np.asarray(tier._primary_kv_view).view(np.uint8)
        rows[:] = np.frombuffer(os.urandom(rows.size), np.uint8).reshape(rows.shape)
        del rows  # an exported view would keep vLLM from unmapping its CPU region
        n = max(TOTAL // row, 1)
        job_rows = job_rows or n
        keys = store_keys(n, kind)

        def jobs(first_id: int, promotion: bool) -> list[Any]:
            return [TransferJob(job_id=first_id + j, keys=keys[s:s + job_rows],
                                chunk_ids=np.arange(s, s + len(keys[s:s + job_rows])) % ROWS,
                                is_promotion=promotion, req_context=ReqContext(req_id=f"r{j}"))
                    for j, s in enumerate(range(0, n, job_rows))]

        store_s = run_jobs(tier, jobs(0, False), load=False)
        drop_caches()
        load_s = run_jobs(tier, jobs(1 << 20, True), load=True)
    finally:
        manager.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return n * row / store_s / 1e9, n * row / load_s / 1e9


def compare(base: str, label: str) -> None:
    for job_rows in JOB_SIZES:
        jobs = f"jobs of {job_rows} rows" if job_rows else "one job"
        print(f"\n### {label}, {jobs}: {base}, {TOTAL >> 20} MiB per run, {THREADS} threads, "
              f"median of {ROUNDS} alternating rounds")
        print("| row | vLLM fs tier store | kvtier tier store | ratio | vLLM fs tier load | "
              "kvtier tier load | ratio | store ratio by round | load ratio by round |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in ROW_SIZES:
            (v_store, k_store, v_load, k_load), ranges = side_by_side(
                alternate(lambda kind, row=row, job_rows=job_rows: one(kind, base, row,
                                                                        job_rows)))
            print(f"| {row >> 10} KiB | {v_store:.2f} GB/s | {k_store:.2f} GB/s | "
                  f"{k_store / v_store:.2f}x | {v_load:.2f} GB/s | {k_load:.2f} GB/s | "
                  f"{k_load / v_load:.2f}x | {ranges}")


def main() -> None:
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    on_disk_and_in_ram(compare, "kvtier-bench-tier-")
