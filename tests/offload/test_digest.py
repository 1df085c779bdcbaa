"""The payload digest is XXH3-64 (seed 0): the same number xxhsum and python-xxhash give,
whichever backend computes it, and it sees what a checksum of KV blocks must see."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvtier_offload.digest import digest
from kvtier_offload.fileformat import HEADER_SIZE, decode_header

SIZES = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 255, 256, 1024, 4095, 4096, 4097,
         65536 + 13, 256 << 10, (1 << 20) + 4, (16 << 20) + 4096 + 260 + 3]


def test_digest_is_xxh3_64_as_xxhsum_computes_it():
    # Pinned by the file format (version 4): values from xxhsum 0.8.1 -H3, not from us.
    pattern = bytes(range(256)) * 1100 + b"kvtier"
    assert digest(b"") == 0x2D06800538D394C2
    assert digest(pattern) == 0xC1E7D10A3B5CEDBB
    assert digest(pattern * 40) == 0x51F5732D3F39FC5A
    assert digest(b"hello") == 0x9555E8555C62DCFD


@pytest.mark.parametrize("size", SIZES)
def test_digest_equals_python_xxhash(size):
    xxhash = pytest.importorskip("xxhash")
    data = np.random.default_rng(size).bytes(size)
    assert digest(data) == xxhash.xxh3_64_intdigest(data)


def test_digest_equals_xxhsum_for_every_length_class(tmp_path):
    # xxh3 has separate code for 0-16, 17-128, 129-240 and longer inputs.
    if shutil.which("xxhsum") is None:
        pytest.skip("xxhsum (Debian package xxhash) not installed")
    paths = []
    for size in SIZES[:-1]:
        path = tmp_path / f"{size}.bin"
        path.write_bytes(np.random.default_rng(size).bytes(size))
        paths.append(path)
    out = subprocess.run(["xxhsum", "-H3", *map(str, paths)], capture_output=True,
                         text=True, check=True).stdout
    theirs = {line.split("(")[1].split(")")[0]: int(line.rsplit("=", 1)[1], 16)
              for line in out.splitlines()}
    assert {str(p): digest(p.read_bytes()) for p in paths} == theirs


def test_any_address_and_buffer_type_give_the_same_digest():
    import mmap

    data = np.random.default_rng(3).bytes(70_000)
    shifted = memoryview(bytearray(b"?" + data))[1:]  # not 8-byte aligned
    mapped = mmap.mmap(-1, len(data))
    mapped[:] = data
    assert digest(shifted) == digest(data) == digest(bytearray(data)) == digest(mapped)
    assert digest(memoryview(data).toreadonly()) == digest(data)


def _variants(data: bytes) -> dict[str, bytes]:
    raw = bytearray(data)
    out = {}
    for pos in (0, 7, 255, 4096, len(raw) // 2, len(raw) - 1):
        for bit in (0, 3, 7):
            flipped = bytearray(raw)
            flipped[pos] ^= 1 << bit
            out[f"bit {bit} of byte {pos}"] = bytes(flipped)
    pages = bytearray(raw)  # two pages trade places
    pages[0:4096], pages[8192:12288] = raw[8192:12288], raw[0:4096]
    out["pages swapped"] = bytes(pages)
    zeroed = bytearray(raw)
    zeroed[4096:8192] = bytes(4096)
    out["page zeroed"] = bytes(zeroed)
    out["truncated by a word"] = bytes(raw[:-8])
    out["zero word appended"] = bytes(raw) + bytes(8)
    out["all zero"] = bytes(len(raw))
    return out


def test_every_kind_of_damage_changes_the_digest():
    data = np.random.default_rng(11).bytes(64 << 10)
    want = digest(data)
    changed = {name: digest(v) != want for name, v in _variants(data).items()}
    assert all(changed.values()), [name for name, ok in changed.items() if not ok]


def test_zero_pages_of_different_lengths_differ():
    assert len({digest(bytes(n)) for n in (0, 8, 4096, 8192, 256 << 10)}) == 5


def test_a_block_file_verifies_with_standard_tools(tmp_path, make_store):
    # Another implementation needs nothing of kvtier's to check a block: the digest field
    # of the header is XXH3-64 of the bytes after the 4 KiB header (docs/file-format.md).
    from tests.offload.conftest import FP, keys, rows, run_store

    store = make_store()
    (key,) = keys(1)
    (data,) = rows(1, 96 * 1024, seed=4)
    assert run_store(store, 1, [(key, data)]).success
    raw = open(store.layout.path(key), "rb").read()
    want = decode_header(raw[:HEADER_SIZE], FP, key, len(data))
    assert want == digest(raw[HEADER_SIZE:]) == digest(data)
    if shutil.which("xxhsum"):
        payload = tmp_path / "payload"
        payload.write_bytes(raw[HEADER_SIZE:])
        out = subprocess.run(["xxhsum", "-H3", str(payload)], capture_output=True, text=True,
                             check=True).stdout
        assert int(out.rsplit("=", 1)[1], 16) == want


def _python_only(extra: str = "") -> str:
    """Source for a process where the C extension does not import."""
    return f"""
import sys
sys.modules["kvtier_offload._native"] = None  # importing it now fails
{extra}
from kvtier_offload import digest, native
"""


def test_without_the_extension_python_xxhash_computes_the_same_digests(tmp_path):
    # python-xxhash is the Python path's declared dependency (kvtier[offload]).
    code = _python_only() + """
assert not native.AVAILABLE and digest.BACKEND == "xxhash", digest.BACKEND
print(*(digest.digest(bytes(range(256)) * n) for n in (0, 1, 100, 5000)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    here = [digest(bytes(range(256)) * n) for n in (0, 1, 100, 5000)]
    assert [int(x) for x in out.stdout.split()] == here


@pytest.mark.slow
def test_without_any_digest_the_store_refuses_to_start_and_says_why(tmp_path):
    # Neither the extension nor python-xxhash: no silent "every block is a miss". The store
    # raises NoDigest (vLLM fails at start), logs the reason, and its gauge says no-digest.
    code = _python_only('sys.modules["xxhash"] = None') + f"""
import logging
logging.basicConfig(level=logging.INFO)
assert not digest.AVAILABLE
from kvtier_offload.metrics import Metrics
from kvtier_offload.store import BlockStore, NoDigest, StoreConfig
metrics = Metrics()
try:
    BlockStore(StoreConfig(root={str(tmp_path)!r}, fingerprint="00112233aabbccdd"), metrics)
except NoDigest as err:
    print("refused:", err)
else:
    raise SystemExit("the store started without a digest")
import prometheus_client
print(prometheus_client.generate_latest().decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "refused: kvtier block store cannot start: no XXH3-64 digest" in out.stdout
    assert "python-xxhash is not installed" in out.stdout
    assert "ERROR:kvtier_offload:kvtier block store cannot start" in out.stderr
    assert 'kvtier_offload_native{reason="no-digest",tier="storage"} 0.0' in out.stdout
    assert not any(name.endswith(".kvb") for _, _, names in os.walk(tmp_path)
                   for name in names)
