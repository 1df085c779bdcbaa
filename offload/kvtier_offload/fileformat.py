"""The self-describing block file: a 4 KiB header, then the payload.

    magic "KVTB" | version u16 | header size u16 | fingerprint 8 bytes | payload length u64
    | payload digest u64 | key length u16 | key | header crc32 u32 | zero padding to 4 KiB

Little endian. The header is a whole 4 KiB block so the payload stays aligned for
O_DIRECT. The header crc32 reads the digest field as zero, so a writer can fill the
header in before it has hashed the payload and patch only the digest afterwards (a
damaged digest field fails the payload check instead). A load trusts nothing it has not
checked: magic, version, fingerprint, key, length, header checksum and payload digest.

The payload digest is XXH3-64, seed 0 (digest.py), so any xxHash tool can verify a block
(versions: 1 crc32, 2 BLAKE3, 3 kvtier's own lane hash, 4 XXH3-64). A file of another
version is a miss, never an error: the fingerprint (layout.fingerprint) includes the
version, so each version has its own directory, and a stray file of another version at a
block's name fails the version check. docs/file-format.md describes the whole format.
"""

from __future__ import annotations

import functools
import struct
import zlib

MAGIC = b"KVTB"
VERSION = 4
HEADER_SIZE = 4096
_FIXED = struct.Struct("<4sHH8sQQH")
_PREFIX = struct.Struct("<4sHH8s")  # the fields every block of one configuration shares
_CRC = struct.Struct("<I")
_DIGEST = struct.Struct("<Q")
# Where the fields after the prefix start (the batch path builds headers from these).
LENGTH_OFFSET, DIGEST_OFFSET, KEY_LEN_OFFSET, KEY_OFFSET = 16, 24, 32, 34
assert _PREFIX.size == LENGTH_OFFSET and _FIXED.size == KEY_OFFSET
MAX_KEY = HEADER_SIZE - _FIXED.size - _CRC.size
_ZEROS = bytes(HEADER_SIZE)


class BadBlock(ValueError):
    """A block file that must not be served; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


@functools.lru_cache(maxsize=64)
def _fixed(fingerprint: str, payload_len: int, key_len: int) -> tuple[bytes, int]:
    """The fields before the key (digest zero) and their crc32: the same for every block
    of one geometry, so a header costs a crc32 of its key on top."""
    fixed = _FIXED.pack(MAGIC, VERSION, HEADER_SIZE, bytes.fromhex(fingerprint), payload_len,
                        0, key_len)
    return fixed, zlib.crc32(fixed)


def encode_header(fingerprint: str, key: bytes, payload_len: int, payload_digest: int) -> bytes:
    if len(key) > MAX_KEY:
        raise ValueError(f"key of {len(key)} bytes does not fit the header")
    fixed, crc = _fixed(fingerprint, payload_len, len(key))
    if payload_digest:
        fixed = fixed[:DIGEST_OFFSET] + _DIGEST.pack(payload_digest) + fixed[DIGEST_OFFSET + 8:]
    return b"".join((fixed, key, _CRC.pack(zlib.crc32(key, crc)),
                     _ZEROS[:HEADER_SIZE - _FIXED.size - len(key) - _CRC.size]))


def header_prefix(fingerprint: str) -> bytes:
    """The first LENGTH_OFFSET bytes of every header of this configuration."""
    return _PREFIX.pack(MAGIC, VERSION, HEADER_SIZE, bytes.fromhex(fingerprint))


def decode_header(header: bytes | memoryview, fingerprint: str, key: bytes,
                  payload_len: int) -> int:
    """Check a header against what the reader expects; returns the payload digest."""
    if len(header) < HEADER_SIZE:
        raise BadBlock("truncated", f"header of {len(header)} bytes")
    magic, version, size, fp, length, digest, key_len = _FIXED.unpack_from(header, 0)
    if magic != MAGIC:
        raise BadBlock("bad-magic", f"magic {bytes(magic)!r}")
    if version != VERSION or size != HEADER_SIZE:
        raise BadBlock("bad-version", f"format {version}/{size}")
    end = _FIXED.size + key_len
    if key_len > MAX_KEY:
        raise BadBlock("bad-header", f"key length {key_len}")
    (stored_crc,) = _CRC.unpack_from(header, end)
    checked = bytearray(header[:end])
    _DIGEST.pack_into(checked, DIGEST_OFFSET, 0)
    if zlib.crc32(checked) != stored_crc:
        raise BadBlock("bad-header", "header checksum mismatch")
    if fp != bytes.fromhex(fingerprint) or bytes(header[_FIXED.size:end]) != key:
        raise BadBlock("foreign", "fingerprint or key of another block")
    if length != payload_len:
        raise BadBlock("bad-length", f"payload {length} bytes, expected {payload_len}")
    return int(digest)


def padded(n: int) -> int:
    return -(-n // HEADER_SIZE) * HEADER_SIZE
