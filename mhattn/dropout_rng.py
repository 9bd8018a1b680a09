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

The seed words of a call come from :func:`draw_seed`: an int64 tensor (2,) on the tensors' device, drawn
from that device's generator, so kernels read it from memory (a captured CUDA graph draws fresh words at
every replay) and ``torch.manual_seed`` / ``torch.cuda.manual_seed`` reproduce it. A seed may also be a
pair of ints (tests, the conformance suite); every function here takes either.
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
    if isinstance(seed, torch.Tensor):  # stays on the device: no host synchronisation
        words = seed.to(device=device, dtype=torch.int64) & MASK32
        seed0, seed1 = words[0], words[1]
    else:
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


def draw_seed(device) -> torch.Tensor:
    """Two fresh 32-bit seed words, int64 tensor (2,) on ``device``, from that device's default generator
    (the CUDA generator of a GPU's tensors, the CPU generator for CPU tensors). Safe under CUDA-graph
    capture: each replay of the graph draws new words."""
    return torch.randint(0, 2**32, (2,), dtype=torch.int64, device=device)


def seed_tensor(seed, device) -> torch.Tensor:
    """``seed`` (a pair of ints or an int64 tensor (2,)) as an int64 tensor (2,) on ``device``, for kernels
    that read their seed words from memory."""
    if isinstance(seed, torch.Tensor):
        if seed.device == device and seed.dtype == torch.int64:
            return seed
        return seed.to(device=device, dtype=torch.int64)
    return torch.tensor([int(s) & MASK32 for s in seed], dtype=torch.int64, device=device)


def seed_words(seed) -> tuple:
    """``seed`` as two Python ints (reads a tensor seed back to the host: not for captured code)."""
    if isinstance(seed, torch.Tensor):
        seed = seed.tolist()
    return int(seed[0]) & MASK32, int(seed[1]) & MASK32
