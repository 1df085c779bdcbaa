"""kvtier's GPU offload path against the raw DMA it is built on (needs CUDA; without it
this prints that it skips).

- B0 raw pinned `copy_` device->host, host->device and both at once on two streams,
  2 MiB to 2 GiB: the anchor every other figure is divided by (same size, same run);
- B1 vLLM's own block DMA (`vllm._custom_ops.swap_blocks_batch`, one descriptor per
  (block, layer) page, as its CPU offloading worker does) on the same pages, where the
  installed vLLM has it;
- B2 kvtier's device phase alone: the worker's gather/scatter through its staging
  region, block store idle, timed with CUDA events, contiguous and random block ids;
  and the wall time of submit_store while the GPU is busy;
- B3 GPU -> file -> GPU through the real block store on tmpfs (a temp dir on disk
  where mounting is not permitted), polled as vLLM polls: every run stores fresh keys
  (a directory per shape), its store figure lasts until the files are written (stores
  are acknowledged to vLLM at the device copy, before the write), and each run's files
  are removed after its load, so the scratch volume holds one job at a time;
- F the volume's own parallel file floor on the same scratch: plain 2 MiB file writes
  and reads on 16 threads, no kvtier; B3 is also given as a ratio to the slower of
  pinned DMA and this floor;
- B4 files of one 16-token GPU block against 256-token files (vLLM's chunk of 16 blocks,
  GPU-direct's default now), the same job end to end: GB/s of each, per byte;
- B5 the engine step's p50/p99 with and without offload: a fixed HBM-bound kernel loop
  (a CUDA graph of matrix-vector products over 512 MiB, standing in for a decode step's
  weight reads) ended by a small blocking D2H (the sampled tokens), on the compute stream;
  with offload each step first polls (get_finished) and submits a 256-token-file store
  of fresh keys, and every other step a load of files stored before, as vLLM's worker
  does; baseline and offload phases alternate in rounds on the same warm GPU.

Shapes: 32 layers x 64 KiB pages (an 8B model at TP1) and 80 x 8 KiB (70B at TP8).
Medians of KVTIER_BENCH_GPU_RUNS runs (20) after 5 warm-ups; KVTIER_BENCH_GPU_QUICK=1
runs a small subset (what the GPU test suite uses to check this file works). Without
vLLM (torch alone, as on the GPU machines this project borrows) the worker's few vLLM
types come from tests/offload/vllm032.py and B1 says it cannot run. run() returns every
figure as rows (scripts/gpu_check.py writes them into its report).
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MiB = 1 << 20
QUICK = os.environ.get("KVTIER_BENCH_GPU_QUICK") == "1"
RUNS = 3 if QUICK else int(os.environ.get("KVTIER_BENCH_GPU_RUNS", "20"))
WARMUP = 1 if QUICK else 5
RAW_SIZES = (2 * MiB, 64 * MiB) if QUICK else (2 * MiB, 8 * MiB, 64 * MiB, 512 * MiB,
                                                2048 * MiB)
SHAPES = {"8B-TP1 32x64KiB": (32, 64 << 10), "70B-TP8 80x8KiB": (80, 8 << 10)}
JOB_BLOCKS = (1, 16) if QUICK else (1, 16, 256, 1024)
STAGING = (256 * MiB) if QUICK else (4 << 30)
FLOOR_FILE = 2 * MiB
FLOOR_THREADS = 16
FLOOR_BYTES = (256 * MiB) if QUICK else (2 << 30)
FILE_BLOCKS = 16  # 256-token files: vLLM's chunk of 16 16-token GPU blocks
B4_BLOCKS = 32 if QUICK else 256  # the job B4 stores and loads both ways
STEP_ROUNDS = 2 if QUICK else 6  # B5: alternating baseline and offload phases
STEPS = 10 if QUICK else 40  # B5: engine steps per phase
STEP_STORE_BLOCKS = FILE_BLOCKS  # B5: a 256-token store every step
STEP_MATRIX = (4096, 16384) if QUICK else (16384, 16384)  # B5: bf16 weights per product
STEP_PRODUCTS = 8 if QUICK else 24  # B5: products per step
HEADROOM = 64 * MiB  # file headers, directories, the free-space floor's 2%


def scratch_bytes() -> int:
    """What B3, B4, B5 and F write at most at once: the largest job of the largest shape
    (one job's files at a time), B5's round (its warm files and a store per step), or
    the floor's files, plus headroom."""
    block = max(layers * page for layers, page in SHAPES.values())
    step_round = (4 + STEPS) * STEP_STORE_BLOCKS * block
    job = block * max(*JOB_BLOCKS, B4_BLOCKS)
    return int(max(job, step_round, FLOOR_BYTES) * 1.05) + HEADROOM


def _use_vllm_types() -> str:
    """vLLM's own kv_offload types where vLLM imports, else the test-only stand-in;
    says which."""
    from tests.offload.vllm032 import install, is_shim

    install()

    return "tests/offload/vllm032.py (no vLLM)" if is_shim() else "vLLM"


ROWS: list[dict[str, Any]] = []  # every figure of this run, for run()'s caller


def _row(section: str, **figures: Any) -> None:
    """Keep a figure; with KVTIER_BENCH_GPU_ROWS, also in that JSON file at once, so a
    run stopped by its time limit still reports what it measured."""
    ROWS.append({"section": section, **figures})
    path = os.environ.get("KVTIER_BENCH_GPU_ROWS")
    if path:
        import json

        with open(path + ".tmp", "w") as f:
            json.dump(ROWS, f)
        os.replace(path + ".tmp", path)


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    return None


def _median_seconds(fn: Callable[[], None], streams: list[Any]) -> float:
    """Median GPU time of fn's work on `streams`, between CUDA events."""
    import torch

    times = []
    for i in range(WARMUP + RUNS):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for stream in streams:
            stream.wait_event(start)
        fn()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy(stream: Any, dst: Any, src: Any) -> None:
    import torch

    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s"


def raw_dma() -> dict[tuple[str, int], float]:
    """B0: seconds per copy of each size and direction."""
    import torch

    out: dict[tuple[str, int], float] = {}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    print("\n### B0 raw pinned DMA (the anchor)\n")
    print("| size | D2H | H2D | both at once (each) |")
    print("|---|---|---|---|")
    for size in RAW_SIZES:
        dev = torch.empty(2 * size, dtype=torch.int8, device="cuda")
        host = torch.empty(2 * size, dtype=torch.int8, pin_memory=True)
        d_a, d_b, h_a, h_b = dev[:size], dev[size:], host[:size], host[size:]

        d2h = functools.partial(_copy, s1, h_a, d_a)
        h2d = functools.partial(_copy, s2, d_b, h_b)

        def both(d2h: Callable[[], None] = d2h, h2d: Callable[[], None] = h2d) -> None:
            d2h()
            h2d()

        out["d2h", size] = _median_seconds(d2h, [s1])
        out["h2d", size] = _median_seconds(h2d, [s2])
        out["both", size] = _median_seconds(both, [s1, s2])
        _row("B0", bytes=size, d2h_gbps=size / out["d2h", size] / 1e9,
             h2d_gbps=size / out["h2d", size] / 1e9, both_gbps=size / out["both", size] / 1e9)
        print(f"| {size // MiB} MiB | {_gbps(size, out['d2h', size])} | "
              f"{_gbps(size, out['h2d', size])} | {_gbps(size, out['both', size])} |")
        del dev, host
    return out


def _anchor(raw: dict[tuple[str, int], float], direction: str, nbytes: int) -> float:
    """Raw DMA seconds for nbytes: measured at the nearest size, scaled linearly."""
    size = min(RAW_SIZES, key=lambda s: abs(np.log2(s) - np.log2(max(nbytes, 1))))
    return raw[direction, size] * nbytes / size


def _kv(layers: int, page: int, num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    tensors = [CanonicalKVCacheTensor(
        torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, device="cuda"), page)
        for _ in range(layers)]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[[]])


