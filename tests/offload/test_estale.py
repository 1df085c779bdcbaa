"""A load meets ESTALE the way GlusterFS serves it after another node replaced a block
file (tests/netfs shows the real thing): the name opens, the first fstat or read fails
with ESTALE, every reopen too until the name is stat'ed. A store meets what GlusterFS
answers while the other node creates the same names: ENOENT from a fan-out directory's
mkdir, ESTALE from its temp file's create. Without a network filesystem: an LD_PRELOAD
shim (shims/estale.c, built here) plays that filesystem in a child process; the blocks
to load are written beforehand without it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_offload import batchio
from tests.offload.conftest import keys, rows, run_store

SHIM = Path(__file__).parent / "shims" / "estale.c"
ROOT = Path(__file__).parents[2]
SIZE = 64 << 10
N = 6

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="an LD_PRELOAD shim: Linux only")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the ESTALE shim with")
    out = tmp_path_factory.mktemp("shim") / "estale.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SHIM), "-ldl"],
                   check=True)
    return out


@pytest.fixture
def written(make_store, tmp_path) -> Path:
    store = make_store(tmp_path)
    assert run_store(store, 1, list(zip(keys(N, b"estale"), rows(N, SIZE), strict=True))).success
    return tmp_path


def in_shim(shim: Path, code: str, stale: str = ".kvb") -> dict:
    """Run code (which prints one JSON line) in a child with the shim preloaded, names
    holding `stale` stale ("": none)."""
    # After what is preloaded already (scripts/sanitize.sh: the ASan runtime, which must
    # come first), on the path this process has (there: the sanitized build).
    path = os.environ.get("PYTHONPATH") or os.pathsep.join(
        str(ROOT / p) for p in ("offload", "operator", "evictor"))
    env = dict(os.environ, KVTIER_TEST_ESTALE=stale,
               LD_PRELOAD=":".join(filter(None, (os.environ.get("LD_PRELOAD"), str(shim)))),
               PYTHONPATH=os.pathsep.join((str(ROOT), path)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_shim_plays_a_stale_name(shim, written):
    """The shim itself: a reopen alone stays stale, a stat by name clears it."""
    code = f"""
