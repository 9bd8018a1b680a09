"""Block sizes, warps and pipeline stages of the Triton kernels, per GPU generation, dtype, head dim
and causality, as data.

A configuration gives each of the three main kernels its tile:

- ``forward``: BLOCK_M query rows per program, BLOCK_N keys per inner step.
- ``dkdv``: BLOCK_N keys per program (the block it owns), BLOCK_M query rows per inner step.
- ``dq``: BLOCK_M query rows per program, BLOCK_N keys per inner step.

Lookup order: a pinned configuration (``pin()`` or the environment variable read once at import)
> the table entry for (architecture, dtype class, padded head dim, causal) > a generic fallback.
If a tile does not fit the device (Triton raises OutOfResources), the backend halves it and caches
the result (see :func:`shrink`).

``MHATTN_TRITON_CONFIG``: ``"BM,BN,W,S"`` for all three kernels, or per kernel
``"fwd=128,64,8,3;dkdv=64,128,8,2;dq=128,64,8,2"`` (BLOCK_M, BLOCK_N, num_warps, num_stages). A tile may
end in flags: ``tma`` (tiles loaded by the copy engine through tensor descriptors, sm_90+) and ``ws``
(warp-specialised inner loops, sm_90+), e.g. ``"fwd=128,128,8,3,tma,ws"``; ``dq=atomic`` or ``dq=tma``
instead of a dQ tile sums dQ inside the dK/dV kernel (see :data:`DQ_MODES`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

ENV_VAR = "MHATTN_TRITON_CONFIG"


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Hopper paths (sm_90+): K/V (and Q/dO in the backward) loaded by the copy engine (TMA) through
    # tensor descriptors built in the kernel; inner loops warp-specialised by Triton (a producer warp
    # issues the copies, the others compute).
    tma: bool = False
    warp_specialize: bool = False

    def __str__(self):
        flags = (",tma" if self.tma else "") + (",ws" if self.warp_specialize else "")
        return f"{self.block_m},{self.block_n},{self.num_warps},{self.num_stages}{flags}"


# How the backward sums dQ:
# - "separate": a dQ kernel per query block recomputes S and dP (7 matrix products in all, no atomics,
#   bitwise reproducible);
# - "atomic": the dK/dV kernel also forms dS K for each step and adds it into a float32 buffer with
#   atomics (5 matrix products; the order of the additions varies between runs);
# - "tma": as "atomic", with the copy engine's bulk reduce-add of the whole tile (sm_90+).
DQ_MODES = ("separate", "atomic", "tma")


@dataclass(frozen=True)
class AttentionConfig:
    forward: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig
    dq_mode: str = "separate"

    def __post_init__(self):
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {self.dq_mode!r}")

    def __str__(self):
        dq = self.dq_mode if self.dq_mode != "separate" else self.dq
        return f"fwd={self.forward};dkdv={self.dkdv};dq={dq}"

    def deterministic(self) -> "AttentionConfig":
        """The same tiles with dQ summed by the separate kernel (no atomics)."""
        return replace(self, dq_mode="separate")


def _k(bm, bn, w, s, tma=False, ws=False):
    return KernelConfig(bm, bn, w, s, tma, ws)


# (arch, dtype class, padded head dim, causal) -> AttentionConfig.
# arch: "sm90" (Hopper), "sm80" (A100 class, 164 KiB shared memory), "sm86" (consumer Ampere/Ada,
# ~100 KiB shared memory). dtype class: "half" (fp16/bf16), "fp32" (TF32 dots) or "fp32-ieee" (full-precision
# float32 dots). Padded head dim: 16..256.
# Hopper entries come from benchmarks/dev_triton.py sweeps on an H100 (bf16; backends/triton/NOTES.md);
# the others are conservative choices that fit the shared memory of those parts.
TABLE = {}


def _fill_defaults():
    # Hopper, 16-bit: measured on an H100 (benchmarks/dev_triton.py sweep --hopper, bf16, N = 4096,
    # coordinate-wise; backends/triton/NOTES.md, version 4). dK/dV tiles of 64 query rows (one wgmma M per
    # warpgroup) with Q and dO through the copy engine gained 15-20% in the backward at d = 128; the forward
    # gains from the copy engine only at d = 256; warp specialisation measured within noise and is not used.
    for causal in (False, True):
        for d in (16, 32, 64):
            TABLE[("sm90", "half", d, causal)] = AttentionConfig(_k(128, 64, 4, 3), _k(64, 64, 4, 2, tma=True),
                                                                 _k(64, 64, 4, 3))
        TABLE[("sm90", "half", 128, causal)] = AttentionConfig(_k(128, 128, 8, 3), _k(64, 64, 4, 2, tma=True),
                                                               _k(128, 64, 8, 3))
        TABLE[("sm90", "half", 256, causal)] = AttentionConfig(_k(128, 64, 8, 2, tma=True), _k(64, 32, 4, 2, tma=True),
                                                               _k(128, 32, 8, 3))
    # Ampere and the rest: conservative tiles that fit their shared memory (not measured here).
    for causal in (False, True):
        for d in (16, 32, 64):
            TABLE[("sm80", "half", d, causal)] = AttentionConfig(_k(128, 64, 4, 3), _k(32, 64, 4, 3), _k(64, 64, 4, 3))
            TABLE[("sm86", "half", d, causal)] = AttentionConfig(_k(64, 64, 4, 2), _k(32, 64, 4, 2), _k(64, 32, 4, 2))
        TABLE[("sm80", "half", 128, causal)] = AttentionConfig(_k(128, 64, 8, 2), _k(32, 128, 8, 2), _k(64, 64, 4, 2))
        TABLE[("sm86", "half", 128, causal)] = AttentionConfig(_k(64, 32, 4, 2), _k(32, 64, 4, 2), _k(64, 32, 4, 2))
        TABLE[("sm80", "half", 256, causal)] = AttentionConfig(_k(64, 32, 4, 2), _k(32, 32, 8, 2), _k(64, 32, 4, 2))
        TABLE[("sm86", "half", 256, causal)] = AttentionConfig(_k(32, 32, 4, 1), _k(16, 32, 4, 1), _k(32, 16, 4, 1))
        for d in (16, 32, 64):
            TABLE[("sm80", "fp32", d, causal)] = AttentionConfig(_k(64, 64, 4, 2), _k(32, 64, 4, 2), _k(64, 32, 4, 2))
        TABLE[("sm80", "fp32", 128, causal)] = AttentionConfig(_k(64, 32, 4, 2), _k(32, 64, 4, 1), _k(64, 32, 4, 1))
        TABLE[("sm80", "fp32", 256, causal)] = AttentionConfig(_k(32, 32, 4, 1), _k(16, 32, 4, 1), _k(32, 16, 4, 1))
        for d in (16, 32, 64, 128, 256):
            TABLE[("sm86", "fp32", d, causal)] = AttentionConfig(_k(32, 32, 4, 1), _k(16, 32, 4, 1), _k(32, 16, 4, 1))
        # float32 on sm_90, and the "ieee" entries, chosen by the compiler's report (triton 3.6, sm_90, causal and
        # not: no stack, i.e. no register spills; not timed): the sm_80 tiles above spill with the "ieee" dot
        # precision (torch's default for float32 matmuls, which Triton runs on the CUDA cores) by 0.3-11 KB per
        # thread, and their TF32 backward tiles by 72-744 B on sm_90. On sm_80 the ieee ones keep 8-48 B (dQ,
        # and dK/dV at d = 128; d = 256 not checked there).
        for arch in ("sm90", "sm80"):
            for d in (16, 32, 64):
                TABLE[(arch, "fp32-ieee", d, causal)] = AttentionConfig(_k(32, 32, 8, 2), _k(16, 64, 8, 2),
                                                                        _k(32, 64, 8, 2))
            TABLE[(arch, "fp32-ieee", 128, causal)] = AttentionConfig(_k(32, 16, 8, 2), _k(16, 32, 8, 2),
                                                                      _k(32, 32, 8, 2))
            TABLE[(arch, "fp32-ieee", 256, causal)] = AttentionConfig(_k(16, 16, 8, 2), _k(16, 16, 8, 2),
                                                                      _k(32, 16, 8, 1))
        for d in (16, 32, 64):
            TABLE[("sm90", "fp32", d, causal)] = AttentionConfig(_k(64, 64, 4, 2), _k(64, 32, 8, 2), _k(64, 32, 4, 2))
        TABLE[("sm90", "fp32", 128, causal)] = AttentionConfig(_k(64, 32, 4, 2), _k(32, 32, 8, 2), _k(32, 64, 8, 2))
        TABLE[("sm90", "fp32", 256, causal)] = AttentionConfig(_k(32, 32, 4, 1), _k(16, 32, 8, 1), _k(32, 16, 4, 1))


_fill_defaults()

# Short sequences (Nq <= SHORT_SEQLEN): the forward's tile by key count, the first entry whose key bound (None: any)
# holds. More programs, and less of a short key set's last block wasted. Measured on an H200 (bf16, B=32 H=12 at d = 64,
# B=16 H=16 at d = 128, CUDA-graph replay; backends/triton/NOTES.md "Short forward tiles"), as the table tile's time
# over this one's: at d = 64 without a causal mask 128 x 32 tiles up to 256 keys (1.05-1.42x at 77-256 keys) and 64 x 32
# above; with a causal mask 64-row tiles (1.05-1.39x at 77-1000 keys); at d = 128 64 x 32 tiles, causal or not
# (1.00-1.12x at 128-1000 keys; the 64 x 64 tile they replace keeps 32 B a thread on the stack). Above 256 keys at
# d = 64 the Gluon forward takes plain calls from hopper_launch.MIN_KEYS, so this tile runs 257-383 keys without a mask
# and masked, dropout, window and softcap calls: 64 x 32 with 4 warps (at most 248 registers a thread with a mask, two
# programs an SM) against 128 x 64 with 8 warps (220 with a mask, one program an SM): 1.44-1.47x at 512-1024 keys with
# a key-padding mask, 1.13-1.18x with dropout, 1.95x with a window, 1.05-1.26x at 288-352 keys without a mask, 0.98x
# at 383 (NOTES "forward.py's short tile above 256 keys").
SHORT_SEQLEN = 1024
SHORT_FORWARD = {
    ("sm90", "half", 64, False): ((256, _k(128, 32, 4, 3)), (None, _k(64, 32, 4, 3))),
    ("sm90", "half", 64, True): ((None, _k(64, 64, 4, 2)),),
    ("sm90", "half", 128, False): ((None, _k(64, 32, 4, 3)),),
    ("sm90", "half", 128, True): ((None, _k(64, 32, 4, 3)),),
}
# Calls that read a mask (boolean or float), where SHORT_FORWARD's tile would spill: 128 x 32 with 4 warps at d = 64
# keeps 192 B (boolean) and 264 B (float) of stack a thread with a mask (255 registers, compiler report, sm_90, bf16);
# 64 x 32 with 4 warps keeps none (248 registers). On the H200 at 197 keys with a key-padding mask the two read 48.8
# and 48.0 us (B=32 H=12; backends/triton/NOTES.md "forward.py's short tile above 256 keys").
SHORT_FORWARD_MASKED = {
    ("sm90", "half", 64, False): ((None, _k(64, 32, 4, 3)),),
}


def short_forward_tile(key: tuple, seqlen_k: int, masked: bool = False) -> Optional[KernelConfig]:
    """SHORT_FORWARD's tile (SHORT_FORWARD_MASKED's first where it has the key and the call reads a mask) for a table
    key and ``seqlen_k`` keys; None where the table's own tile runs."""
    entries = (masked and SHORT_FORWARD_MASKED.get(key)) or SHORT_FORWARD.get(key, ())
    for most_keys, tile in entries:
        if most_keys is None or seqlen_k <= most_keys:
            return tile
    return None


