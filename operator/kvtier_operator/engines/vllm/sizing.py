"""vLLM's sizing on GPUs (OffloadingConnector, LMCache, KVBM); docs/sizing.md explains
each formula with examples.

All inputs are bytes or counts from the spec (and, for /dev/shm, the pod's existing
volume); nothing is guessed.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvtier_operator.api.quantity import GIB, MIB, quantity_bytes, round_up
from kvtier_operator.api.v1alpha1 import (
    DEFAULT_FILE_TOKENS,
    Connector,
    StorageBackend,
    TieredPrefixCacheSpec,
)
from kvtier_operator.engines.sizing import (
    GB,
    PROCESS_HEADROOM_BYTES,
    SHM_BASE_BYTES,
    PodSizing,
)

# Without a CPU tier: the pinned staging buffers of kvtier's offloading worker (its
# max_staging_bytes), which hold the KV pages of the transfers in flight. Every vLLM
# worker process (one per GPU) pins its own; spec.storage.hostStagingSize overrides it.
NO_CPU_TIER_STAGING_BYTES = 1 * GIB
# Without a CPU tier each file holds one vLLM chunk of GPU blocks (block_size tokens): by
# default DEFAULT_FILE_TOKENS, like the tiers (16x fewer files than one per 16-token GPU
# block, which makes a shared filesystem's metadata the bottleneck), halved while the
# worker's staging would hold fewer than STAGED_FILES of them (stores and loads stream
# through it piece by piece). An explicit blockSize must leave room for MIN_STAGED_FILES.
STAGED_FILES = 8
MIN_STAGED_FILES = 2
MIN_FILE_TOKENS = 16
INDEX_BYTES_PER_BLOCK = 8  # staging's GPU block id per 16-token block (at most)
# vLLM flags whose product is the worker processes of one engine, where the container
# does not say how many GPUs it has.
PARALLEL_FLAGS = {"--tensor-parallel-size": "tp", "-tp": "tp",
                  "--pipeline-parallel-size": "pp", "-pp": "pp",
                  "--data-parallel-size": "dp", "-dp": "dp"}


def block_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Bytes of one offloaded file's KV payload (storage.blockSize tokens)."""
    block = spec.storage.block_tokens if spec.storage else 16
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
    if native_backend(spec) != StorageBackend.kvtier or spec.no_cpu_tier:
        return 0
    assert spec.storage is not None
    threads = spec.storage.read_threads + spec.storage.write_threads
    return threads * block_bytes(spec)


def staging_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Pinned staging of one vLLM worker process without a CPU tier (max_staging_bytes)."""
    storage = spec.storage
    if storage is None or storage.staging_bytes is None:
        return NO_CPU_TIER_STAGING_BYTES
    return storage.staging_bytes


def staged_bytes(spec: TieredPrefixCacheSpec) -> int:
    """What kvtier's worker really pins of max_staging_bytes: the largest power of two
    that fits (PyTorch's pinned allocator rounds up to one)."""
    staging = staging_bytes(spec)
    return 1 << (staging.bit_length() - 1)


def direct_file_bytes(spec: TieredPrefixCacheSpec, tokens: int) -> int:
    """Staging one file of `tokens` tokens takes without a CPU tier: the KV of every
    layer (the whole model's bytes per token: a rank's share is at most that) and its
    blocks' id slots."""
    return tokens * spec.model.bytes_per_token + INDEX_BYTES_PER_BLOCK * (tokens // 16)


def direct_file_tokens(spec: TieredPrefixCacheSpec) -> int:
    """Tokens per file without a CPU tier (vLLM's block_size for kvtier's own spec):
    storage.blockSize where set, else DEFAULT_FILE_TOKENS halved (not below 16) until
    the worker's staging holds STAGED_FILES files of this model's KV."""
    storage = spec.storage
    if storage is not None and storage.block_size is not None:
        return storage.block_size
    tokens = DEFAULT_FILE_TOKENS
    while tokens > MIN_FILE_TOKENS and \
            STAGED_FILES * direct_file_bytes(spec, tokens) > staged_bytes(spec):
        tokens //= 2
    return tokens


_WORD = re.compile(r"[^\s'\"]+")


def _words(container: dict[str, Any]) -> list[str]:
    words: list[str] = []
    for part in (container.get("command") or []) + (container.get("args") or []):
        # Words split at whitespace and quotes (sh -c "vllm serve ... -tp 4" included), in
        # linear time: this runs in the admission webhook on any pod's command line.
        words += _WORD.findall(str(part))
    return words


def gpu_block_tokens(container: dict[str, Any]) -> int | None:
    """vLLM's GPU block size (`--block-size N` or `--block-size=N`) in the container's
    command and args; None where it is not given (vLLM picks it: 16 on most backends)."""
    words = _words(container)
    for i, word in enumerate(words):
        flag, _, inline = word.partition("=")
        value = inline or (words[i + 1] if i + 1 < len(words) else "")
        if flag == "--block-size" and re.fullmatch(r"[1-9][0-9]{0,4}", value):
            return int(value)
    return None


def worker_processes(container: dict[str, Any]) -> int:
    """vLLM worker processes in one model-server container (each pins its own staging):
    its GPUs (any resources limit or request named */gpu), else the product of vLLM's
    tensor-, pipeline- and data-parallel sizes in its command and args, else 1."""
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        for name, value in (resources.get(kind) or {}).items():
            if name.endswith("/gpu") and str(value).isdigit() and int(value) > 0:
                return int(value)
    words = _words(container)
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
    if spec.no_cpu_tier:
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


# ------------------------------------------------------------------- KVBM


def kvbm_cpu_gb(spec: TieredPrefixCacheSpec) -> int:
    """DYN_KVBM_CPU_CACHE_GB: whole decimal GB of cpu.size (KVBM reads GB as 1e9 bytes;
    a whole number parses whether KVBM reads it as an integer or a float)."""
    return spec.cpu_bytes // GB


def lmcache_gib(n_bytes: int) -> float:
    """An LMCache size setting for at most n_bytes. LMCache's sizes are GiB, whatever its
    docs say ("GB"): its allocators take int(size * 1024**3) bytes (0.5.6,
    local_cpu_backend.py and local_disk_backend.py; a test in tests/operator/engines reads
    the formula from the package). Floored to 1/1000 GiB, so the pool never exceeds the
    bytes the pod's memory request was sized for."""
    return math.floor(n_bytes * 1000 / GIB) / 1000


def lmcache_cpu_gb(spec: TieredPrefixCacheSpec) -> float:
    """LMCACHE_MAX_LOCAL_CPU_SIZE: cpu.size in GiB (see lmcache_gib)."""
    return lmcache_gib(spec.cpu_bytes)


def lmcache_disk_gb(spec: TieredPrefixCacheSpec) -> float:
    """LMCACHE_MAX_LOCAL_DISK_SIZE: storage.maxSizePerReplica, else the claim's size at
    the high watermark, in GiB (see lmcache_gib)."""
    storage = spec.storage
    assert storage is not None
    if storage.max_size_per_replica is not None:
        return lmcache_gib(quantity_bytes(storage.max_size_per_replica))
    assert storage.pvc is not None  # the model rejects existingClaim without a cap
    cap = quantity_bytes(storage.pvc.size) * spec.eviction.high_watermark // 100
    return lmcache_gib(cap)
