"""Recapture the /metrics fixtures in tests/fixtures/metrics/ from real vLLM API servers
(never write them by hand):

    .venv/bin/python -m tests.e2e.capture_metrics [--cpu-only] [--only NAME,...] [OUT_DIR]

Servers one after the other, on the tiny model, each page saved with the installed
vLLM's version in its file name (NAMES, in order):

- `gpu-direct`: kvtier's GPU-direct OffloadingSpec as the operator renders it, two
  servers on one shared root: A answers the e2e prompt twice (stores its blocks; the
  second time hits its own HBM), B (a cold process) answers it once and loads the blocks
  from the files. Each server's page before its first request (`-idle`, what the
  operator's first read sees) and after.
- `cpu-tier-c`: vLLM's own CPU tier (its worker replaced by one that moves no data,
  tests/e2e/noop_cpu_spec.py): the prompt, the HBM prefix cache reset, the prompt again
  (`cpu-tier-c-hit`).
- `cpu-storage-t`: the same under vLLM's TieringOffloadingSpec with kvtier's storage tier
  as the operator renders it (on 0.33 its `vllm:kv_offload_config_info` has a series per
  tier, by the `tier` label).
- `cpu-storage-u`: a second such server on the same volume (its CPU tier empty) answers
  the prompt: vLLM promotes the blocks from kvtier's storage tier into the CPU tier
  (`vllm:kv_offload_tiering_read_*{tier="1:KvtierStorageTier"}`; `cpu-storage-u-loaded`).
- `gpu-direct-s`: GPU-direct with the recompute bound on, on a slow volume (every stat
  and open of a block file first sleeps SLOW_MS, tests/e2e/shims/slow_volume.c
  preloaded) that holds the blocks of CACHED prompts (a first server on the same volume
  wrote them): after WARM_UP other prompts (the engine has measured its prefill rate)
  each cached prompt recomputes rather than wait for the volume, and
  `kvtier_offload_tier_skipped_total` counts it (`gpu-direct-s-skipped`).
- `cpu-local-storage-v`: kvtier's local-disk tier and its storage tier behind the CPU
  tier (examples/native-local-disk.yaml). One server answers prompt 1 (its blocks go to
  the shared volume, and to a local disk of its own), another prompt 2 (into the local
  disk that a third server then opens, and the volume). The third, its CPU tier empty,
  answers both: prompt 1 from the volume, prompt 2 from the local disk. vLLM counts both
  as source "disk"; kvtier's series say which tier served which (`-v-idle`, `-v-hit`).
- `cpu-storage-w`: kvtier's storage tier on a slow volume (every open of a temp file
  first sleeps SLOW_MS, the same shim) with one write thread and a write queue of
  DROP_QUEUE_S: the stores that wait longer are dropped, and
  `kvtier_offload_dropped_writes_total` counts them (`-w-idle`, `-w-dropped`).

Takes a few minutes per name on 2 cores; --cpu-only skips the GPU-direct servers.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.engine import make_model
from tests.e2e.observe_server import (
    api_server,
    complete,
    cpu_tier_config,
    metrics_page,
    reset_hbm_prefix_cache,
    tiering_config,
)
from tests.helpers import ROOT

OUT = ROOT / "tests" / "fixtures" / "metrics"
NAMES = ("gpu-direct", "cpu-tier-c", "cpu-storage-t", "cpu-storage-u", "gpu-direct-s",
         "cpu-local-storage-v", "cpu-storage-w")
GPU_DIRECT = ("gpu-direct", "gpu-direct-s")
SHIM = ROOT / "tests" / "e2e" / "shims" / "slow_volume.c"
SLOW_MS = 1500
WARM_UP = (41, 42, 43, 44)  # other prompts, never cached: the prefill rate is measured
CACHED = tuple(range(1, 25))  # prompts whose blocks the slow volume holds (6 files each)
DROP_QUEUE_S = 0.5  # cpu-storage-w: the storage tier's write queue, seconds
DROP_PROMPTS = tuple(range(51, 59))  # cpu-storage-w: prompts whose stores queue up


def _files_landed(root: Path, count: int, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while len(list(root.rglob("*.kvb"))) < count and time.monotonic() < deadline:
        time.sleep(0.5)


def capture(out: Path, names: tuple[str, ...] = NAMES) -> list[Path]:
    import vllm

    version = ".".join(vllm.__version__.split(".")[:2])
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(pages: dict[str, str]) -> None:
        for label, page in pages.items():
            path = out / f"vllm-{version}-{label}.txt"
            path.write_text(page)
            written.append(path)

    with tempfile.TemporaryDirectory() as tmp:
        model, root = Path(tmp) / "model", Path(tmp) / "D"
        make_model(str(model))
        if "gpu-direct" in names:
            for name, asks in (("a-stored", 2), ("b-loaded", 1)):
                with api_server(model, root, Path(tmp) / f"{name}.log") as url:
                    pages = {f"gpu-direct-{name[0]}-idle": metrics_page(url)}
                    for _ in range(asks):
                        complete(url)
                    pages[f"gpu-direct-{name}"] = metrics_page(url, settle_s=3)
                save(pages)
        # vLLM's own CPU tier, its worker a no-op (it cannot run on CPU): the prompt,
        # the HBM prefix cache reset, the prompt again: a CPU-tier hit. Alone, then with
        # kvtier's storage tier behind it (which the second server then loads from).
        tiered = Path(tmp) / "T"
        for name, kv in (("cpu-tier-c", cpu_tier_config()),
                         ("cpu-storage-t", tiering_config(tiered))):
            if name not in names and not (name == "cpu-storage-t" and
                                          "cpu-storage-u" in names):
                continue
            with api_server(model, None, Path(tmp) / f"{name}.log", kv=kv) as url:
                pages = {f"{name}-idle": metrics_page(url)}
                complete(url)
                time.sleep(2)
                reset_hbm_prefix_cache(url)
                complete(url)
                pages[f"{name}-hit"] = metrics_page(url, settle_s=3)
            if name in names:
                save(pages)
        if "cpu-storage-u" in names:
            _files_landed(tiered, 3)
            with api_server(model, None, Path(tmp) / "cpu-storage-u.log",
                            kv=tiering_config(tiered)) as url:
                pages = {"cpu-storage-u-idle": metrics_page(url)}
                complete(url)
                pages["cpu-storage-u-loaded"] = metrics_page(url, settle_s=3)
            save(pages)
        if "cpu-local-storage-v" in names:
            save(_local_and_shared(model, Path(tmp)))
        if "cpu-storage-w" in names:
            save(_dropped_writes(model, Path(tmp)))
        if "gpu-direct-s" in names:
            slow_root = Path(tmp) / "S"
            with api_server(model, slow_root, Path(tmp) / "s-store.log") as url:
                for seed in CACHED:
                    complete(url, seed=seed, max_tokens=1)
            _files_landed(slow_root, 6 * len(CACHED))
            shim = _shim(Path(tmp))
            with api_server(model, slow_root, Path(tmp) / "s.log",
                            extra_config={"recompute_bound": True},
                            extra_env={"LD_PRELOAD": str(shim),
                                       "KVTIER_TEST_SLOW_SUFFIX": ".kvb",
                                       "KVTIER_TEST_SLOW_MS": str(SLOW_MS)}) as url:
                pages = {"gpu-direct-s-idle": metrics_page(url)}
                for seed in WARM_UP:
                    complete(url, seed=seed, max_tokens=2)
                for seed in CACHED:
                    complete(url, seed=seed, max_tokens=1)
                pages["gpu-direct-s-skipped"] = metrics_page(url, settle_s=3)
            save(pages)
    return written


def _shim(tmp: Path) -> Path:
    shim = tmp / "slow_volume.so"
    if not shim.exists():
        gcc = shutil.which("gcc") or shutil.which("cc") or "gcc"
        subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(shim), str(SHIM), "-ldl"],
                       check=True)
    return shim


def _local_and_shared(model: Path, tmp: Path) -> dict[str, str]:
    """cpu-local-storage-v (see the module docstring)."""
    shared, local = tmp / "V", tmp / "V-local"
    for seed, disk in ((1, tmp / "V-other-node"), (2, local)):
        with api_server(model, None, tmp / f"v-store-{seed}.log",
                        kv=tiering_config(shared, local=disk)) as url:
            complete(url, seed=seed)
            _files_landed(disk, 3)
            _files_landed(shared, 3 * seed)
    with api_server(model, None, tmp / "v.log",
                    kv=tiering_config(shared, local=local)) as url:
        pages = {"cpu-local-storage-v-idle": metrics_page(url)}
        complete(url, seed=1)
        complete(url, seed=2)
        pages["cpu-local-storage-v-hit"] = metrics_page(url, settle_s=3)
    return pages


def _dropped_writes(model: Path, tmp: Path) -> dict[str, str]:
    """cpu-storage-w (see the module docstring)."""
    kv = tiering_config(tmp / "W", n_write_threads=1, write_queue_seconds=DROP_QUEUE_S)
    with api_server(model, None, tmp / "w.log", kv=kv,
                    extra_env={"LD_PRELOAD": str(_shim(tmp)),
                               "KVTIER_TEST_SLOW_SUFFIX": ".tmp",
                               "KVTIER_TEST_SLOW_MS": str(SLOW_MS)}) as url:
        pages = {"cpu-storage-w-idle": metrics_page(url)}
        for seed in DROP_PROMPTS:
            complete(url, seed=seed, max_tokens=2)
        pages["cpu-storage-w-dropped"] = metrics_page(url, settle_s=3 + SLOW_MS / 1000)
    return pages


def main(argv: list[str]) -> None:
    names, args = NAMES, []
    it = iter(argv)
    for arg in it:
        if arg == "--cpu-only":
            names = tuple(n for n in names if n not in GPU_DIRECT)
        elif arg == "--only":
            wanted = next(it, "").split(",")
            unknown = set(wanted) - set(NAMES)
            if unknown:
                raise SystemExit(f"--only takes some of {', '.join(NAMES)}; not {unknown}")
            names = tuple(n for n in names if n in wanted)
        else:
            args.append(arg)
    for p in capture(Path(args[0]) if args else OUT, names):
        print(p)


if __name__ == "__main__":
    main(sys.argv[1:])