# The short backward (backward.backward_short_kernel: one launch, all keys in one block): dK and dV of BLOCK_N keys
# stay in registers as BLOCK_N * (BLOCK_D + BLOCK_DV) float32 accumulators, at most SHORT_BACKWARD_ACCUMULATORS (64 a
# thread over 8 warps) and BLOCK_N <= SHORT_BACKWARD_MAX_KEYS: up to 128 keys at d <= 64, 64 at d = 128. Wider heads
# (BLOCK_D + BLOCK_DV > SHORT_BACKWARD_MAX_WIDTH) spill at every tile of 32 keys, and 256 keys at d = 32 spill in
# float32 (compiler report, sm_90 and sm_80): those take the three kernels. 0 accumulators turn it off.
SHORT_BACKWARD_ACCUMULATORS = 16384
SHORT_BACKWARD_MAX_KEYS = 128
SHORT_BACKWARD_MAX_WIDTH = 256


def short_backward_tile(seqlen_k: int, block_d: int, block_dv: int, element_size: int = 2,
                        interpret: bool = False) -> Optional[KernelConfig]:
    """The short backward's tile for ``seqlen_k`` keys (BLOCK_N: all of them; BLOCK_M query rows a step), or None
    where they do not fit one block. A step takes 32 query rows over 8 warps: with 64 rows, or 4 warps, some of these
    tiles spill (compiler report, sm_90 and sm_80, bf16 and float32), as float32 inputs do at d = 128 (their Q and dO
    tiles take twice the registers; ``element_size`` 4: half the width). The interpreter steps 16 rows at a time, so
    CPU tests cross query blocks."""
    block_n = max(16, triton_next_power_of_2(seqlen_k))
    width = block_d + block_dv
    max_width = SHORT_BACKWARD_MAX_WIDTH if element_size <= 2 else SHORT_BACKWARD_MAX_WIDTH // 2
    if (seqlen_k < 1 or block_n > SHORT_BACKWARD_MAX_KEYS or width > max_width
            or block_n * width > SHORT_BACKWARD_ACCUMULATORS):
        return None
    if interpret:
        return KernelConfig(16, block_n, 4, 1)
    return KernelConfig(32, block_n, 8, 1)


