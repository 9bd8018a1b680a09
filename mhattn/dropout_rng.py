"""The counter-based dropout RNG every built-in backend implements bit for bit.

The keep decision for element (b, h, i, j) of a (B, H, Nq, Nk) attention is a pure function of the two
32-bit seed words and the element's coordinates, so a kernel never stores the mask and the backward
pass (or a test) regenerates exactly the same one. All arithmetic is on unsigned 32-bit words,
wrapping modulo 2**32; ``fmix32`` is MurmurHash3's finaliser (a bijection with full avalanche):

    bh_key  = fmix32((b * H + h) * 0x9E3779B9 + seed0)
    row_key = fmix32(bh_key ^ (i * 0x85EBCA6B + seed1))
    bits    = fmix32(row_key ^ (j * 0xC2B2AE35))
    keep    = bits >= threshold(p),   threshold(p) = min(floor(p * 2**32), 2**32 - 1)

so P(keep) = 1 - p up to 2**-32. Kept probabilities are scaled by 1 / (1 - p).
This module is the specification in torch (int64 arithmetic, any device); the Triton and CUDA kernels
implement the same steps.
"""

from __future__ import annotations

import torch

GOLDEN = 0x9E3779B9
ROW_MULT = 0x85EBCA6B
COL_MULT = 0xC2B2AE35
FMIX_1 = 0x85EBCA6B
FMIX_2 = 0xC2B2AE35
MASK32 = 0xFFFFFFFF


def threshold(p: float) -> int:
    """The 32-bit threshold under which an element is dropped."""
    return min(int(p * 4294967296.0), MASK32)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 without overflowing int64: split x into 16-bit halves.
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_2)
    return x ^ (x >> 16)


def random_bits(seed, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """The 32-bit words (as int64) the RNG draws for every element of a (B, H, Nq, Nk) attention."""
    seed0, seed1 = (int(s) & MASK32 for s in seed)
    bh = torch.arange(batch * heads, dtype=torch.int64, device=device)
    i = torch.arange(seqlen_q, dtype=torch.int64, device=device)
    j = torch.arange(seqlen_k, dtype=torch.int64, device=device)
    bh_key = fmix32((_mul32(bh, GOLDEN) + seed0) & MASK32)
    row_key = fmix32(bh_key[:, None] ^ ((_mul32(i, ROW_MULT) + seed1) & MASK32)[None, :])
    bits = fmix32(row_key[:, :, None] ^ _mul32(j, COL_MULT)[None, None, :])
    return bits.view(batch, heads, seqlen_q, seqlen_k)


def keep_mask(seed, batch: int, heads: int, seqlen_q: int, seqlen_k: int, p: float, device=None) -> torch.Tensor:
    """Boolean (B, H, Nq, Nk): True where dropout with probability ``p`` keeps the element."""
    if p <= 0.0:
        return torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    return random_bits(seed, batch, heads, seqlen_q, seqlen_k, device=device) >= threshold(p)


def new_seed(generator=None) -> tuple:
    """Two fresh 32-bit seed words from torch's (CPU) generator, so torch.manual_seed reproduces them."""
    words = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator)
    return int(words[0]), int(words[1])
