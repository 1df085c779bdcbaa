"""SGLang HiCache (sglang 0.5.23): the flags and env that give an SGLang server kvtier's
CPU tier and shared file tier. Pure; docs/sizing.md explains --hicache-size.

- CPU tier: `--enable-hierarchical-cache --hicache-size=<GB per rank>` plus the write
  policy, the host<->GPU I/O backend and the page size (the router scores in pages of
  this many tokens: they must agree).
- Shared file tier: `--hicache-storage-backend=file`, the prefetch policy (llm-d's guide:
  wait_complete), SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=<mount>/sglang (the evictor's
  `sglang` layout) and the file backend's metadata cache (on, 5 s, as in the guide).
  SGLang's own LRU file evictor stays off (it turns on with a max size or a minimum free
  space): on a shared volume every pod of a model owns the same file suffixes and would
  delete the others' pages. kvtier's evictor CronJob bounds the volume instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier_operator.api.v1alpha1 import (
    SglangIoBackend,
    SglangPrefetchPolicy,
    SglangSettings,
    SglangWritePolicy,
)
from kvtier_operator.engines.sglang.flags import (
    CONFIG_FILE,
    Flag,
    Forbidden,
    existing_flags,
)
from kvtier_operator.engines.sizing import GB

DEFAULT_PAGE_SIZE = 64  # llm-d's SGLang guides and the router scorer's default block size
# --hicache-size is in decimal gigabytes (host_size * 1e9 in sglang): GB below.
# SGLang checks each rank's pool against the container's cgroup headroom (limit minus
# usage) less this reserve, even with an explicit --hicache-size
# (mem_cache/pool_host/base.py HICACHE_HOST_MEMORY_RESERVE_BYTES): the memory kvtier
# adds must cover it, or a pod whose own limit was tight refuses to start.
HOST_MEMORY_RESERVE_BYTES = 10 * 2**30
STORAGE_DIR = "sglang"  # below the volume mount; the evictor's `sglang` layout
ENV_STORAGE_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
# The file backend's cache of which pages exist (sglang/srt/environ.py: EnvBool, EnvFloat).
ENV_METADATA_CACHE = "SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE"
ENV_METADATA_TTL = "SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL"
# Env that would turn on SGLang's own size-capped evictor (sglang/srt/environ.py).
ENV_OWN_EVICTOR = ("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
                   "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE")
# Its extra config may carry max_size/min_free_space (the same evictor) or another
# file_storage_path; kvtier cannot vouch for it.
EXTRA_CONFIG = Forbidden(
    "--hicache-storage-backend-extra-config",
    "its max_size or min_free_space would turn on SGLang's own file evictor, which on a "
    "shared volume deletes other pods' pages (kvtier's evictor bounds the volume); remove "
    "it")


# Flags that say how many ranks (one per GPU) share the pod's CPU tier, with the
# spellings SGLang accepts (`--tp` is argparse's abbreviation of --tp-size, common in
# SGLang's docs; `--pp` and `--dp` are ambiguous there, so SGLang refuses them).
RANK_FLAGS = (
    Flag("--tp-size", "1", "", aliases=("--tensor-parallel-size", "--tp")),
    Flag("--pp-size", "1", "", aliases=("--pipeline-parallel-size",)),
    Flag("--dp-size", "1", "", aliases=("--data-parallel-size",)),
)


def ranks(container: dict[str, Any]) -> int:
    """SGLang ranks in the container, each with its own host pool: its GPUs (a resources
    limit or request named */gpu), else the product of --tp-size, --pp-size and
    --dp-size on its command line, else 1."""
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        for name, value in (resources.get(kind) or {}).items():
            if name.endswith("/gpu") and str(value).isdigit() and int(value) > 0:
                return int(value)
    values, _ = existing_flags(container, RANK_FLAGS, forbidden=())
    product = 1
    for flag in RANK_FLAGS:
        value = values.get(flag.name) or "1"
        product *= int(value) if value.isdigit() and 0 < int(value) < 10**4 else 1
    return product


def hicache_size_gb(cpu_bytes: int, rank_count: int) -> int:
    """--hicache-size: the CPU tier of one replica split over its ranks, in whole decimal
    GB, rounded down (the pod's memory is raised by the tier, never less than used)."""
    return cpu_bytes // (max(rank_count, 1) * GB)


def flags(*, cpu_bytes: int, rank_count: int, write_policy: SglangWritePolicy,
          io_backend: SglangIoBackend, page_size: int, file_tier: bool,
          prefetch_policy: SglangPrefetchPolicy | None = None) -> list[Flag]:
    """The flags kvtier gives SGLang, each with the spec field it comes from."""
    out = [
        Flag("--enable-hierarchical-cache", None, "spec.cpu", aliases=("--enable-hicache",)),
        Flag("--hicache-size", str(hicache_size_gb(cpu_bytes, rank_count)),
             f"spec.cpu.size over {rank_count} rank(s)"),
        Flag("--hicache-write-policy", str(write_policy), "spec.sglang.writePolicy"),
        Flag("--hicache-io-backend", str(io_backend), "spec.sglang.ioBackend"),
        Flag("--page-size", str(page_size), "spec.sglang.pageSize"),
    ]
    if file_tier:
        out.append(Flag("--hicache-storage-backend", "file", "spec.storage"))
        if prefetch_policy is not None:
            out.append(Flag("--hicache-storage-prefetch-policy", str(prefetch_policy),
                            "spec.sglang.prefetchPolicy"))
    return out


def forbidden(file_tier: bool) -> Sequence[Forbidden]:
    return (CONFIG_FILE, EXTRA_CONFIG) if file_tier else (CONFIG_FILE,)


# "0" turns each off (sglang/srt/environ.py); set explicitly, it also wins over the same
# names from a ConfigMap or Secret (envFrom), which the webhook cannot read.
OWN_EVICTOR_OFF = "0"


def storage_dir(mount_path: str) -> str:
    """The file tier's directory on the shared volume."""
    return f"{mount_path.rstrip('/')}/{STORAGE_DIR}"


def env(mount_path: str | None, settings: SglangSettings | None = None) -> dict[str, str]:
    """Env SGLang needs: the file tier's directory, its metadata cache, and its own
    evictor held off, when there is one."""
    if mount_path is None:
        return {}
    out = {ENV_STORAGE_DIR: storage_dir(mount_path)} | {
        name: OWN_EVICTOR_OFF for name in ENV_OWN_EVICTOR}
    if settings is not None:
        out[ENV_METADATA_CACHE] = "true" if settings.metadata_cache else "false"
        if settings.metadata_cache:
            out[ENV_METADATA_TTL] = repr(float(settings.metadata_cache_ttl_seconds))
    return out
