"""The counter-based dropout RNG of :mod:`mhattn.dropout_rng`, bit for bit, as Triton device functions.

All arithmetic is on ``tl.uint32`` so multiplication and addition wrap modulo 2**32 exactly as the torch
specification's masked int64 arithmetic does. For element (b, h, i, j) of a (B, H, Nq, Nk) attention:

    head_key = fmix32((b * H + h) * GOLDEN + seed0)            one per program
    row_key  = fmix32(head_key ^ (i * ROW_MULT + seed1))       one per query row of a tile
    bits     = fmix32(row_key ^ (j * COL_MULT))                one per score, i.e. one hash per element
    keep     = bits >= threshold

Seeds and the threshold travel as int32 bit patterns (backend._as_int32) so every launch sees the
same argument types and the kernels compile once.
"""

import triton
import triton.language as tl


@triton.jit
def fmix32(x):
    """MurmurHash3's 32-bit finaliser on a uint32 tensor."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def head_key(batch_head, seed0):
    """batch_head = b * H + h (int scalar); seed0: int32 bit pattern."""
    return fmix32(batch_head.to(tl.uint32) * 0x9E3779B9 + seed0.to(tl.uint32, bitcast=True))


@triton.jit
def row_keys(head_key_value, offs_m, seed1):
    """One key per query row: offs_m (BLOCK_M,) int -> (BLOCK_M,) uint32."""
    return fmix32(head_key_value ^ (offs_m.to(tl.uint32) * 0x85EBCA6B + seed1.to(tl.uint32, bitcast=True)))


@triton.jit
def column_hashes(offs_n):
    """The per-key term j * COL_MULT: offs_n (BLOCK_N,) int -> (BLOCK_N,) uint32."""
    return offs_n.to(tl.uint32) * 0xC2B2AE35


@triton.jit
def random_bits_tile(rows, cols):
    """Bits of a (BLOCK_M, BLOCK_N) tile from row keys (BLOCK_M,) and column hashes (BLOCK_N,)."""
    return fmix32(rows[:, None] ^ cols[None, :])


@triton.jit
def keep_tile(rows, cols, threshold):
    """Boolean (BLOCK_M, BLOCK_N) keep decisions; threshold: int32 bit pattern of the uint32 threshold."""
    return random_bits_tile(rows, cols) >= threshold.to(tl.uint32, bitcast=True)


@triton.jit
def keep_tile_transposed(rows, cols, threshold):
    """Boolean (BLOCK_N, BLOCK_M) keep decisions, the transpose of :func:`keep_tile`, for the key-major
    backward tiles: rows (BLOCK_M,) query row keys, cols (BLOCK_N,) column hashes."""
    return fmix32(cols[:, None] ^ rows[None, :]) >= threshold.to(tl.uint32, bitcast=True)


@triton.jit
def dropout_bits_kernel(Bits, heads, seqlen_q, seqlen_k, seed0, seed1,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the RNG's words for a whole (B, H, Nq, Nk) attention into Bits (int32 bit patterns,
    contiguous): the same helpers the attention kernels call, so tests compare them with the spec.
    Grid: (B * H, cdiv(Nq, BLOCK_M))."""
    batch_head = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = row_keys(head_key(batch_head, seed0), offs_m, seed1)
    base = Bits + batch_head.to(tl.int64) * seqlen_q * seqlen_k
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        bits = random_bits_tile(rows, column_hashes(offs_n))
        inside = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        ptrs = base + offs_m[:, None].to(tl.int64) * seqlen_k + offs_n[None, :]
        tl.store(ptrs, bits.to(tl.int32, bitcast=True), mask=inside)
