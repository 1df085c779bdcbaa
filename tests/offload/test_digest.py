"""The payload digest: the compiled and numpy paths agree, and it sees what a checksum
of KV blocks must see."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier_offload import digest as dg
from kvtier_offload.digest import digest
from tests.offload.conftest import round_trip_source

SIZES = [0, 1, 7, 8, 9, 255, 256, 257, 4095, 4096, 4097, 8192, 65536 + 13, 256 << 10,
         (1 << 20) + 4, (16 << 20) + 4096 + 260 + 3]


@pytest.mark.skipif(not dg.COMPILED, reason="numba not importable here")
@pytest.mark.parametrize("size", SIZES)
def test_compiled_and_numpy_paths_agree(size):
    data = np.random.default_rng(size).bytes(size)
    assert digest(data, compiled=True) == digest(data, compiled=False)


@pytest.mark.skipif(not dg.COMPILED, reason="numba not importable here")
def test_compiled_path_releases_the_gil():
    # The I/O threads hash in parallel only because the machine code drops the GIL.
    assert dg.digest_words.targetoptions["nogil"] is True


def test_digest_is_pinned_by_the_file_format():
    # These values are part of block file format 3: a change here needs a new VERSION.
    pattern = bytes(range(256)) * 1100 + b"kvtier"
    assert digest(b"") == 0x1E955535A69DE3A0
    assert digest(pattern) == 0x6B95D350CF24389B
    assert digest(pattern, compiled=False) == 0x6B95D350CF24389B
    large = pattern * 40  # thousands of groups
    assert digest(large) == digest(large, compiled=False) == 0x5214CD997FA48502


@pytest.mark.skipif(not dg.COMPILED, reason="numba not importable here")
@pytest.mark.parametrize("cpu", ["haswell", "x86-64"])
def test_builds_for_narrower_cpus_give_the_same_digests(cpu):
    # The stripe loop is vector IR that LLVM splits for whatever SIMD the host has: an
    # AVX2 or a baseline SSE2 build must give the digests this (widest) one does.
    import platform
    import subprocess
    import sys

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 CPU names")
    code = ("import numba, numpy as np; from kvtier_offload import digest as dg; "
            f"assert dg.COMPILED and numba.config.CPU_NAME == {cpu!r}; "
            f"print(*(dg.digest(np.random.default_rng(n).bytes(n)) for n in {SIZES}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "NUMBA_CPU_NAME": cpu,
                                          "NUMBA_CPU_FEATURES": ""})
    here = [digest(np.random.default_rng(n).bytes(n)) for n in SIZES]
    assert [int(x) for x in out.stdout.split()] == here


def test_any_address_and_buffer_type_give_the_same_digest():
    data = np.random.default_rng(3).bytes(70_000)
    shifted = memoryview(bytearray(b"?" + data))[1:]  # not 8-byte aligned
    assert digest(shifted) == digest(data) == digest(bytearray(data))


def _variants(data: bytes) -> dict[str, bytes]:
    raw = bytearray(data)
    out = {}
    for pos in (0, 7, 255, 4096, len(raw) // 2, len(raw) - 1):
        for bit in (0, 3, 7):
            flipped = bytearray(raw)
            flipped[pos] ^= 1 << bit
            out[f"bit {bit} of byte {pos}"] = bytes(flipped)
    swapped = bytearray(raw)  # two stripes of one group trade places
    swapped[0:256], swapped[256:512] = raw[256:512], raw[0:256]
    out["stripes swapped"] = bytes(swapped)
    pages = bytearray(raw)  # two pages in different groups trade places
    pages[0:4096], pages[8192:12288] = raw[8192:12288], raw[0:4096]
    out["pages swapped"] = bytes(pages)
    zeroed = bytearray(raw)
    zeroed[4096:8192] = bytes(4096)
    out["page zeroed"] = bytes(zeroed)
    out["truncated by a word"] = bytes(raw[:-8])
    out["zero word appended"] = bytes(raw) + bytes(8)
    out["all zero"] = bytes(len(raw))
    return out


@pytest.mark.parametrize("compiled", [True, False])
def test_every_kind_of_damage_changes_the_digest(compiled):
    if compiled and not dg.COMPILED:
        pytest.skip("numba not importable here")
    data = np.random.default_rng(11).bytes(64 << 10)
    want = digest(data, compiled=compiled)
    changed = {name: digest(v, compiled=compiled) != want
               for name, v in _variants(data).items()}
    assert all(changed.values()), [name for name, ok in changed.items() if not ok]


def test_zero_pages_at_different_offsets_differ():
    # A block of zeros and a zero block of another length must not collide.
    assert len({digest(bytes(n)) for n in (0, 8, 4096, 8192, 256 << 10)}) == 5


def test_without_numba_the_backend_writes_and_reads_the_same_files(tmp_path):
    # What the sidecar image's import check and a vLLM image without numba get.
    import subprocess
    import sys

    code = """
import sys
sys.modules["numba"] = None  # import numba now fails
from kvtier_offload import digest, batchio
assert not digest.COMPILED and not batchio.AVAILABLE
""" + round_trip_source(str(tmp_path)) + """
print(store.layout.path(b"k" * 36))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    path = out.stdout.strip()
    assert "block digests run in numpy" in out.stderr  # said once, at start
    raw = open(path, "rb").read()
    from kvtier_offload.fileformat import decode_header
    assert decode_header(raw[:4096], "00112233aabbccdd", b"k" * 36, 256 * 1024) == digest(
        raw[4096:])  # the compiled digest here agrees with the numpy one there


def test_numba_with_its_jit_disabled_counts_as_missing():
    import subprocess
    import sys

    code = ("from kvtier_offload import digest, batchio; "
            "print(digest.COMPILED, batchio.AVAILABLE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "NUMBA_DISABLE_JIT": "1"})
    assert out.stdout.split() == ["False", "False"]  # not Python stand-ins that would fail


@pytest.mark.skipif(not dg.COMPILED, reason="numba not importable here")
def test_the_parts_piece_by_piece_give_the_whole_digest():
    words = np.random.default_rng(5).integers(0, 2**63, (5 * 4096 + 40) // 8, dtype=np.uint64)
    nbytes = np.uint64(len(words) * 8)
    want = dg.digest_words(words, dg.SECRET, np.uint64(0), nbytes)
    for piece in (4096, 8192, 12288):
        lanes = dg.digest_start(dg.SECRET)
        for at in range(0, len(words), piece // 8):
            dg.digest_absorb(lanes, words[at:at + piece // 8], dg.SECRET)
        cut = len(words) // 32 * 32
        assert dg.digest_finish(lanes, words[cut:], np.uint64(0), nbytes) == want
