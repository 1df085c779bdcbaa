"""The payload digest of a block file: a 64-bit multiply-accumulate hash over 32 lanes.

Built for a checksum that runs at memory speed inside vLLM's Python:

- 32 independent 64-bit lanes (a 256-byte stripe per step), so the compiler vectorises
  the loop (AVX2/AVX-512/NEON); 16 stripes share a group, each at its own offset into a
  fixed secret, and every group ends with an invertible scramble of the lanes. So a
  flipped bit, a zeroed or stale page, a swap of two stripes or of two pages, and a
  truncation all change the digest, except with probability about 2^-64.
- compiled by numba (a vLLM dependency: nothing added to a vLLM image) with the GIL
  released, so every I/O thread hashes in parallel; about 5x faster than BLAKE3 on one
  core, 30+ GB/s from cache with AVX-512.
- where numba cannot be imported, the same function in numpy (slower, same digests), so
  the backend still imports with numpy alone. Tests hold the two to each other.

Not cryptographic: it guards against accidents (torn writes, bit rot, foreign files),
not against someone who can write the volume, who could write any bytes anyway.
"""

from __future__ import annotations

import mmap

import numpy as np

LANES = 32
GROUP = 16  # stripes per scramble
_MASK = (1 << 64) - 1
_PRIME_32 = 0x9E3779B1
_PRIME_A = 0x9E3779B185EBCA87
_PRIME_B = 0x165667919E3779F9


def _secret(count: int, seed: int = 0x6B7674696572) -> np.ndarray:
    """Fixed lane keys (splitmix64 from a constant seed): part of the file format."""
    out = []
    state = seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return np.array(out, dtype=np.uint64)


SECRET = _secret(LANES + GROUP)  # stripe k of a group uses SECRET[k:k + LANES]


def _fold(acc: list[int], words: list[int], nbytes: int) -> int:
    """Lanes, leftover words and the length into one 64-bit digest (both backends)."""
    h = (nbytes * _PRIME_A) & _MASK
    for w in (*acc, *words):
        h = ((h ^ w) * _PRIME_B) & _MASK
        h ^= h >> 32
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    h ^= h >> 33
    return h


def _lanes_numpy(words: np.ndarray) -> np.ndarray:
    """The lane accumulators after every whole stripe. Within a group the additions
    commute, so each group's sum is one vectorised reduction; groups chain in order."""
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    keys = np.lib.stride_tricks.sliding_window_view(SECRET, LANES)[:GROUP]  # (16, LANES)
    acc = SECRET[GROUP:GROUP + LANES].copy() ^ np.uint64(_PRIME_A)
    stripes = len(words) // LANES
    groups = stripes // GROUP
    with np.errstate(over="ignore"):
        if groups:
            x = words[:groups * GROUP * LANES].reshape(groups, GROUP, LANES)
            dk = x ^ keys
            sums = (x + (dk & mask) * (dk >> shift)).sum(axis=1, dtype=np.uint64)
            for part in sums:
                acc += part
                acc = (acc ^ (acc >> np.uint64(47)) ^ SECRET[:LANES]) * np.uint64(_PRIME_32)
        rest = stripes - groups * GROUP
        if rest:
            x = words[groups * GROUP * LANES:stripes * LANES].reshape(rest, LANES)
            dk = x ^ keys[:rest]
            acc += (x + (dk & mask) * (dk >> shift)).sum(axis=0, dtype=np.uint64)
    return acc


