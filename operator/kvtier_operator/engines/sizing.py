"""Sizing every engine shares: the pod's memory request increase and /dev/shm
(`PodSizing`), and the headroom beyond a tier. Each engine's formulas live with it
(engines/<engine>/sizing.py); docs/sizing.md explains them with examples."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier_operator.api.quantity import GIB, MIB, round_up

# /dev/shm beyond the CPU tier: NCCL buffers, torch multiprocessing and the engine's IPC.
SHM_BASE_BYTES = 2 * GIB
# Process memory beyond the tier itself: block tables, page tables, Python objects.
PROCESS_HEADROOM_BYTES = 1 * GIB
GB = 10**9  # LMCache, KVBM and SGLang sizes are in decimal GB


@dataclass(frozen=True)
class PodSizing:
    shm_bytes: int | None  # sizeLimit of the memory-backed /dev/shm after injection (None:
    # the engine keeps nothing there; the pod's /dev/shm is left as it is)
    memory_increase_bytes: int  # added to the container's memory request (and limit, if set)


def pinned_process_sizing(host_bytes: int, existing_shm_bytes: int | None) -> PodSizing:
    """An engine that pins its CPU tier in process memory and keeps nothing in /dev/shm:
    the memory request grows by the tier and the headroom; /dev/shm stays as it is."""
    return PodSizing(shm_bytes=None,
                     memory_increase_bytes=round_up(host_bytes + PROCESS_HEADROOM_BYTES, MIB))