# Small tiles for the CPU interpreter: several blocks on small shapes, so the loops' edges are exercised.
INTERPRETER = AttentionConfig(_k(16, 16, 4, 1), _k(16, 16, 4, 1), _k(16, 16, 4, 1))
FALLBACK = AttentionConfig(_k(64, 32, 4, 1), _k(32, 64, 4, 1), _k(64, 32, 4, 1))


def parse(text: str) -> AttentionConfig:
    """``"BM,BN,W,S"`` (all kernels) or ``"fwd=...;dkdv=...;dq=..."`` -> AttentionConfig."""

    def one(part: str) -> KernelConfig:
        items = [x.strip() for x in part.split(",")]
        flags = [x for x in items[4:]]
        unknown = sorted(set(flags) - {"tma", "ws"})
        try:
            values = [int(x) for x in items[:4]]
        except ValueError:
            values = []
        if len(values) != 4 or unknown:
            raise ValueError(f"{ENV_VAR}: expected BLOCK_M,BLOCK_N,num_warps,num_stages[,tma][,ws], got {part!r}")
        bm, bn, warps, stages = values
        for name, v in (("BLOCK_M", bm), ("BLOCK_N", bn)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"{ENV_VAR}: {name} must be a power of two >= 16, got {v} in {text!r}")
        return KernelConfig(bm, bn, warps, stages, "tma" in flags, "ws" in flags)

    text = text.strip()
    if "=" not in text:
        kc = one(text)
        return AttentionConfig(kc, kc, kc)
    parts = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in ("fwd", "dkdv", "dq"):
            raise ValueError(f"{ENV_VAR}: kernel names are fwd, dkdv, dq; got {name!r} in {text!r}")
        if name == "dq" and value.strip() in DQ_MODES[1:]:
            parts["dq_mode"] = value.strip()
            parts["dq"] = FALLBACK.dq  # the tile of the deterministic path, which still needs one
            continue
        parts[name] = one(value)
    missing = {"fwd", "dkdv", "dq"} - set(parts)
    if missing:
        raise ValueError(f"{ENV_VAR}: missing {sorted(missing)} in {text!r}")
    return AttentionConfig(parts["fwd"], parts["dkdv"], parts["dq"], parts.get("dq_mode", "separate"))