def _ids(count: int, num_blocks: int, random: bool) -> np.ndarray:
    if random:
        return np.sort(np.random.default_rng(count).permutation(num_blocks)[:count])
    return np.arange(count, dtype=np.int64)


def _swap(swap: Callable[..., None], stream: Any, src: Any, dst: Any, sizes: Any,
          any_order: bool) -> None:
    import torch

    with torch.cuda.stream(stream):
        swap(src, dst, sizes, any_order)


def vllm_dma(raw: dict[tuple[str, int], float]) -> None:
    """B1: vLLM's swap_blocks_batch, one descriptor per (block, layer) page."""
    import torch

    try:
        from vllm import _custom_ops as ops

        swap = ops.swap_blocks_batch
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018 (present in CUDA builds only)
    except (ImportError, AttributeError, RuntimeError) as err:
        print(f"\n### B1 vLLM swap_blocks_batch: not callable here ({err})")
        _row("B1", skipped=f"not callable here ({err})")
        return
    print("\n### B1 vLLM swap_blocks_batch on the same pages (ratio to B0)\n")
    print("| shape | blocks | size | D2H | ratio | H2D | ratio |")
    print("|---|---|---|---|---|---|---|")
    stream = torch.cuda.Stream()
    for name, (layers, page) in SHAPES.items():
        num_blocks = max(JOB_BLOCKS) + 64
        caches = _kv(layers, page, num_blocks)
        row = layers * page
        host = torch.empty((max(JOB_BLOCKS), row), dtype=torch.int8, pin_memory=True)
        for blocks in JOB_BLOCKS:
            ids = _ids(blocks, num_blocks, random=True)
            gpu = np.array([[t.tensor.data_ptr() + int(b) * t.tensor.stride(0)
                             for t in caches.tensors] for b in ids], dtype=np.int64).ravel()
            cpu = (host.data_ptr() + np.arange(blocks)[:, None] * row
                   + np.arange(layers)[None, :] * page).astype(np.int64).ravel()
            sizes = torch.full((blocks * layers,), page, dtype=torch.int64).pin_memory()
            gpu_t = torch.from_numpy(gpu).pin_memory()
            cpu_t = torch.from_numpy(cpu).pin_memory()

            # stores keep stream order; loads let the DMA read the host out of order,
            # as vLLM's CPU offloading worker does
            d2h = functools.partial(_swap, swap, stream, gpu_t, cpu_t, sizes, False)
            h2d = functools.partial(_swap, swap, stream, cpu_t, gpu_t, sizes, True)

            nbytes = blocks * row
            t_out, t_in = _median_seconds(d2h, [stream]), _median_seconds(h2d, [stream])
            _row("B1", shape=name, blocks=blocks, bytes=nbytes,
                 store_gbps=nbytes / t_out / 1e9,
                 store_ratio=_anchor(raw, "d2h", nbytes) / t_out,
                 load_gbps=nbytes / t_in / 1e9, load_ratio=_anchor(raw, "h2d", nbytes) / t_in)
            print(f"| {name} | {blocks} | {nbytes / MiB:.1f} MiB | {_gbps(nbytes, t_out)} | "
                  f"{_anchor(raw, 'd2h', nbytes) / t_out:.2f} | {_gbps(nbytes, t_in)} | "
                  f"{_anchor(raw, 'h2d', nbytes) / t_in:.2f} |")
        del caches, host


