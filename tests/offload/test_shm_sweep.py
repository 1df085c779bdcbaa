"""`python -m kvtier_offload sweep-shm`: vLLM's stale CPU-tier regions leave /dev/shm
before the engine starts again; a region a live process maps or holds open stays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier_offload import shm_sweep
from kvtier_offload.shm_sweep import REGION_NAME, sweep

MIB = 1 << 20


def _file(path: Path, size: int = MIB) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(b"x")  # one real page, so the size on disk is not 0
    return path


HOLD = textwrap.dedent("""
    import mmap, os, sys, time
    how, path = sys.argv[1], sys.argv[2]
    fd = os.open(path, os.O_RDWR)
    if how == "map":
        region = mmap.mmap(fd, os.fstat(fd).st_size)
        os.close(fd)  # the mapping alone keeps it in use
    print("ready", flush=True)
    time.sleep(60)
""")


def _holder(how: str, path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, how, str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize(("name", "region"), [
    ("vllm_offload_0a1b.mmap", True),  # 0.32, and 0.33's first segment
    ("vllm_offload_engine-7.mmap.1", True),  # 0.33 segments
    ("vllm_offload_engine-7.mmap.31", True),
    ("vllm_offload_x.mmapx", False),
    ("vllm_offload_.mmap", False),
    ("vllm_offload_x.mmap.", False),
    ("my_vllm_offload_x.mmap", False),
    ("sem.vllm_offload_x.mmap", False),
    ("psm_1234", False),
    ("vllm_offloading_x.mmap", False),
])
def test_only_vllm_region_names_are_candidates(name, region):
    assert bool(REGION_NAME.fullmatch(name)) is region


def test_stale_regions_go_regions_in_use_stay(tmp_path):
    stale = [_file(tmp_path / "vllm_offload_dead.mmap", 4 * MIB),
             _file(tmp_path / "vllm_offload_dead.mmap.1", 2 * MIB)]
    mapped = _file(tmp_path / "vllm_offload_live.mmap")
    opened = _file(tmp_path / "vllm_offload_joiner.mmap")  # a joiner waiting for the size
    other = _file(tmp_path / "psm_1234")  # not vLLM's region: never touched
    outside = _file(tmp_path.parent / f"{tmp_path.name}-outside.mmap")
    (tmp_path / "vllm_offload_link.mmap").symlink_to(outside)  # never followed
    holders = [_holder("map", mapped), _holder("open", opened)]
    try:
        report = sweep(str(tmp_path))
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
    assert sorted(report.removed) == sorted(p.name for p in stale)
    assert report.removed_bytes > 0  # what the files held in memory (st_blocks), not their size
    assert sorted(report.in_use) == ["vllm_offload_joiner.mmap", "vllm_offload_live.mmap"]
    assert mapped.exists() and opened.exists() and other.exists() and outside.exists()
    assert (tmp_path / "vllm_offload_link.mmap").is_symlink()
    assert not any(p.exists() for p in stale)
    assert "removed 2 stale region file(s)" in report.summary()


def test_a_process_it_may_not_inspect_is_named_in_the_summary(tmp_path, monkeypatch):
    stale = _file(tmp_path / "vllm_offload_dead.mmap")
    real = shm_sweep._mapped
    me = f"/{os.getpid()}/maps"

    def denied(path: str) -> set:
        if path.endswith(me):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(shm_sweep, "_mapped", denied)
    report = sweep(str(tmp_path))
    assert not stale.exists() and report.removed == ["vllm_offload_dead.mmap"]
    assert str(os.getpid()) in report.uninspected
    assert "not inspectable" in report.summary()


def test_reading_is_bounded(tmp_path, monkeypatch):
    # A maps file past the bound (a hostile or huge process) stops the sweep, keeping all.
    stale = _file(tmp_path / "vllm_offload_dead.mmap")
    monkeypatch.setattr(shm_sweep, "MAX_MAPS_BYTES", 16)
    report = sweep(str(tmp_path))
    assert stale.exists() and "larger than 16 bytes" in report.kept_reason


def test_sweep_then_exec_runs_the_command_even_when_the_sweep_fails(tmp_path):
    stale = _file(tmp_path / "vllm_offload_dead.mmap")
    out = subprocess.run([sys.executable, "-m", "kvtier_offload", "sweep-shm", "--dir",
                          str(tmp_path), "--", sys.executable, "-c", "print('engine up')"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "engine up" and not stale.exists()
    assert "removed 1 stale region file(s)" in out.stderr
    missing = subprocess.run([sys.executable, "-m", "kvtier_offload", "sweep-shm", "--dir",
                              str(tmp_path / "none"), "--", sys.executable, "-c",
                              "print('engine up')"], capture_output=True, text=True, check=True)
    assert missing.stdout.strip() == "engine up"


# A real region from vLLM's own CPU-tier code, in a private mount namespace whose /dev/shm
# is a 96 MiB tmpfs: a process killed with its 64 MiB region still named (no barrier yet)
# leaves it behind; the next start fails for lack of /dev/shm; after the sweep it starts.
REGION = textwrap.dedent("""
    import sys
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    region = SharedOffloadRegion(sys.argv[1], num_chunks=16, rank=None,
                                 kv_bytes_per_chunk=4 << 20, cpu_page_size=4 << 20)
    print("region", region.mmap_path, flush=True)
    if sys.argv[2:] == ["hang"]:
        import time
        time.sleep(120)
""")
SCENARIO = textwrap.dedent("""
    set -u
    mount -t tmpfs -o size=96m tmpfs /dev/shm || exit 77
    py="$1"; region="$2"
    "$py" -c "$region" first hang > /tmp/first.$$ 2>&1 &
    first=$!
    for i in $(seq 600); do grep -q '^region' /tmp/first.$$ && break; sleep 0.1; done
    kill -9 $first; wait $first 2>/dev/null
    echo "left: $(ls /dev/shm)"
    "$py" -c "$region" second > /dev/null 2>&1 && echo "second: started" || echo "second: failed"
    "$py" -m kvtier_offload sweep-shm -- "$py" -c "$region" third 2>&1 | grep -E '^region|sweep-shm'
""")


@pytest.mark.vllm
@pytest.mark.privileged
@pytest.mark.timeout(300)
def test_a_killed_engine_s_real_region_is_swept_and_the_next_start_succeeds():
    pytest.importorskip("vllm")
    if os.geteuid() != 0:
        pytest.skip("a private mount namespace with its own /dev/shm needs root")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          SCENARIO, "sh", sys.executable, REGION], capture_output=True,
                         text=True, timeout=280, check=False)
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {out.stderr.strip()}")
    lines = out.stdout.splitlines()
    assert "left: vllm_offload_first.mmap" in lines, out.stdout + out.stderr
    assert "second: failed" in lines, out.stdout  # without the sweep, no room to start
    assert any("removed 1 stale region file(s), 0.06 GiB" in line for line in lines), lines
    assert "region /dev/shm/vllm_offload_third.mmap" in lines, out.stdout + out.stderr
