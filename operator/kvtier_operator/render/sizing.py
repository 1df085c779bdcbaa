"""Every sizing formula kvtier applies; docs/sizing.md explains each with examples.

All inputs are bytes or counts from the spec (and, for /dev/shm, the pod's existing
volume); nothing is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier_operator.models import Connector, StorageBackend, TieredPrefixCacheSpec
from kvtier_operator.quantity import GIB, MIB, quantity_bytes, round_up

# /dev/shm beyond the CPU tier: NCCL buffers, torch multiprocessing and vLLM's IPC.
SHM_BASE_BYTES = 2 * GIB
# Process memory beyond the tier itself: block tables, page tables, Python objects.
PROCESS_HEADROOM_BYTES = 1 * GIB
GB = 10**9  # LMCache sizes are in decimal GB
# Without a CPU tier: the pinned staging buffers of kvtier's offloading worker (its
# max_staging_bytes), which hold the KV pages of the transfers in flight.
GPU_DIRECT_STAGING_BYTES = 1 * GIB


@dataclass(frozen=True)
class PodSizing:
    shm_bytes: int  # sizeLimit of the memory-backed /dev/shm after injection
    memory_increase_bytes: int  # added to the container's memory request (and limit, if set)


def chunk_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Bytes of one offloaded file's KV payload (storage.blockSize tokens)."""
    block = spec.storage.file_tokens if spec.storage else 16
    return block * spec.model.bytes_per_token


def io_buffer_bytes(spec: TieredPrefixCacheSpec) -> int:
    """Bounce buffers of the kvtier backend: one chunk per I/O thread. Without a CPU tier
    the worker's aligned staging rows are written and read in place: none."""
    if spec.storage_backend != StorageBackend.kvtier or spec.gpu_direct:
        return 0
    assert spec.storage is not None
    threads = spec.storage.read_threads + spec.storage.write_threads
    return threads * chunk_bytes(spec)


def pod_sizing(spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None) -> PodSizing:
    """Sizes for one pod; existing_shm_bytes is the sizeLimit of a /dev/shm emptyDir the
    pod already has (0 for one without a limit is treated as none)."""
    cpu = spec.cpu_bytes
    before = existing_shm_bytes or 0
    if spec.gpu_direct:
        # Nothing in /dev/shm: the worker's staging is pinned process memory.
        shm = before or SHM_BASE_BYTES
        increase = GPU_DIRECT_STAGING_BYTES + (shm - before) + PROCESS_HEADROOM_BYTES
    elif spec.connector == Connector.native:
        # vLLM's CPU tier is an mmap in /dev/shm: it grows by exactly the tier.
        shm = round_up(before + cpu if before else cpu + SHM_BASE_BYTES, MIB)
        increase = (shm - before) + PROCESS_HEADROOM_BYTES + io_buffer_bytes(spec)
    else:
        # LMCache keeps its CPU tier in pinned process memory, not /dev/shm.
        shm = before or SHM_BASE_BYTES
        increase = cpu + (shm - before) + PROCESS_HEADROOM_BYTES
    return PodSizing(shm_bytes=shm, memory_increase_bytes=round_up(increase, MIB))


def router_lru_capacity(spec: TieredPrefixCacheSpec) -> int:
    """Router blocks the CPU tier of one replica holds (EPP lruCapacityPerServer)."""
    return spec.cpu_bytes // (spec.model.bytes_per_token * spec.router.block_size)


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