import errno, json, os
from kvtier_offload.layout import Layout
from tests.offload.conftest import keys, FP
path = Layout({str(written)!r}, FP).path(keys({N}, b"estale")[0])
seen = []
for stat_first in (False, False, True):
    if stat_first:
        os.stat(path, follow_symlinks=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fstat(fd); seen.append("ok")
    except OSError as e:
        seen.append(errno.errorcode[e.errno])
    os.close(fd)
print(json.dumps(seen))
"""
    assert in_shim(shim, code) == ["ESTALE", "ESTALE", "ok"]


@pytest.mark.skipif(not batchio.AVAILABLE, reason="no C extension here")
def test_the_c_read_path_tries_a_stale_block_once_more(shim, written):
    code = f"""
import json, mmap
import numpy as np
from kvtier_offload import batchio
from kvtier_offload.fileformat import header_prefix
from kvtier_offload.layout import Layout
from tests.offload.conftest import keys, rows, FP
lay = Layout({str(written)!r}, FP)
ks = keys({N}, b"estale")
dests = [memoryview(mmap.mmap(-1, {SIZE})) for _ in ks]
status, _ = batchio.read_blocks(lay.base.encode(), header_prefix(FP), ks,
                                np.array([batchio.address(d) for d in dests], np.int64),
                                np.full(len(ks), {SIZE}, np.int64),
                                memoryview(mmap.mmap(-1, 4096 * len(ks))), False)
want = rows({N}, {SIZE})
print(json.dumps([int(s) for s in status] + [d == w for d, w in zip(dests, want)]))
"""
    assert in_shim(shim, code) == [batchio.DONE] * N + [True] * N


@pytest.mark.parametrize("batch_io", [
    True,
    False,
], ids=["batch", "python"])
def test_a_load_that_meets_estale_is_still_a_hit_with_the_right_bytes(shim, written,
                                                                       batch_io):
    code = f"""
import json, mmap
from kvtier_offload.store import BlockStore, StoreConfig
from tests.offload.conftest import keys, rows, run_load, FP
store = BlockStore(StoreConfig(root={str(written)!r}, fingerprint=FP, batch_io={batch_io},
                               read_threads=2, write_threads=2))
ks = keys({N}, b"estale")
dests = [memoryview(mmap.mmap(-1, {SIZE})) for _ in ks]
out = run_load(store, 2, list(zip(ks, dests)))
want = rows({N}, {SIZE})
print(json.dumps(list(out.ok) + [d == w for d, w in zip(dests, want)]))
store.close()
"""
    assert in_shim(shim, code) == [True] * (2 * N)


def test_again_if_stale_stats_the_name_and_tries_once_more(shim, written):
    code = f"""
import json, os
from kvtier_offload import batchio
from kvtier_offload.layout import Layout
from tests.offload.conftest import keys, FP
path = Layout({str(written)!r}, FP).path(keys({N}, b"estale")[1])
tries = []
def attempt():
    tries.append(1)
    fd = os.open(path, batchio.READ_FLAGS)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
print(json.dumps([batchio.again_if_stale(path, attempt), len(tries)]))
"""
    assert in_shim(shim, code) == [4096 + SIZE, 2]


def test_again_if_stale_passes_other_errors_on_and_tries_once_only(tmp_path):
    calls = []

    def stale() -> None:
        calls.append(1)
        raise OSError(116, "Stale file handle")

    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(OSError) as err:
        batchio.again_if_stale(str(tmp_path / "f"), stale)
    assert err.value.errno == 116 and len(calls) == 2
    with pytest.raises(FileNotFoundError):  # the name is gone: a miss, no second try
        batchio.again_if_stale(str(tmp_path / "gone"), stale)
    assert len(calls) == 3
    with pytest.raises(PermissionError):
        batchio.again_if_stale(str(tmp_path / "f"), lambda: (_ for _ in ()).throw(
            PermissionError(13, "no")))


@pytest.mark.parametrize("batch_io", [
    True,
    False,
], ids=["batch", "python"])
@pytest.mark.parametrize(("times", "mkdir_says"), [
    (1, "ENOENT"),
    (3, "ENOENT"),
    (1, "EEXIST"),
], ids=["once", "three-times", "exists-but-not-made"])
def test_a_store_that_meets_another_node_creating_the_same_names_still_stores(
        shim, tmp_path, batch_io, times, mkdir_says):
    """tests/netfs' same-key writers on two nodes failed once so: node B's mkdir of a
    fan-out directory said ENOENT, node A's create of its temp file ESTALE, and neither
    stored the key. A fresh CI run's reader-beside-writer test met a fan-out directory's
    mkdir saying EEXIST for a directory it had not made, then ENOENT for every open of it
    for 0.1 s. Each of those is tried again (the mkdir with the open), a few times."""
    code = f"""
import json, mmap, os
from kvtier_offload.store import BlockStore, StoreConfig
from tests.offload.conftest import keys, rows, run_load, run_store, FP
store = BlockStore(StoreConfig(root={str(tmp_path)!r}, fingerprint=FP, batch_io={batch_io},
                               read_threads=2, write_threads=2))
if {mkdir_says!r} == "EEXIST":
    os.environ["KVTIER_TEST_RACE_EEXIST"] = "1"
os.environ["KVTIER_TEST_RACE"] = "{times}"  # now: each name's first mkdirs or creates fail
ks = keys({N}, b"race")
stored = run_store(store, 1, list(zip(ks, rows({N}, {SIZE}))))
del os.environ["KVTIER_TEST_RACE"]
for k in ks:
    store.forget(k)
dests = [memoryview(mmap.mmap(-1, {SIZE})) for _ in ks]
loaded = run_load(store, 2, list(zip(ks, dests)))
want = rows({N}, {SIZE})
print(json.dumps(list(stored.ok) + list(loaded.ok) + [d == w for d, w in zip(dests, want)]))
store.close()
"""
    assert in_shim(shim, code, stale="") == [True] * (3 * N)
