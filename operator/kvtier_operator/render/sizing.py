"""Every sizing formula kvtier applies; docs/sizing.md explains each with examples.

All inputs are bytes or counts from the spec (and, for /dev/shm, the pod's existing
volume); nothing is guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvtier_operator.api.quantity import GIB, MIB, quantity_bytes, round_up
from kvtier_operator.api.v1alpha1 import Connector, StorageBackend, TieredPrefixCacheSpec

# /dev/shm beyond the CPU tier: NCCL buffers, torch multiprocessing and vLLM's IPC.
SHM_BASE_BYTES = 2 * GIB
# Process memory beyond the tier itself: block tables, page tables, Python objects.
PROCESS_HEADROOM_BYTES = 1 * GIB
GB = 10**9  # LMCache sizes are in decimal GB
# Without a CPU tier: the pinned staging buffers of kvtier's offloading worker (its
# max_staging_bytes), which hold the KV pages of the transfers in flight. Every vLLM
# worker process (one per GPU) pins its own; spec.storage.stagingSize overrides it.
GPU_DIRECT_STAGING_BYTES = 1 * GIB
# vLLM flags whose product is the worker processes of one engine, where the container
# does not say how many GPUs it has.
PARALLEL_FLAGS = {"--tensor-parallel-size": "tp", "-tp": "tp",
                  "--pipeline-parallel-size": "pp", "-pp": "pp",
                  "--data-parallel-size": "dp", "-dp": "dp"}


@dataclass(frozen=True)
class PodSizing:
    shm_bytes: int | None  # sizeLimit of the memory-backed /dev/shm after injection (None:
    # the engine keeps nothing there; the pod's /dev/shm is left as it is)
    memory_increase_bytes: int  # added to the container's memory request (and limit, if set)


def chunk_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Bytes of one offloaded file's KV payload (storage.blockSize tokens)."""
    block = spec.storage.file_tokens if spec.storage else 16
    return block * spec.model.bytes_per_token


def native_backend(spec: TieredPrefixCacheSpec) -> StorageBackend | None:
    """The shared tier's effective backend under vLLM's OffloadingConnector (kvtier's
    unless the spec says vllm-fs); None without a shared tier or another connector."""
    if spec.storage is None or spec.connector != Connector.native:
        return None
    return StorageBackend(spec.storage.backend or StorageBackend.kvtier)


def io_buffer_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Bounce buffers of the kvtier backend: one chunk per I/O thread. Without a CPU tier
    the worker's aligned staging rows are written and read in place: none."""
    if native_backend(spec) != StorageBackend.kvtier or spec.gpu_direct:
        return 0
    assert spec.storage is not None
    threads = spec.storage.read_threads + spec.storage.write_threads
    return threads * chunk_bytes(spec)


