"""SGLang with HiCache (sglang 0.5.23): its CPU tier in pinned host memory per rank and
its file backend on the shared volume, configured by plain `--flag=value` words on the
server's command line (render/sglang_hicache.py renders them, render/sglang_flags.py
places them)."""

from __future__ import annotations

from typing import Any, ClassVar

from kvtier_operator.api.v1alpha1 import (
    Connector,
    Engine,
    SglangIoBackend,
    SglangPrefetchPolicy,
    SglangWritePolicy,
    TieredPrefixCache,
    TieredPrefixCacheSpec,
)
from kvtier_operator.engines.base import Adapter, Launcher, PodRole
from kvtier_operator.engines.cmdline.argv import MAX_COMMAND_CHARS, program_start
from kvtier_operator.engines.figures import PodFigures, Samples
from kvtier_operator.engines.sglang import entry as sglang_entry
from kvtier_operator.engines.sglang import flags as sglang_flags
from kvtier_operator.engines.sglang import hicache as sglang_hicache
from kvtier_operator.engines.sglang import metrics
from kvtier_operator.engines.sizing import GB, PodSizing, pinned_process_sizing

EVICTOR_LAYOUT = "sglang"  # kvtier_evictor.layouts.SGLANG


def _words(container: dict[str, Any]) -> list[str]:
    return [str(p) for p in (container.get("command") or []) + (container.get("args") or [])]


class SglangLauncher(Launcher):
    """`sglang serve` / `python -m sglang.launch_server`, in exec form or a `sh -c`
    script; options: the SGLang settings of the spec (a dict, see launch_options), turned
    into flags per container (--hicache-size depends on its ranks)."""

    label: ClassVar[str] = "SGLang"
    # SGLang's flags are plain words (hashed through the options); this is the text the
    # config hash has carried for SGLang pods since it was vLLM's for every engine: kept,
    # so running SGLang pods keep their hash.
    script_option: ClassVar[str] = ' --kv-transfer-config "$KVTIER_KV_TRANSFER_CONFIG"'
    command_words: ClassVar[str] = "'sglang serve' or 'python3 -m sglang.launch_server'"

    def runs_server(self, container: dict[str, Any]) -> bool:
        words = _words(container)
        start = program_start(words)
        if sglang_entry.entry_point_end(words, start) is not None:
            return True
        return sglang_entry.mentions_entry_point(" ".join(words))

    def own_offload_flags(self, line: str) -> list[str]:
        # SGLang's HiCache flags are read one by one in add_options: the same value is
        # kept, another one is a conflict naming it.
        return []

    def options_env(self, options: Any) -> dict[str, str]:
        return {}

    serving_port: ClassVar[int | None] = 30000  # the server's --port default
    metrics_port: ClassVar[int | None] = serving_port
    metric_families: ClassVar[frozenset[str]] = metrics.FAMILIES

    def read_metrics(self, samples: Samples, offloaded: tuple[str, ...]) -> PodFigures | None:
        return metrics.read(samples, offloaded)

    def add_options(self, container: dict[str, Any], options: Any) -> str:
        name = container.get("name")
        if len(" ".join(_words(container))) > MAX_COMMAND_CHARS:
            return (f"the command line of container {name!r} is longer than the "
                    f"{MAX_COMMAND_CHARS} characters kvtier reads: shorten it")
        file_tier = bool(options["fileTier"])
        problems: list[str] = []
        if file_tier:
            for entry in container.get("env") or []:
                if entry.get("name") in sglang_hicache.ENV_OWN_EVICTOR and entry.get(
                        "value") != sglang_hicache.OWN_EVICTOR_OFF:
                    problems.append(
                        f"container {name!r} sets {entry['name']}, which turns on SGLang's "
                        "own file evictor: on a shared volume it deletes other pods' pages "
                        "(kvtier's evictor bounds the volume); remove it")
        ranks = sglang_hicache.ranks(container)
        if sglang_hicache.hicache_size_gb(options["cpuBytes"], ranks) < 1:
            problems.append(
                f"spec.cpu.size gives container {name!r} under 1 GB per rank over its "
                f"{ranks} rank(s) (SGLang's --hicache-size is whole GB per rank, and 0 "
                "means a size from --hicache-ratio); raise spec.cpu.size")
            return "; ".join(problems)
        flags = sglang_hicache.flags(
            cpu_bytes=options["cpuBytes"], rank_count=ranks,
            write_policy=SglangWritePolicy(options["writePolicy"]),
            io_backend=SglangIoBackend(options["ioBackend"]), page_size=options["pageSize"],
            file_tier=file_tier,
            prefetch_policy=SglangPrefetchPolicy(options["prefetchPolicy"])
            if "prefetchPolicy" in options else None)
        # With a problem already, the pod stays as it was (inject() keeps the original);
        # the flags are still read so that every conflict is reported at once.
        problems += sglang_flags.add_flags(container, flags, sglang_hicache.forbidden(file_tier))
        return "; ".join(problems)


