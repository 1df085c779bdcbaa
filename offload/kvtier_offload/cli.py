"""`python -m kvtier_offload`: install the backend into a shared volume, or probe one;
prepare the tier's directory on a fresh volume (prepare-dir)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# What must import for the backend to work inside vLLM (vllm_tier itself needs vLLM,
# which the init container's image does not have), and a block digest it can verify with:
# without one the store would refuse to start inside vLLM, so the init container fails
# first, with the reason in its log.
CHECK_IMPORTS = (
    "import sys, kvtier_offload.store, kvtier_offload.layout, kvtier_offload.fileformat\n"
    "from kvtier_offload import digest\n"
    "digest.AVAILABLE or sys.exit('no block digest: ' + digest.REASON)")
NATIVE = "_native.abi3.so"  # the C extension (stable ABI: any CPython >= 3.11)
# ELF e_machine of the platforms the image carries the extension for
ELF_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}


def _elf_machine(path: Path) -> int | None:
    """The e_machine of a 64-bit little-endian ELF file, else None."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    return int.from_bytes(head[18:20], "little")


def native_misfit(package: Path, env: dict[str, str]) -> str | None:
    """Why the C extension in an installed package does not fit this node's platform and
    Python (None: it fits, or there is none to check)."""
    import platform

    so = package / NATIVE
    if not so.exists():
        return None
    machine = platform.machine().lower()
    want, got = ELF_MACHINES.get(machine), _elf_machine(so)
    if want is None or got != want:
        return (f"it is built for ELF machine {got}, this node is {machine or 'unknown'} "
                f"(ELF machine {want})")
    if sys.implementation.name != "cpython" or sys.version_info < (3, 11):
        return f"it needs CPython 3.11 or newer, not {sys.implementation.name} {sys.version}"
    check = subprocess.run([sys.executable, "-c", "import kvtier_offload._native"], env=env,
                           cwd="/", capture_output=True, text=True, check=False)
    if check.returncode != 0:
        return "it does not load: " + (check.stderr.strip().splitlines() or ["?"])[-1]
    return None


