"""What the C batch path asks the filesystem per block, counted with strace in a child.

On a network filesystem every name the kernel has to look up or stat is a round trip to
the server (docs/benchmarks.md, "Where a block's time goes on GlusterFS"), so the
syscalls on a block's names are what a store or load costs there. strace's fault
injection also plays a filesystem without RENAME_NOREPLACE (GlusterFS's FUSE client and
NFS refuse it with EINVAL).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier_offload import batchio

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(not batchio.AVAILABLE, reason=batchio.UNAVAILABLE_REASON or "-"),
    pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed"),
]
N = 6
SIZE = 64 * 1024

# The child: N blocks (fan-out directories made first, as the store does), then `after`.
PROLOGUE = f"""
import json, mmap, os, sys
import numpy as np
from kvtier_offload import batchio
from kvtier_offload.fileformat import HEADER_SIZE, header_prefix
from kvtier_offload.layout import Layout
N, SIZE, PREFIX = {N}, {SIZE}, header_prefix("0123456789abcdef")
lay = Layout(sys.argv[1], "0123456789abcdef")
KEYS = [bytes([i, 7 * i]) + bytes(34) for i in range(N)]
for key in KEYS:
    lay.ensure_dir(os.path.dirname(lay.path(key)))
data = [mmap.mmap(-1, SIZE) for _ in KEYS]
for i, d in enumerate(data):
    d[:] = bytes([i + 1]) * SIZE
at = np.array([batchio.address(d) for d in data], dtype=np.int64)
sizes = np.full(N, SIZE, dtype=np.int64)
def store(token):
    return batchio.write_blocks(os.fsencode(lay.base), PREFIX, KEYS, token, at, sizes,
                                memoryview(mmap.mmap(-1, N * HEADER_SIZE)), False, False)
def load():
    return batchio.read_blocks(os.fsencode(lay.base), PREFIX, KEYS, at, sizes,
                               memoryview(mmap.mmap(-1, N * HEADER_SIZE)), False)[0]
def marker(name):  # a line in the trace between the parts
    try:
        os.stat("/nonexistent-kvtier-marker-" + name)
    except OSError:
        pass
"""


def traced(tmp_path: Path, body: str, *strace: str) -> tuple[object, list[str]]:
    """Run PROLOGUE + body (which prints one JSON line) under strace; the JSON and the
    trace's lines from the marker "go" on."""
    out = tmp_path / "trace"
    path = os.environ.get("PYTHONPATH") or os.pathsep.join(
        str(ROOT / p) for p in ("offload", "operator", "evictor"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), path)))
    code = PROLOGUE + textwrap.dedent(body)
    run = subprocess.run(["strace", "-f", "-qq", "-o", str(out), "-e", "trace=%file",
                          *strace, sys.executable, "-c", code, str(tmp_path / "vol")],
                         env=env, capture_output=True, text=True, timeout=120)
    if run.returncode and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    lines = out.read_text().splitlines()
    start = next(n for n, line in enumerate(lines) if "kvtier-marker-go" in line)
    return json.loads(run.stdout.strip().splitlines()[-1]), lines[start + 1:]


def calls_on(lines: list[str], pattern: str) -> list[str]:
    """The syscall names of the trace's lines whose arguments match pattern."""
    return [re.sub(r"^\d+\s+", "", line).split("(", 1)[0] for line in lines
            if re.search(pattern, line)]


FINAL = r'[0-9a-f]{72}\.kvb"'  # a final block name (a temp name goes on after .kvb)


def test_a_store_does_not_look_for_the_block_before_writing_it(tmp_path):
    """A new block costs create, write, close and one rename, nothing on its final name
    but the rename that publishes it (an existence check first was one more round trip
    per block on a network filesystem)."""
    result, lines = traced(tmp_path, """
        marker("go")
        print(json.dumps(store(b"feed").tolist()))
    """)
    assert result == [batchio.DONE] * N
    assert calls_on(lines, FINAL) == ["renameat2"] * N
    assert len(calls_on(lines, FINAL + ".*RENAME_NOREPLACE")) == N


def test_a_block_stored_meanwhile_is_not_replaced_where_the_filesystem_can_refuse(
        tmp_path):
    """With RENAME_NOREPLACE (local filesystems) a block already there is EXISTS and
    left as it was (its mtime), and no temp file stays behind."""
    result, _ = traced(tmp_path, """
        store(b"feed")
        before = [os.stat(lay.path(k)).st_mtime_ns for k in KEYS]
        marker("go")
        status = store(b"beef").tolist()
        left = sorted(n for _, _, names in os.walk(lay.base) for n in names)
        print(json.dumps([status, before == [os.stat(lay.path(k)).st_mtime_ns
                                             for k in KEYS], len(left)]))
    """)
    assert result == [[batchio.EXISTS] * N, True, N]


def test_without_rename_noreplace_a_store_renames_and_asks_once_per_batch(tmp_path):
    """Where the filesystem refuses RENAME_NOREPLACE (EINVAL: GlusterFS's FUSE client,
    NFS), a batch asks once and then renames plainly: every block is published (one
    already there is replaced by the same bytes, still DONE) and loads back verified."""
    result, lines = traced(tmp_path, """
        marker("go")
        first = store(b"feed").tolist()
        again = store(b"beef").tolist()
        left = sorted(n for _, _, names in os.walk(lay.base) for n in names)
        for d in data:
            d[:] = bytes(SIZE)
        loaded = load().tolist()
        print(json.dumps([first, again, len(left),
                          all(bytes(d) == bytes([i + 1]) * SIZE for i, d in enumerate(data)),
                          loaded]))
    """, "-e", "inject=renameat2:error=EINVAL")
    assert result == [[batchio.DONE] * N, [batchio.DONE] * N, N, True, [batchio.DONE] * N]
    # renameat2 with RENAME_NOREPLACE once, then plain (rename or renameat, by platform)
    publish = ["noreplace" if "RENAME_NOREPLACE" in line else "plain"
               for line in lines
               if re.search(FINAL, line) and re.match(r"\d+\s+rename", line)]
    assert publish == (["noreplace"] + ["plain"] * N) * 2