def _worker(root: str, caches: Any, per_file: int = 1, page_copy: str = "auto") -> Any:
    from kvtier_offload.store import BlockStore, StoreConfig
    from kvtier_offload.vllm_spec import KvtierOffloadingWorker

    return KvtierOffloadingWorker(BlockStore(StoreConfig(root=root, fingerprint="0" * 16)),
                                  caches, blocks_per_chunk=per_file, max_staging_bytes=STAGING,
                                  page_copy=page_copy)


def _gather_all(worker: Any, pieces: list[Any]) -> None:
    for piece in pieces:
        worker._gather(piece)


def _scatter_all(worker: Any, pieces: list[Any]) -> None:
    for piece in pieces:
        worker._scatter(piece, piece.block_ids, piece.slots)


def device_phase(raw: dict[tuple[str, int], float], root: str) -> None:
    """B2: the worker's gather and scatter alone, through its staging region: the pages
    copied as page_copy=auto picks (vLLM's op, else the CUDA runtime's batched copy) and
    by the gather/scatter kernels, side by side."""
    print("\n### B2 kvtier device phase alone (block store idle; ratio to B0; pages copied "
          "by: vllm = vLLM's swap_blocks_batch, cuda-runtime = cudaMemcpyBatchAsync "
          "without vLLM, kernels = gather/scatter)\n")
    print("| shape | copier | blocks | ids | size | gather+D2H | ratio | H2D+scatter | "
          "ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (layers, page) in SHAPES.items():
        num_blocks = max(JOB_BLOCKS) + 64
        caches = _kv(layers, page, num_blocks)
        for page_copy in ("auto", "kernels"):
            worker = _worker(os.path.join(root, "b2"), caches, page_copy=page_copy)
            if page_copy == "kernels" or worker.copier != "kernels":
                _device_phase(raw, name, worker, num_blocks)
            if page_copy == "auto":
                busy_submit(worker, num_blocks)
            worker.shutdown()
            del worker
        del caches


def _device_phase(raw: dict[tuple[str, int], float], name: str, worker: Any,
                  num_blocks: int) -> None:
    from kvtier_offload.vllm_spec import _Job

    for blocks in JOB_BLOCKS:
        if blocks > worker.arena.num_rows:
            continue
        for random in (False, True):
            ids = _ids(blocks, num_blocks, random)
            job = _Job(0, "bench", blocks)
            pieces = worker._pieces(job, [b""] * blocks, ids, np.arange(blocks))
            for piece in pieces:
                piece.run = worker.arena.take(len(piece.keys))
                assert piece.run is not None and piece.run.rows == len(piece.keys)

            gather = functools.partial(_gather_all, worker, pieces)
            scatter = functools.partial(_scatter_all, worker, pieces)

            nbytes = blocks * worker.page_total
            t_out = _median_seconds(gather, [worker._store_stream])
            t_in = _median_seconds(scatter, [worker._load_stream])
            for piece in pieces:
                worker.arena.give(piece.run)
            ids_kind = "random" if random else "contiguous"
            _row("B2", shape=name, blocks=blocks, ids=ids_kind, page_copy=worker.page_copy,
                 copier=worker.copier, bytes=nbytes, store_gbps=nbytes / t_out / 1e9,
                 store_ratio=_anchor(raw, "d2h", nbytes) / t_out,
                 load_gbps=nbytes / t_in / 1e9,
                 load_ratio=_anchor(raw, "h2d", nbytes) / t_in)
            print(f"| {name} | {worker.copier} | {blocks} | {ids_kind} | "
                  f"{nbytes / MiB:.1f} MiB | {_gbps(nbytes, t_out)} | "
                  f"{_anchor(raw, 'd2h', nbytes) / t_out:.2f} | {_gbps(nbytes, t_in)} | "
                  f"{_anchor(raw, 'h2d', nbytes) / t_in:.2f} |")


def busy_submit(worker: Any, num_blocks: int) -> None:
    """Wall time of submit_store and get_finished with about 1 s queued on the GPU."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    blocks = min(16, num_blocks)
    keys = [i.to_bytes(36, "big") for i in range(blocks)]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    start = time.perf_counter()
    worker.submit_store(1 << 40, GPULoadStoreSpec(list(range(blocks)), [blocks], [0]),
                        KvtierLoadStoreSpec(keys))
    submit = time.perf_counter() - start
    start = time.perf_counter()
    worker.get_finished()
    poll = time.perf_counter() - start
    torch.cuda.synchronize()
    _finish(worker, {1 << 40})
    _row("submit", blocks=blocks, submit_store_ms=submit * 1e3, get_finished_ms=poll * 1e3)
    print(f"\nsubmit_store of {blocks} blocks with the GPU busy: {submit * 1e3:.2f} ms; "
          f"get_finished: {poll * 1e3:.2f} ms (target: under 1 ms)")


def _finish(worker: Any, jobs: set[int], timeout: float = 300.0) -> dict[int, bool]:
    """Poll as vLLM does until the jobs are reported and every store's files are
    written (a store is reported at its device copy, before its write)."""
    done: dict[int, bool] = {}
    deadline = time.monotonic() + timeout
    while not jobs <= done.keys() or worker.writes_in_flight:
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs {jobs - done.keys()} never finished")
        done |= {r.job_id: r.success for r in worker.get_finished()}
        time.sleep(0.0005)
    return done


def _remove_files(root: str) -> int:
    """Remove the block files under root (a run's, after its load); how many."""
    count = 0
    for folder, _dirs, names in os.walk(root):
        for name in names:
            if name.endswith(".kvb"):
                os.unlink(os.path.join(folder, name))
                count += 1
    return count


def end_to_end(raw: dict[tuple[str, int], float], root: str, where: str,
               floor: dict[str, float] | None = None) -> None:
    """B3: GPU -> file -> GPU through the real block store."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    print(f"\n### B3 GPU -> file -> GPU on {where} (ratio to B0, and to the slower of B0 "
          "and the file floor F)\n")
    print("| shape | blocks | size | store | ratio | vs floor | load | ratio | vs floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    job = 0
    for shape, (name, (layers, page)) in enumerate(SHAPES.items()):
        num_blocks = 2 * max(JOB_BLOCKS) + 64
        caches = _kv(layers, page, num_blocks)
        shape_root = os.path.join(root, f"b3-{shape}")  # one fingerprint per shape
        worker = _worker(shape_root, caches)
        for blocks in JOB_BLOCKS:
            stores, loads = [], []
            for run in range(max(1, RUNS // 4)):
                # fresh keys every run: a key already stored would be settled as there
                # without a write, and the store figure would skip the volume
                keys = [(run << 48 | blocks << 24 | i).to_bytes(36, "big")
                        for i in range(blocks)]
                job += 2
                start = time.perf_counter()
                worker.submit_store(job, GPULoadStoreSpec(list(range(blocks)), [blocks], [0]),
                                    KvtierLoadStoreSpec(keys))
                stored = _finish(worker, {job})
                stores.append(time.perf_counter() - start)
                dst = list(range(max(JOB_BLOCKS), max(JOB_BLOCKS) + blocks))
                start = time.perf_counter()
                worker.submit_load(job + 1, KvtierLoadStoreSpec(keys),
                                   GPULoadStoreSpec(dst, [blocks], [0]))
                loaded = _finish(worker, {job + 1})
                loads.append(time.perf_counter() - start)
                written = _remove_files(shape_root)
                if not (stored[job] and loaded[job + 1]) or worker.stores_dropped \
                        or written != blocks:
                    raise RuntimeError(f"{name}, {blocks} blocks, run {run}: a job failed, a "
                                       f"store was dropped, or {written} of {blocks} files "
                                       "were written")
            nbytes = blocks * worker.page_total
            t_out, t_in = statistics.median(stores), statistics.median(loads)
            dma_out, dma_in = _anchor(raw, "d2h", nbytes), _anchor(raw, "h2d", nbytes)
            # the slower side: pinned DMA or the volume's own parallel floor
            floor_out = max(dma_out, nbytes / (floor["write_gbps"] * 1e9)) if floor else dma_out
            floor_in = max(dma_in, nbytes / (floor["read_gbps"] * 1e9)) if floor else dma_in
            _row("B3", shape=name, blocks=blocks, bytes=nbytes, where=where,
                 store_gbps=nbytes / t_out / 1e9, store_ratio=dma_out / t_out,
                 store_vs_floor=floor_out / t_out, load_gbps=nbytes / t_in / 1e9,
                 load_ratio=dma_in / t_in, load_vs_floor=floor_in / t_in)
            print(f"| {name} | {blocks} | {nbytes / MiB:.1f} MiB | {_gbps(nbytes, t_out)} | "
                  f"{dma_out / t_out:.2f} | {floor_out / t_out:.2f} | {_gbps(nbytes, t_in)} | "
                  f"{dma_in / t_in:.2f} | {floor_in / t_in:.2f} |")
        worker.shutdown()
        del caches, worker


def file_floor(root: str, where: str) -> dict[str, float]:
    """F: plain FLOOR_FILE writes then reads on FLOOR_THREADS threads, FLOOR_BYTES in
    all, on the scratch volume (no kvtier): what the volume itself does in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    folder = os.path.join(root, "floor")
    os.makedirs(folder, exist_ok=True)
    count = max(FLOOR_THREADS, FLOOR_BYTES // FLOOR_FILE)
    payload = os.urandom(FLOOR_FILE)
    paths = [os.path.join(folder, f"{i:06d}") for i in range(count)]

    def write(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)

    def read(path: str) -> None:
        buf = bytearray(FLOOR_FILE)
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)

    with ThreadPoolExecutor(FLOOR_THREADS) as pool:
        start = time.perf_counter()
        list(pool.map(write, paths))
        t_write = time.perf_counter() - start
        start = time.perf_counter()
        list(pool.map(read, paths))
        t_read = time.perf_counter() - start
    for path in paths:
        os.unlink(path)
    out = {"write_gbps": count * FLOOR_FILE / t_write / 1e9,
           "read_gbps": count * FLOOR_FILE / t_read / 1e9}
    _row("F", where=where, threads=FLOOR_THREADS, file_bytes=FLOOR_FILE,
         bytes=count * FLOOR_FILE, **out)
    print(f"\n### F the volume's parallel file floor on {where}\n\n{FLOOR_THREADS} threads, "
          f"{count} files of {FLOOR_FILE // MiB} MiB: write {out['write_gbps']:.1f} GB/s, "
          f"read {out['read_gbps']:.1f} GB/s (page cache warm for the reads)")
    return out


def _round_trip_seconds(worker: Any, root: str, blocks: int, tag: int,
                        job: int) -> tuple[float, float]:
    """Store `blocks` GPU blocks as fresh files and load them back (wall seconds of each,
    polled as vLLM polls, the store until its files are written); removes the files."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    files = blocks // worker.blocks_per_file
    keys = [(tag << 40 | i).to_bytes(36, "big") for i in range(files)]
    start = time.perf_counter()
    worker.submit_store(job, GPULoadStoreSpec(list(range(blocks)), [blocks], [0]),
                        KvtierLoadStoreSpec(keys))
    stored = _finish(worker, {job})
    t_store = time.perf_counter() - start
    dst = list(range(blocks, 2 * blocks))
    start = time.perf_counter()
    worker.submit_load(job + 1, KvtierLoadStoreSpec(keys), GPULoadStoreSpec(dst, [blocks], [0]))
    loaded = _finish(worker, {job + 1})
    t_load = time.perf_counter() - start
    written = _remove_files(root)
    if not (stored[job] and loaded[job + 1]) or written != files:
        raise RuntimeError(f"{blocks} blocks in files of {worker.blocks_per_file}: a job "
                           f"failed or {written} of {files} files were written")
    return t_store, t_load


def files_per_job(root: str, where: str) -> None:
    """B4: one job of B4_BLOCKS GPU blocks end to end in 16-token files (one GPU block
    each) and in 256-token files (FILE_BLOCKS each), alternating, per byte."""
    print(f"\n### B4 16-token files against 256-token files on {where} (the same job of "
          f"{B4_BLOCKS} GPU blocks; alternating runs)\n")
    print("| shape | size | store 16-token | store 256-token | ratio | load 16-token | "
          "load 256-token | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    job = 1 << 20
    for shape, (name, (layers, page)) in enumerate(SHAPES.items()):
        caches = _kv(layers, page, 2 * B4_BLOCKS + 16)
        workers = {per: _worker(os.path.join(root, f"b4-{shape}-{per}"), caches, per)
                   for per in (1, FILE_BLOCKS)}
        times: dict[int, tuple[list[float], list[float]]] = {per: ([], []) for per in workers}
        for run in range(max(2, RUNS // 4)):
            for per, worker in workers.items():  # alternating: same load on the volume
                job += 2
                t_store, t_load = _round_trip_seconds(
                    worker, os.path.join(root, f"b4-{shape}-{per}"), B4_BLOCKS,
                    run << 8 | per, job)
                times[per][0].append(t_store)
                times[per][1].append(t_load)
        nbytes = B4_BLOCKS * workers[1].page_total
        figures = {per: (nbytes / statistics.median(st) / 1e9,
                         nbytes / statistics.median(ld) / 1e9)
                   for per, (st, ld) in times.items()}
        one, chunk = figures[1], figures[FILE_BLOCKS]
        _row("B4", shape=name, blocks=B4_BLOCKS, bytes=nbytes, where=where,
             files={per: B4_BLOCKS // w.blocks_per_file for per, w in workers.items()},
             store_gbps_16=one[0], store_gbps_256=chunk[0], store_ratio=one[0] / chunk[0],
             load_gbps_16=one[1], load_gbps_256=chunk[1], load_ratio=one[1] / chunk[1])
        print(f"| {name} | {nbytes / MiB:.1f} MiB | {one[0]:.1f} GB/s | {chunk[0]:.1f} GB/s "
              f"| {one[0] / chunk[0]:.2f} | {one[1]:.1f} GB/s | {chunk[1]:.1f} GB/s | "
              f"{one[1] / chunk[1]:.2f} |")
        for worker in workers.values():
            worker.shutdown()
        del caches, workers


class _ModelStep:
    """A decode step's stand-in on the current (compute) stream: STEP_PRODUCTS matrix-
    vector products over one weight matrix (HBM-bound, as a decode step's weight reads
    are), captured once as a CUDA graph where CUDA graphs work (vLLM replays its steps so),
    then a small blocking copy to the host (the sampled tokens)."""

    def __init__(self, device: str) -> None:
        import torch

        rows, cols = STEP_MATRIX
        self.cuda = device.startswith("cuda")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        self.weights = torch.randn(rows, cols, device=device).to(dtype)
        self.x = torch.randn(cols, 16, device=device).to(dtype)
        self.out = torch.empty(rows, 16, device=device, dtype=dtype)
        self.graph = None
        if self.cuda:
            try:
                self._products()  # warm-up (cuBLAS picks its kernels) before capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._products()
                self.graph = graph
            except RuntimeError as err:  # then the launches are part of the step
                print(f"(B5: no CUDA graph, eager launches: {err})")

    def _products(self) -> None:
        import torch

        for _ in range(STEP_PRODUCTS):
            torch.matmul(self.weights, self.x, out=self.out)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._products()
        self.out[:1, :1].to("cpu")  # blocking, as vLLM's sampled-token copy is


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def step_interference(root: str, where: str, device: str = "cuda") -> None:
    """B5: the engine step's p50/p99 without offload and with it, alternating phases."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier_offload.vllm_spec import KvtierLoadStoreSpec

    name, (layers, page) = next(iter(SHAPES.items()))  # 8B-TP1
    per_step = STEP_STORE_BLOCKS
    warm = 4 * per_step  # blocks stored before timing: what the loads read
    caches = _kv(layers, page, warm + 3 * per_step * STEPS + 16)
    root_b5 = os.path.join(root, "b5")
    worker = _worker(root_b5, caches, FILE_BLOCKS)
    step = _ModelStep(device)
    warm_keys = [(1 << 60 | i).to_bytes(36, "big") for i in range(warm // FILE_BLOCKS)]
    worker.submit_store(1, GPULoadStoreSpec(list(range(warm)), [warm], [0]),
                        KvtierLoadStoreSpec(warm_keys))
    _finish(worker, {1})
    job, base = 10, []
    outcomes: dict[int, bool] = {}
    with_offload: list[float] = []
    moved = 0
    offload_seconds = 0.0
    for round_ in range(STEP_ROUNDS):
        for _ in range(2):  # warm: a step or two of each before timing
            step()
        for _ in range(STEPS):
            start = time.perf_counter()
            step()
            base.append(time.perf_counter() - start)
        new_keys: list[bytes] = []
        pending: set[int] = set()
        phase = time.perf_counter()
        for n in range(STEPS):
            start = time.perf_counter()
            for result in worker.get_finished():  # vLLM polls once per step
                outcomes[result.job_id] = result.success
                pending.discard(result.job_id)
            first = warm + (n % (2 * STEPS)) * per_step
            keys = [(round_ << 48 | n << 16 | i).to_bytes(36, "big")
                    for i in range(per_step // FILE_BLOCKS)]
            job += 1
            worker.submit_store(job, GPULoadStoreSpec(list(range(first, first + per_step)),
                                                      [per_step], [0]),
                                KvtierLoadStoreSpec(keys))
            pending.add(job)
            new_keys += keys
            moved += per_step
            if n % 2:  # a load of files stored before, into blocks no store reads
                job += 1
                dst = warm + 2 * STEPS * per_step
                files = warm_keys[:per_step // FILE_BLOCKS]
                worker.submit_load(job, KvtierLoadStoreSpec(files),
                                   GPULoadStoreSpec(list(range(dst, dst + per_step)),
                                                    [per_step], [0]))
                pending.add(job)
                moved += per_step
            step()
            with_offload.append(time.perf_counter() - start)
        outcomes |= _finish(worker, pending)
        offload_seconds += time.perf_counter() - phase
        for key in new_keys:  # this round's files: the scratch holds one round's
            path = worker.store.layout.path(key)
            if os.path.exists(path):
                os.unlink(path)
            worker.store.forget(key)
    worker.shutdown()
    p50_b, p99_b = _percentile(base, 50), _percentile(base, 99)
    p50_o, p99_o = _percentile(with_offload, 50), _percentile(with_offload, 99)
    nbytes = moved * worker.page_total
    _row("B5", shape=name, where=where, steps=len(base), cuda_graph=step.graph is not None,
         step_p50_ms=p50_b * 1e3, step_p99_ms=p99_b * 1e3,
         offload_p50_ms=p50_o * 1e3, offload_p99_ms=p99_o * 1e3, p99_ratio=p99_o / p99_b,
         p50_ratio=p50_o / p50_b, offload_gbps=nbytes / offload_seconds / 1e9,
         jobs_ok=sum(outcomes.values()), jobs=len(outcomes))
    print(f"\n### B5 engine step with and without offload ({name} KV, 256-token files on "
          f"{where}; {STEP_ROUNDS} alternating rounds of {STEPS} steps; "
          f"{'CUDA graph' if step.graph is not None else 'eager'} stand-in step)\n")
    print("| | p50 | p99 |\n|---|---|---|")
    print(f"| without offload | {p50_b * 1e3:.2f} ms | {p99_b * 1e3:.2f} ms |")
    print(f"| with offload | {p50_o * 1e3:.2f} ms | {p99_o * 1e3:.2f} ms |")
    print(f"| ratio | {p50_o / p50_b:.3f} | {p99_o / p99_b:.3f} |")
    print(f"\noffload moved {nbytes / MiB:.0f} MiB ({nbytes / offload_seconds / 1e9:.1f} "
          f"GB/s over the offload phases); {sum(outcomes.values())} of {len(outcomes)} jobs "
          "succeeded")


def run() -> list[dict[str, Any]]:
    """Every section in order (printing its tables); the figures as rows ([] and one
    line printed where there is no CUDA)."""
    ROWS.clear()
    reason = _skip_reason()
    if reason:
        print(f"gpu: skipped, {reason}")
        return []
    import torch

    from benchmarks.common import scratch_dir

    types = _use_vllm_types()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}; {RUNS} runs after {WARMUP} warm-ups; staging "
          f"{STAGING // MiB} MiB; vLLM types from {types}")
    raw = raw_dma()
    vllm_dma(raw)
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-b2-") as root:
        device_phase(raw, root)
    size = f"{scratch_bytes() // MiB + 1}M"
    with scratch_dir(size, "kvtier-gpu-b3-") as (root, where):
        step_interference(root, where)
        floor = file_floor(root, where)
        end_to_end(raw, root, where, floor)
        files_per_job(root, where)
    host = torch.cuda.host_memory_stats()
    print(f"\npinned host memory: {host.get('allocated_bytes.peak', 0) / MiB:.0f} MiB at "
          f"peak (kvtier's staging: {STAGING // MiB} MiB per worker, the rest is B0/B1)")
    return list(ROWS)


def main() -> None:
    run()