def install(target: str) -> int:
    """Copy this package into target (the pod's shared emptyDir) and prove it imports."""
    dest_root = Path(target)
    dest_root.mkdir(parents=True, exist_ok=True)
    staging = dest_root / f".kvtier_offload.{os.getpid()}"
    final = dest_root / PACKAGE.name
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(PACKAGE, staging, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    env = {**os.environ, "PYTHONPATH": str(dest_root), "PYTHONDONTWRITEBYTECODE": "1"}
    misfit = native_misfit(final, env)
    if misfit:
        # Never a broken vLLM: without the extension the backend runs its Python path
        # (and says so at start: the kvtier_offload_native gauge, one log line).
        (final / NATIVE).unlink()
        print(f"kvtier_offload: refusing its C extension ({misfit}); removed it, vLLM "
              "will run the backend's Python path (slower, same files)", file=sys.stderr)
    elif not (final / NATIVE).exists():
        print("kvtier_offload: no C extension in this image; vLLM will run the backend's "
              "Python path (slower, same files)", file=sys.stderr)
    check = subprocess.run([sys.executable, "-c", CHECK_IMPORTS], env=env, cwd="/",
                           capture_output=True, text=True, check=False)
    if check.returncode != 0:
        print(f"kvtier_offload installed to {final} but cannot run:\n{check.stderr}",
              file=sys.stderr)
        return 1
    print(f"kvtier_offload installed to {final}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from kvtier_offload.volume_probe import probe, vllm_available

    if args.vllm and not vllm_available():
        print("--vllm: vLLM (its fs tier, 0.32) is not installed here", file=sys.stderr)
        return 2
    try:
        result = probe(args.path, args.block_bytes, args.total_bytes, args.threads,
                       compare_vllm=args.vllm, rounds=args.rounds)
    except ValueError as err:
        print(f"--block-bytes: {err}", file=sys.stderr)
        return 2
    print(f"path {result.path}: O_DIRECT {'yes' if result.o_direct else 'no'} (as the store "
          f"used it), {'C batch' if result.batch_path else 'Python'} path, "
          f"{result.blocks} blocks of {result.block_bytes} bytes in "
          f"{'pinned' if result.pinned else 'page-aligned'} rows, {result.jobs} jobs on "
          f"{result.threads} threads, median of {len(result.kvtier_rounds)} round(s)")
    print(f"kvtier: store {result.store_gbps:.3f} GB/s, load {result.load_gbps:.3f} GB/s, "
          f"{result.failures} failures")
    if result.vllm:
        v_store = sorted(r.store_gbps for r in result.vllm)
        v_load = sorted(r.load_gbps for r in result.vllm)
        print(f"vLLM fs tier (O_DIRECT {'yes' if result.vllm[0].o_direct else 'no'}): store "
              f"{v_store[len(v_store) // 2]:.3f} GB/s, load {v_load[len(v_load) // 2]:.3f} GB/s")
        print("kvtier/vLLM by round (store, load): " + ", ".join(
            f"{s:.2f}x {ld:.2f}x" for s, ld in result.ratios()))
    if args.kv_bytes_per_token:
        breakeven = result.breakeven_tokens_per_second(args.kv_bytes_per_token)
        verdict = ("loading beats recomputing" if breakeven > args.prefill_tokens_per_second
                   else "recomputing is faster than loading")
        print(f"at {args.kv_bytes_per_token} KV bytes/token this volume loads "
              f"{breakeven:,.0f} tokens/s; prefill runs {args.prefill_tokens_per_second:,.0f} "
              f"tokens/s: {verdict}")
    return 1 if result.failures else 0


def cmd_sweep_shm(args: argparse.Namespace) -> int:
    """Sweep vLLM's stale CPU-tier regions, then exec the engine's command, if given. A
    sweep that fails never stops the engine: it says why and starts it anyway."""
    from kvtier_offload.shm_sweep import sweep

    try:
        report = sweep(args.dir)
        print(f"kvtier_offload sweep-shm {args.dir}: {report.summary()}", file=sys.stderr,
              flush=True)
    except OSError as err:
        print(f"kvtier_offload sweep-shm {args.dir}: not swept ({err})", file=sys.stderr)
    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        return 0
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"kvtier_offload sweep-shm: cannot run {command[0]!r}: {err}", file=sys.stderr)
        return 127


def cmd_prepare_dir(args: argparse.Namespace) -> int:
    """The tier's own directory, group-writable with setgid for the model servers' group
    (tier_dir.py); exit 1 saying why not."""
    from kvtier_offload.tier_dir import PrepareError, prepare

    try:
        path = prepare(args.mount, args.dir, args.group)
    except PrepareError as err:
        print(f"kvtier_offload prepare-dir: {err}", file=sys.stderr)
        return 1
    print(f"kvtier_offload prepare-dir: {path} is group {args.group}, mode 2775")
    return 0


def cmd_evict_objects(args: argparse.Namespace) -> int:
    """Hold a bucket prefix to a byte budget (object_evict.py); a JSON summary on stdout.
    Credentials and the region come from the environment (a Secret), like the tier's."""
    import json

    from kvtier_offload.object_evict import evict_to_budget
    from kvtier_offload.object_store import ObjectStoreConfig, make_client

    settings = ObjectStoreConfig(bucket=args.bucket, fingerprint="", prefix=args.prefix,
                                 endpoint_url=args.endpoint_url, region=args.region,
                                 addressing_style=args.addressing_style)
    settings.check()
    report = evict_to_budget(make_client(settings), args.bucket, args.prefix,
                             args.budget_bytes, args.min_age_seconds, args.dry_run)
    print(json.dumps(report.to_dict(), sort_keys=True))
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier_offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="copy the backend into a directory on PYTHONPATH")
    inst.add_argument("--target", required=True)
    pr = sub.add_parser("probe", help="measure store/load GB/s on a volume")
    pr.add_argument("--path", required=True)
    pr.add_argument("--block-bytes", type=int, default=16 << 20)
    pr.add_argument("--total-bytes", type=int, default=1 << 30)
    pr.add_argument("--threads", type=int, default=16,
                    help="I/O threads, and jobs: one per thread's share of the blocks")
    pr.add_argument("--vllm", action="store_true",
                    help="also run vLLM's own fs tier I/O on the same volume, alternating")
    pr.add_argument("--rounds", type=int, default=1,
                    help="rounds (kvtier and, with --vllm, vLLM each first in turn)")
    pr.add_argument("--kv-bytes-per-token", type=int, default=0)
    pr.add_argument("--prefill-tokens-per-second", type=float, default=10_000.0)
    sw = sub.add_parser("sweep-shm", help="remove vLLM CPU-tier regions no live process "
                        "uses from /dev/shm, then exec the command after --, if any")
    sw.add_argument("--dir", default="/dev/shm")
    sw.add_argument("command_line", nargs=argparse.REMAINDER,
                    help="-- COMMAND ARGS...: run after the sweep (exec, same process)")
    ev = sub.add_parser("evict-objects", help="delete the oldest block objects of the object "
                        "tier until a bucket prefix holds at most --budget-bytes")
    ev.add_argument("--bucket", required=True)
    ev.add_argument("--prefix", default="kvtier/v1")
    ev.add_argument("--budget-bytes", type=int, required=True)
    ev.add_argument("--min-age-seconds", type=float, default=600.0)
    ev.add_argument("--endpoint-url", default=None)
    ev.add_argument("--region", default=None, help="default: AWS_REGION from the environment")
    ev.add_argument("--addressing-style", default="auto", choices=("auto", "path", "virtual"))
    ev.add_argument("--dry-run", action="store_true")
    pd = sub.add_parser("prepare-dir", help="create the tier's directory on the volume "
                        "for the model servers' group: setgid, group-writable, not recursive")
    pd.add_argument("--mount", required=True, help="where the volume is mounted")
    pd.add_argument("--dir", default="", help="the tier's directory below the mount "
                    "(default: the mount itself)")
    pd.add_argument("--group", type=int, required=True, help="the model servers' fsGroup")
    args = parser.parse_args(argv)
    if args.command == "prepare-dir":
        return cmd_prepare_dir(args)
    if args.command == "evict-objects":
        return cmd_evict_objects(args)
    if args.command == "install":
        return install(args.target)
    if args.command == "sweep-shm":
        return cmd_sweep_shm(args)
    return cmd_probe(args)