SGLANG = SglangLauncher()


class SglangHicache(Adapter):
    engine = Engine.sglang
    connector = Connector.native
    title = ("SGLang HiCache: CPU tier in pinned host memory per rank, shared file tier by "
             "SGLang's file backend (its own evictor off; kvtier's evictor instead)")
    launcher = SGLANG
    takes_storage: ClassVar[bool] = True
    storage_backends = ()  # SGLang's own file backend: spec.storage.backend stays unset
    # HiCache's KV-event media: the host pool is CPU_TIER1, the file tier CPU_TIER2.
    router_media: ClassVar[dict[str, str]] = {
        "gpu": "GPU", "cpu": "CPU_TIER1", "storage": "CPU_TIER2"}
    settings_block: ClassVar[str | None] = "sglang"

    def validate(self, spec: TieredPrefixCacheSpec) -> None:
        super().validate(spec)
        if spec.cpu_bytes < GB:
            raise ValueError(f"spec.cpu.size {spec.cpu.size if spec.cpu else 0} is under "
                             "1 GB, the smallest HiCache size SGLang takes per rank; raise it")
        s = spec.storage
        if s is not None:
            for field, value in (("blockSize", s.block_size),
                                 ("hostStagingSize", s.host_staging_size),
                                 ("stagingSize", s.staging_size),
                                 ("maxSizePerReplica", s.max_size_per_replica),
                                 ("directIO", s.direct_io)):
                if value is not None:
                    raise ValueError(
                        f"spec.storage.{field} does not apply to engine sglang (a shared-tier "
                        "file holds one page of spec.sglang.pageSize tokens); remove it")
        page = spec.sglang.page_size if spec.sglang is not None else None
        if page is not None and spec.router.block_size not in (None, page):
            raise ValueError(
                f"spec.router.blockSize {spec.router.block_size} differs from "
                f"spec.sglang.pageSize {page}: the router scores SGLang in its pages; remove "
                "router.blockSize (it defaults to the page size)")

    def launch_options(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        spec = tpc.spec
        settings = spec.sglang
        assert settings is not None  # check_spec requires the block
        options = {"cpuBytes": spec.cpu_bytes, "pageSize": settings.page_size,
                   "writePolicy": str(settings.write_policy),
                   "ioBackend": str(settings.io_backend), "fileTier": spec.storage is not None}
        if spec.storage is not None:
            # Only with the file tier (which it is about): CPU-only pods keep their hash.
            options["prefetchPolicy"] = str(settings.prefetch_policy)
        return options

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        storage = tpc.spec.storage
        return super().env(tpc, role) | sglang_hicache.env(
            storage.mount_path if storage is not None else None, tpc.spec.sglang)

    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        # The host pools are pinned process memory; /dev/shm is the user's (NCCL). SGLang
        # wants its host reserve free below the limit on top of the pools.
        return pinned_process_sizing(
            spec.cpu_bytes + sglang_hicache.HOST_MEMORY_RESERVE_BYTES, existing_shm_bytes)

    def tier_directory(self, spec: TieredPrefixCacheSpec) -> str:
        return sglang_hicache.STORAGE_DIR

    def evictor_layout(self, spec: TieredPrefixCacheSpec) -> str | None:
        return EVICTOR_LAYOUT if spec.storage is not None else None

    def router_block_size(self, spec: TieredPrefixCacheSpec) -> int:
        if spec.sglang is not None:
            return spec.sglang.page_size
        return super().router_block_size(spec)