_pinned: Optional[AttentionConfig] = parse(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else None


@contextlib.contextmanager
def pin(config):
    """Use ``config`` (an AttentionConfig or its string form) for every call inside the block."""
    global _pinned
    if isinstance(config, str):
        config = parse(config)
    previous = _pinned
    _pinned = config
    try:
        yield config
    finally:
        _pinned = previous


def pinned() -> Optional[AttentionConfig]:
    return _pinned


def arch_of(compute_capability) -> str:
    """Table architecture for a compute capability (None = the CPU interpreter)."""
    if compute_capability is None:
        return "interpreter"
    major, minor = compute_capability
    if major >= 9:
        return "sm90"
    if (major, minor) == (8, 0):
        return "sm80"
    return "sm86"


def padded_head_dim(head_dim: int) -> int:
    """The power-of-two tile width (>= 16, as tl.dot needs) that holds ``head_dim`` columns."""
    return max(16, triton_next_power_of_2(head_dim))


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=256)
def table_config(compute_capability, dtype: torch.dtype, head_dim: int, causal: bool, short: bool = False,
                 precision: str = "tf32", seqlen_k: int = 1 << 30, masked: bool = False) -> AttentionConfig:
    """The table's entry; ``short``: the query sequence has at most SHORT_SEQLEN rows (the forward's tile then
    comes from SHORT_FORWARD by ``seqlen_k``, or SHORT_FORWARD_MASKED where ``masked``: the call reads a mask);
    ``precision``: the kernels' float32 dot precision ("ieee" has entries of its own where the TF32 tiles spill)."""
    arch = arch_of(compute_capability)
    if arch == "interpreter":
        return INTERPRETER
    dtype_class = "half" if dtype != torch.float32 else ("fp32-ieee" if precision == "ieee" else "fp32")
    key = (arch, dtype_class, padded_head_dim(head_dim), causal)
    if key not in TABLE and dtype_class == "fp32-ieee":
        key = (arch, "fp32", key[2], causal)
    config = TABLE.get(key, FALLBACK)
    tile = short_forward_tile(key, seqlen_k, masked) if short else None
    if tile is not None:
        config = replace(config, forward=tile)
    return config


def config_for(compute_capability, dtype: torch.dtype, head_dim: int, causal: bool, seqlen_q: int = 1 << 30,
               precision: str = "tf32", seqlen_k: int = 1 << 30, masked: bool = False) -> AttentionConfig:
    """The configuration a call runs with (pinned > table > fallback); ``masked``: the call reads a mask."""
    if _pinned is not None:
        return _pinned
    short = seqlen_q <= SHORT_SEQLEN
    return table_config(compute_capability, dtype, head_dim, causal, short, precision, seqlen_k if short else 1 << 30,
                        short and masked)


def shrink(config: KernelConfig) -> Optional[KernelConfig]:
    """A smaller tile for a kernel that ran out of shared memory or registers; None when at the floor."""
    if config.num_stages > 1:
        return replace(config, num_stages=config.num_stages - 1)
    if config.block_n > 16 and config.block_n >= config.block_m:
        return replace(config, block_n=config.block_n // 2)
    if config.block_m > 16:
        return replace(config, block_m=config.block_m // 2)
    if config.block_n > 16:
        return replace(config, block_n=config.block_n // 2)
    return None
