"""One engine process for the chained-tier tests: vLLM 0.32's TieringOffloadingSpec with the
secondary tiers given as JSON (what the operator renders, paths moved under a test
directory), storing or loading real rows through kvtier's tiers, as vLLM's tiering does.

    python -m tests.offload.tier_engine '<json>'

The JSON holds "tiers", "model" (a part of the fingerprint), "keys" (hex) and "mode":
- store: fill one row per key from "seed", store each to every tier (vLLM cascades a
  chunk to all its secondary tiers), wait; print {"digest": sha256 of the rows}.
- load: look each key up in the tiers in order (vLLM's promotion order); load each from
  the first that has it; print {"served": [tier type or null per key], "digest": sha256 of
  the loaded rows in key order (null unless every key was served)}.
- usage: print {"bytes": the block files' bytes under "root"} after a store (see tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np


def manager(tiers: list[dict[str, Any]], model: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from tests.offload.test_vllm_tier import PAGE

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 64 * PAGE * 4, "block_size": 64,
                      "secondary_tiers": tiers},
        engine_id=f"tier-engine-{os.getpid()}-{time.monotonic_ns()}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
    )
    return TieringOffloadingSpec(cfg).get_manager()


def settle(tier: Any, key: bytes, seconds: float = 20.0) -> Any:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    deadline = time.monotonic() + seconds
    while (answer := tier.lookup(key, ReqContext(req_id="r"))) is LookupResult.RETRY:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{type(tier).__name__} never answered a lookup")
        time.sleep(0.005)
    return answer


def run(request: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult

    from tests.offload.test_vllm_tier import job, wait_jobs

    keys = [bytes.fromhex(k) for k in request["keys"]]
    m = manager(request["tiers"], request["model"])
    try:
        tiers = m.secondary_tiers
        for tier in tiers:  # a restarted local tier counts what it finds first
            files = getattr(getattr(tier, "store", None), "files", None)
            if files is not None and hasattr(files, "ready"):
                assert files.ready.wait(20)
        rows = np.asarray(tiers[0]._primary_kv_view).view(np.uint8)
        if request["mode"] == "store":
            rng = np.random.default_rng(request["seed"])
            rows[: len(keys)] = rng.integers(0, 256, size=rows[: len(keys)].shape,
                                             dtype=np.uint8)
            for n, key in enumerate(keys):
                for tier in tiers:
                    tier.submit_store(job(n, [key], [n]))
                    assert wait_jobs(tier, 1, timeout=30)[n].success
            return {"digest": hashlib.sha256(rows[: len(keys)].tobytes()).hexdigest()}
        served: list[str | None] = []
        target = len(keys)  # load into rows after the first len(keys), zeroed
        rows[target: 2 * target] = 0
        for n, key in enumerate(keys):
            source = next((t for t in tiers if settle(t, key) is LookupResult.HIT), None)
            served.append(None if source is None else type(source).__name__)
            if source is not None:
                source.submit_load(job(100 + n, [key], [target + n], promotion=True))
                assert wait_jobs(source, 1, timeout=30)[100 + n].success
        loaded = rows[target: 2 * target].tobytes()
        return {"served": served,
                "digest": hashlib.sha256(loaded).hexdigest() if all(served) else None}
    finally:
        m.shutdown()


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
