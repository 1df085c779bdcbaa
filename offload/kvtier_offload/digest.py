"""The payload digest of a block file: XXH3-64 with seed 0 (xxHash 0.8), so any tool can
verify a block (`tail -c +4097 FILE | xxhsum -H3`, python-xxhash's `xxh3_64`).

Computed by, in this order:
- the C extension (kvtier_offload._native, xxHash compiled in), GIL released for large
  buffers; the batch path hashes inside the extension itself;
- python-xxhash (the Python path's declared dependency, `kvtier[offload]`), where the
  extension is not importable: a machine without a compiler, a platform the image has no
  build for;
- nothing: AVAILABLE is False and REASON says why. The block store then refuses to start
  (store.NoDigest; `python -m kvtier_offload install` fails the init container first),
  rather than hashing in pure Python, which at a few MB/s would be slower than
  recomputing the KV, or serving every block as a miss without a word.

Not cryptographic: it guards against accidents (torn writes, bit rot, stale pages, foreign
files), not against someone who can write the volume, who could write any bytes anyway.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

from kvtier_offload import native

Buffer = bytes | bytearray | memoryview | mmap.mmap
SEED = 0  # part of the file format: XXH3_64bits(payload), the unseeded variant


def _pick() -> tuple[Callable[[Buffer], int] | None, str, str]:
    """(digest function, backend name, why not the extension)."""
    if native.module is not None:
        return native.module.digest, "native", ""
    try:
        import xxhash
    except ImportError:
        return None, "none", (f"{native.REASON}, and python-xxhash is not installed: no "
                              "XXH3-64 to verify blocks with")
    return xxhash.xxh3_64_intdigest, "xxhash", native.REASON


_digest, BACKEND, REASON = _pick()
AVAILABLE = _digest is not None


def digest(data: Buffer) -> int:
    """XXH3-64 (seed 0) of data's bytes, an unsigned 64-bit int."""
    if _digest is None:
        raise RuntimeError(f"no block digest here: {REASON}")
    return _digest(data)