def _stripe_loop() -> object:
    """The absorb loop as LLVM vector IR, for numba code: (lanes address, words address,
    whole stripes, SECRET address) -> None. The lanes stay in four 8x64-bit registers for
    the whole loop; written as a numba loop over arrays, LLVM could not prove that the
    lanes, the words and the secret do not overlap, so it reloaded and stored the lanes
    at every stripe behind runtime overlap checks: 1.75x slower on data in cache, where
    a load hashes what it has just read. Same arithmetic as _lanes_numpy, same digests."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    i64 = ir.IntType(64)
    vec = ir.VectorType(i64, 8)  # LLVM splits it for narrower SIMD (AVX2, SSE2, NEON)

    def const(value: int) -> ir.Constant:
        return ir.Constant(i64, value)

    def splat(value: int) -> ir.Constant:
        return ir.Constant(vec, [value] * 8)

    @intrinsic
    def stripes_of(typingctx: object, lanes: object, words: object, count: object,
                   secret: object) -> object:  # pragma: no cover (emits IR)
        sig = types.void(types.int64, types.int64, types.int64, types.int64)

        def codegen(context: object, builder: ir.IRBuilder, signature: object,
                    args: list) -> object:
            lanes_at, words_at, count, secret_at = args
            lanes_p = builder.inttoptr(lanes_at, vec.as_pointer())
            words_p = builder.inttoptr(words_at, i64.as_pointer())
            secret_p = builder.inttoptr(secret_at, i64.as_pointer())

            def vector_at(base: ir.Value, index: ir.Value) -> ir.Value:
                where = builder.gep(base, [index])
                return builder.load(builder.bitcast(where, vec.as_pointer()), align=8)

            def meet(one: list, one_from: ir.Block, other: list,
                     other_from: ir.Block) -> list:
                # The four lane vectors where two paths join.
                out = []
                for a, b in zip(one, other, strict=True):
                    phi = builder.phi(vec)
                    phi.add_incoming(a, one_from)
                    phi.add_incoming(b, other_from)
                    out.append(phi)
                return out

            first = [builder.load(builder.gep(lanes_p, [const(j)]), align=8)
                     for j in range(4)]
            entry = builder.block
            body = builder.append_basic_block("stripe")
            scramble = builder.append_basic_block("scramble")
            step = builder.append_basic_block("next_stripe")
            done = builder.append_basic_block("stripes_done")
            builder.cbranch(builder.icmp_signed(">", count, const(0)), body, done)

            builder.position_at_end(body)
            s = builder.phi(i64)
            acc = [builder.phi(vec) for _ in range(4)]
            k = builder.and_(s, const(15))  # stripe k of its group: keys at SECRET[k:]
            base = builder.mul(s, const(32))
            added = []
            for j in range(4):
                d = vector_at(words_p, builder.add(base, const(8 * j)))
                dk = builder.xor(d, vector_at(secret_p, builder.add(k, const(8 * j))))
                product = builder.mul(builder.and_(dk, splat(0xFFFFFFFF)),
                                      builder.lshr(dk, splat(32)))
                added.append(builder.add(acc[j], builder.add(d, product)))
            after_body = builder.block
            builder.cbranch(builder.icmp_unsigned("==", k, const(15)), scramble, step)

            builder.position_at_end(scramble)  # the last stripe of a group
            mixed = []
            for j in range(4):
                a = added[j]
                a = builder.xor(builder.xor(a, builder.lshr(a, splat(47))),
                                vector_at(secret_p, const(8 * j)))
                mixed.append(builder.mul(a, splat(_PRIME_32)))
            builder.branch(step)

            builder.position_at_end(step)
            merged = meet(added, after_body, mixed, scramble)
            s_next = builder.add(s, const(1))
            s.add_incoming(const(0), entry)
            s.add_incoming(s_next, step)
            for j in range(4):
                acc[j].add_incoming(first[j], entry)
                acc[j].add_incoming(merged[j], step)
            builder.cbranch(builder.icmp_signed("<", s_next, count), body, done)

            builder.position_at_end(done)
            for j, lanes in enumerate(meet(first, entry, merged, step)):
                builder.store(lanes, builder.gep(lanes_p, [const(j)]), align=8)
            return context.get_dummy_value()

        return sig, codegen

    return stripes_of


def _compile() -> tuple[object, object, object, object]:
    import numba
    from numba import types, uint64

    if numba.config.DISABLE_JIT:
        raise ImportError("NUMBA_DISABLE_JIT is set")

    shift = uint64(32)
    prime_a, prime_b = uint64(_PRIME_A), uint64(_PRIME_B)
    fmix = uint64(0xFF51AFD7ED558CCD)
    jit = numba.njit(nogil=True, boundscheck=False, error_model="numpy")

    # The numpy path above, line for line, plus _fold; tests hold the two together. In
    # parts, so that a writer or reader can hash a large block piece by piece, each piece
    # while it is in cache: lanes = start(); absorb(lanes, words) for each piece in order
    # (whole groups but the last); finish(lanes, the words after the last whole stripe).
    @jit
    def start(secret: np.ndarray) -> np.ndarray:  # pragma: no cover (machine code)
        acc = np.empty(32, np.uint64)
        for i in range(32):
            acc[i] = secret[16 + i] ^ prime_a
        return acc

    stripes_of = _stripe_loop()

    @jit
    def absorb(acc: np.ndarray, words: np.ndarray,
               secret: np.ndarray) -> None:  # pragma: no cover (machine code)
        # The whole stripes of words, which start a group of the block: every call but
        # the last must bring whole groups (4 KiB).
        stripes_of(acc.ctypes.data, words.ctypes.data, words.shape[0] // 32,
                   secret.ctypes.data)

    @jit
    def finish(acc: np.ndarray, rest: np.ndarray, tail: int,
               nbytes: int) -> int:  # pragma: no cover (machine code)
        h = nbytes * prime_a
        for i in range(32):
            h = (h ^ acc[i]) * prime_b
            h ^= h >> shift
        for j in range(rest.shape[0]):
            h = (h ^ rest[j]) * prime_b
            h ^= h >> shift
        if nbytes % uint64(8):
            h = (h ^ tail) * prime_b
            h ^= h >> shift
        h ^= h >> uint64(33)
        h *= fmix
        h ^= h >> uint64(33)
        return h

    signatures = [uint64(types.Array(uint64, 1, "C", readonly=readonly), uint64[::1],
                         uint64, uint64) for readonly in (False, True)]

    @numba.njit(signatures, nogil=True, boundscheck=False, error_model="numpy")
    def whole(words: np.ndarray, secret: np.ndarray, tail: int,
              nbytes: int) -> int:  # pragma: no cover (runs as machine code)
        acc = start(secret)
        cut = words.shape[0] // 32 * 32
        absorb(acc, words[:cut], secret)
        return finish(acc, words[cut:], tail, nbytes)

    return whole, start, absorb, finish


# The machine-code digest of whole words, (words, SECRET, tail word, nbytes) -> digest;
# callable from other numba code (batchio), or None where numba is not usable.
# Its parts, for numba code that hashes a block piece by piece (see _compile):
# digest_start(SECRET) -> lanes; digest_absorb(lanes, words, SECRET) for each piece in
# order, 4 KiB multiples but the last; digest_finish(lanes, rest words, tail, nbytes).
try:
    digest_words, digest_start, digest_absorb, digest_finish = _compile()
    UNCOMPILED_REASON = ""
except Exception as err:  # numba missing, or cannot compile for this CPU
    digest_words = digest_start = digest_absorb = digest_finish = None
    UNCOMPILED_REASON = f"{type(err).__name__}: {err}"
COMPILED = digest_words is not None


def digest(data: bytes | bytearray | memoryview | mmap.mmap,
           compiled: bool = COMPILED) -> int:
    """The 64-bit digest of data (any length)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    nbytes = len(raw)
    whole = nbytes // 8
    words = raw[:whole * 8].view("<u8")
    if not (words.dtype.isnative and words.flags.aligned):
        words = words.astype(np.uint64)  # big-endian host or an odd address: copy
    tail = int.from_bytes(raw[whole * 8:].tobytes(), "little")
    if compiled:
        return int(digest_words(words, SECRET, tail, nbytes))  # type: ignore[operator]
    acc = [int(a) for a in _lanes_numpy(words)]
    rest = [int(w) for w in words[len(words) // LANES * LANES:]]
    return _fold(acc, rest + ([tail] if nbytes % 8 else []), nbytes)