def staging_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Pinned staging of one vLLM worker process without a CPU tier (max_staging_bytes)."""
    storage = spec.storage
    if storage is None or storage.staging_size is None:
        return GPU_DIRECT_STAGING_BYTES
    return quantity_bytes(storage.staging_size)


_WORD = re.compile(r"[^\s'\"]+")


def worker_processes(container: dict[str, Any]) -> int:
    """vLLM worker processes in one model-server container (each pins its own staging):
    its GPUs (any resources limit or request named */gpu), else the product of vLLM's
    tensor-, pipeline- and data-parallel sizes in its command and args, else 1."""
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        for name, value in (resources.get(kind) or {}).items():
            if name.endswith("/gpu") and str(value).isdigit() and int(value) > 0:
                return int(value)
    words: list[str] = []
    for part in (container.get("command") or []) + (container.get("args") or []):
        # Words split at whitespace and quotes (sh -c "vllm serve ... -tp 4" included), in
        # linear time: this runs in the admission webhook on any pod's command line.
        words += _WORD.findall(str(part))
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    for i, word in enumerate(words):
        flag, _, inline = word.partition("=")
        value = inline or (words[i + 1] if i + 1 < len(words) else "")
        if flag in PARALLEL_FLAGS and re.fullmatch(r"[1-9][0-9]{0,3}", value):
            sizes[PARALLEL_FLAGS[flag]] = int(value)
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def pod_sizing(spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
               workers: int = 1) -> PodSizing:
    """Sizes for one pod; existing_shm_bytes is the sizeLimit of a /dev/shm emptyDir the
    pod already has (0 for one without a limit is treated as none); workers: the vLLM
    worker processes in the container (worker_processes), each with its own staging."""
    cpu = spec.cpu_bytes
    before = existing_shm_bytes or 0
    if spec.gpu_direct:
        # Nothing in /dev/shm: each worker's staging is pinned process memory.
        shm = before or SHM_BASE_BYTES
        staging = staging_bytes(spec) * max(1, workers)
        increase = staging + (shm - before) + PROCESS_HEADROOM_BYTES
    elif spec.connector == Connector.native:
        # vLLM's CPU tier is an mmap in /dev/shm: it grows by exactly the tier.
        shm = round_up(before + cpu if before else cpu + SHM_BASE_BYTES, MIB)
        increase = (shm - before) + PROCESS_HEADROOM_BYTES + io_buffer_bytes(spec)
    else:
        # LMCache keeps its CPU tier in pinned process memory, not /dev/shm.
        shm = before or SHM_BASE_BYTES
        increase = cpu + (shm - before) + PROCESS_HEADROOM_BYTES
    return PodSizing(shm_bytes=shm, memory_increase_bytes=round_up(increase, MIB))


def router_lru_capacity(spec: TieredPrefixCacheSpec, block_size: int | None = None) -> int:
    """Router blocks the CPU tier of one replica holds (EPP lruCapacityPerServer), in
    blocks of block_size tokens (default: spec.router.blockSize, else vLLM's 16)."""
    block = block_size or spec.router.block_size or 16
    return spec.cpu_bytes // (spec.model.bytes_per_token * block)


def pinned_process_sizing(host_bytes: int, existing_shm_bytes: int | None) -> PodSizing:
    """An engine that pins its CPU tier in process memory and keeps nothing in /dev/shm:
    the memory request grows by the tier and the headroom; /dev/shm stays as it is."""
    return PodSizing(shm_bytes=None,
                     memory_increase_bytes=round_up(host_bytes + PROCESS_HEADROOM_BYTES, MIB))


# ------------------------------------------------------------- vLLM on TPU
# tpu-inference's TPUOffloadConnector: one CPU chunk is one vLLM block (page) of the TPU
# KV cache, all layers; the CPU tier holds TPU_OFFLOAD_NUM_CPU_CHUNKS of them in pinned
# host memory (each host of a multi-host replica its shard of every chunk); the staging
# buffer (TPU_OFFLOAD_NUM_STAGING_BLOCKS blocks) is carved out of HBM.
TPU_DEFAULT_STAGING_BLOCKS = 128  # tpu-inference's default


def tpu_chunk_bytes(spec: TieredPrefixCacheSpec) -> int:
    assert spec.tpu is not None
    return spec.tpu.page_size * spec.model.bytes_per_token


def tpu_cpu_chunks(spec: TieredPrefixCacheSpec) -> int:
    """TPU_OFFLOAD_NUM_CPU_CHUNKS: whole chunks that fit in cpu.size."""
    return spec.cpu_bytes // tpu_chunk_bytes(spec)


def tpu_staging_blocks(spec: TieredPrefixCacheSpec) -> int:
    """TPU_OFFLOAD_NUM_STAGING_BLOCKS: whole blocks in tpu.stagingSize, else the default."""
    assert spec.tpu is not None
    if spec.tpu.staging_size is None:
        return TPU_DEFAULT_STAGING_BLOCKS
    return quantity_bytes(spec.tpu.staging_size) // tpu_chunk_bytes(spec)


def tpu_host_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Pinned host memory of one TPU host (pod): its shard of every chunk."""
    assert spec.tpu is not None
    total = tpu_cpu_chunks(spec) * tpu_chunk_bytes(spec)
    return -(-total // spec.tpu.hosts)


def tpu_router_blocks(spec: TieredPrefixCacheSpec, router_block: int) -> int:
    """The CPU tier in the router's blocks: chunks x page tokens / router block tokens."""
    assert spec.tpu is not None
    return tpu_cpu_chunks(spec) * spec.tpu.page_size // router_block


# ------------------------------------------------------------------- KVBM


def kvbm_cpu_gb(spec: TieredPrefixCacheSpec) -> int:
    """DYN_KVBM_CPU_CACHE_GB: whole decimal GB of cpu.size (KVBM reads GB as 1e9 bytes;
    a whole number parses whether KVBM reads it as an integer or a float)."""
    return spec.cpu_bytes // GB


def lmcache_cpu_gb(spec: TieredPrefixCacheSpec) -> float:
    return round(spec.cpu_bytes / GB, 3)


def lmcache_disk_gb(spec: TieredPrefixCacheSpec) -> float:
    storage = spec.storage
    assert storage is not None
    if storage.max_size_per_replica is not None:
        return round(quantity_bytes(storage.max_size_per_replica) / GB, 3)
    assert storage.pvc is not None  # the model rejects existingClaim without a cap
    cap = quantity_bytes(storage.pvc.size) * spec.eviction.high_watermark // 100
    return round(cap / GB, 3)
