# The C extension built from offload/csrc/kvtier_native.c (stable ABI); see batchio.py.
# Every bytes-like argument takes any object with the buffer protocol (numpy arrays
# included); the arrays an entry point fills must be writable, C-contiguous, and hold
# 8-byte elements (int64 status and last use, float64 elapsed), one per block.

from typing import Any

import numpy as np
from typing_extensions import Buffer

_Bytes = Buffer | np.ndarray[Any, Any]

FORMAT_VERSION: int
HEADER_SIZE: int
LENGTH_OFFSET: int
DIGEST_OFFSET: int
KEY_LEN_OFFSET: int
KEY_OFFSET: int
MIN_KEY_BYTES: int
MAX_KEY_BYTES: int
DONE: int
NOT_DONE: int
EXISTS: int
BATCH_API: int
XXHASH_VERSION: int
XXH3_BUILD: str
SUFFIX: str
TEMP_SUFFIX: str

def read_batch(dirfd: int, base: _Bytes, prefix: _Bytes, keys: _Bytes, bounds: _Bytes,
               addresses: _Bytes, sizes: _Bytes, headers: _Bytes, flags: int, piece: int,
               status: _Bytes, last_used: _Bytes, elapsed: _Bytes, /) -> None: ...
def write_batch(dirfd: int, base: _Bytes, prefix: _Bytes, keys: _Bytes, bounds: _Bytes,
                token: _Bytes, addresses: _Bytes, sizes: _Bytes, headers: _Bytes, flags: int,
                fsync: bool, piece: int, status: _Bytes, elapsed: _Bytes, /) -> None: ...
def built(base: _Bytes, prefix: _Bytes, key: _Bytes, token: _Bytes, size: int,
          /) -> tuple[bytes, bytes]: ...
def open_beneath(dirfd: int, path: _Bytes, flags: int, mode: int, /) -> int: ...
def digest(buffer: _Bytes, /) -> int: ...
def address(buffer: _Bytes, /) -> int: ...
