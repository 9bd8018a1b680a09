"""Kernel variants: which compiled specialisation of which kernel runs a problem.

A :class:`Variant` is one kernel source compiled with one set of ``-D`` options (dtype, head-dim bucket,
tile shape, feature level). The tile shapes come from a table per head-dim bucket, shrunk where a GPU
has less shared memory; :func:`all_variants` lists every variant a GPU of a given compute capability
can launch, which is what ``mhattn build`` compiles.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Optional

# Head dims are rounded up to one of these; the padded columns are zero-filled in shared memory. Head dims that
# are not multiples of 8 (rows not in whole 16-byte chunks) run the ANY_DIMS variants.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)

# Feature levels: "plain" has no masking beyond the sequence ends; "bounds" adds the causal diagonal and
# the sliding window; "full" adds a boolean mask and dropout (each switched on at run time).
LEVELS = ("plain", "bounds", "full")
_LEVEL_DEFINES = {"plain": (0, 0), "bounds": (1, 0), "full": (1, 1)}

DTYPE_NAMES = ("float16", "bfloat16")

# Feature flags, each a -D option of its own (see kernels/common.cuh): SOFTCAP (softcap), FLOAT_MASK (additive
# float mask and its gradient), ANY_DIMS (value head dim of its own, head dims that are not multiples of 8).
# A variant with any of them runs at the "full" level; without them a variant's options, hence its code, are
# those it had before the flags existed.
FEATURE_FLAGS = ("SOFTCAP", "FLOAT_MASK", "ANY_DIMS")
# Every combination a problem can need (what mhattn build compiles besides the plain variants).
FEATURE_SETS = tuple(
    tuple(flag for bit, flag in enumerate(FEATURE_FLAGS) if mask >> bit & 1) for mask in range(1, 1 << len(FEATURE_FLAGS))
)

# Per-sequence addressing (kernels/sequences.cuh), one -D option each: "varlen" (packed sequences, cu_seqlens; the
# forward, the backward preprocess, the dK/dV kernels without atomic dQ and the dQ kernel), "kvcache" (a contiguous
# cache with per-sequence lengths) and "paged_kvcache" (a paged cache through a block table), both forward only, and
# their "_split" forms (KV_SPLIT: decoding tiles, DECODE_TILES, that may split a sequence's keys over CTAs, merged by
# kernels/kv_combine.cu). They run with the feature flags but FLOAT_MASK (no mask reaches these entry points);
# without them a variant's options, hence its code, are those it had before they existed.
SEQUENCE_DEFINES = {"varlen": (("VARLEN", 1),), "kvcache": (("KV_CACHE", 1),), "paged_kvcache": (("KV_CACHE", 2),),
                    "kvcache_split": (("KV_CACHE", 1), ("KV_SPLIT", 1)),
                    "paged_kvcache_split": (("KV_CACHE", 2), ("KV_SPLIT", 1))}
SEQUENCE_FEATURE_SETS = tuple(flags for flags in FEATURE_SETS if "FLOAT_MASK" not in flags)

# Bytes of shared memory one CTA may use (opt-in maximum): what a device of that compute capability reported
# (note_device_smem_limit: the backend notes each GPU's at its first call there), else this table, which is what
# ``mhattn build`` compiles for without a GPU; compute capabilities not in it get the smallest.
_SMEM_LIMIT = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024}
_SMEM_LIMIT_DEFAULT = 99 * 1024
_DEVICE_SMEM_LIMIT = {}


def note_device_smem_limit(cc, nbytes: int) -> None:
    """Record a device's opt-in shared-memory limit (torch's ``shared_memory_per_block_optin``) for its compute
    capability, before any tile choice for it."""
    _DEVICE_SMEM_LIMIT[tuple(cc)] = int(nbytes)


def smem_limit(cc) -> int:
    cc = tuple(cc)
    return _DEVICE_SMEM_LIMIT.get(cc) or _SMEM_LIMIT.get(cc, _SMEM_LIMIT_DEFAULT)


def head_dim_bucket(head_dim: int) -> int:
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim: expected at most {HEAD_DIM_BUCKETS[-1]}, got {head_dim}")


# ---- tile shapes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FwdTiles:
    block_m: int      # query rows per CTA
    block_n: int      # keys per step
    num_warps: int    # each warp owns block_m / num_warps (16 or 32) query rows
    q_in_regs: bool   # Q fragments kept in registers for the whole key loop


@dataclass(frozen=True)
class DkdvTiles:
    block_n: int      # keys per CTA (16 or 32 per warp)
    block_m: int      # queries per step
    num_warps: int
    kv_in_regs: bool  # this warp's K (and V) fragments kept in registers
    split: bool       # dV and dK in two launches (their accumulators do not fit in registers together)


@dataclass(frozen=True)
class Dkdv2dTiles:
    """Tiles of the two-dimensional dK/dV kernel (kernels/bwd_dkdv_2d.cu): each phase splits its product
    over the warps in two dimensions; P^T and dS^T pass through shared memory between the phases."""

    block_n: int      # keys per CTA
    block_m: int      # queries per step
    num_warps: int
    s_warps_n: int    # scores phase: warps along the keys (the others along the queries)
    kv_warps_n: int   # dK/dV phase: warps along the keys (the others along the head dim)
    dq_warps_m: int   # dQ phase (atomic dQ): warps along the queries (the others along the head dim)
    kv_in_regs: bool  # this warp's K and V fragments of the scores phase kept in registers


@dataclass(frozen=True)
class DqTiles:
    block_m: int      # query rows per CTA (16 or 32 per warp)
    block_n: int      # keys per step
    num_warps: int
    q_in_regs: bool   # Q and dO fragments kept in registers


# Per head-dim bucket; the 64 and 128 entries are the winners of benchmarks/dev_cupy.py's sweep (see
# NOTES.md). Registers bound these: the output accumulators of a warp hold
# rows_per_warp * head_dim floats over 32 lanes, next to the score tile rows_per_warp * block_n.
FWD_TILES = {
    32: FwdTiles(128, 64, 4, True),
    64: FwdTiles(128, 64, 4, True),
    96: FwdTiles(128, 64, 4, False),
    128: FwdTiles(128, 32, 4, False),
    192: FwdTiles(64, 32, 4, False),
    256: FwdTiles(128, 64, 8, False),
}
DKDV_TILES = {
    32: DkdvTiles(64, 64, 4, True, False),
    64: DkdvTiles(128, 32, 4, False, False),
    96: DkdvTiles(64, 32, 4, False, False),
    128: DkdvTiles(128, 64, 8, False, False),
    192: DkdvTiles(64, 32, 4, False, True),
    256: DkdvTiles(64, 32, 4, False, True),
}
# Where an entry is a Dkdv2dTiles that does not fit a GPU's shared memory, this one-dimensional one is used.
DKDV_FALLBACK_TILES = dict(DKDV_TILES)
# From d=96 up the two-dimensional kernel wins (H100 sweeps, NOTES.md); at d=64 the one-dimensional one with
# 32 keys per warp reads as little shared memory without the P^T / dS^T round trip, and stays.
DKDV_TILES.update({
    96: Dkdv2dTiles(128, 64, 8, 4, 4, 4, False),
    128: Dkdv2dTiles(128, 64, 8, 4, 4, 2, False),
    192: Dkdv2dTiles(64, 64, 8, 2, 4, 4, False),
    256: Dkdv2dTiles(64, 64, 8, 2, 4, 2, False),
})
# Forward tiles for the levels with masking ("bounds", "full") where they differ from FWD_TILES: the masking
# code needs registers, and at d=128 eight warps of 16 rows with Q in registers avoid spilling them.
FWD_TILES_BOUNDED = {
    128: FwdTiles(128, 64, 8, True),  # 16 rows a warp with Q in registers: 221 registers, no spills (H100 sweeps)
    256: FwdTiles(128, 32, 8, False),  # the plain level's 64-key block spills 256 bytes with the masking code
}
# The forward of a decoding step (KV_SPLIT: a KV cache with at most 16 query rows): one warp of 16 rows a CTA, the
# CTAs of a sequence's keys split among them where the grid would not fill the GPU (packed.py). Key steps as large as
# fit the registers of one warp (ptxas through NVRTC 12.9, sm_90: no spills but 144-168 bytes at d = 256; 64 keys a step
# spill 456-1892 bytes from d = 128 up); not timed yet.
DECODE_TILES = {32: FwdTiles(16, 64, 1, True), 64: FwdTiles(16, 64, 1, True), 96: FwdTiles(16, 32, 1, True),
                128: FwdTiles(16, 16, 1, False), 192: FwdTiles(16, 16, 1, False), 256: FwdTiles(16, 16, 1, False)}
DECODE_MAX_ROWS = 16
# The dK/dV kernel of the fast backward (dQ formed in it with atomics, mode 3) has its own table.
DKDV_ATOMIC_TILES = dict(DKDV_TILES)
DQ_TILES = {
    32: DqTiles(64, 64, 4, True),
    64: DqTiles(128, 32, 4, True),
    96: DqTiles(64, 64, 4, False),
    128: DqTiles(128, 32, 4, False),
    192: DqTiles(64, 32, 4, False),
    256: DqTiles(64, 32, 4, False),
}


# The Hopper family (kernels/hopper_*.cu, compiled for sm_90a, run on compute capability 9.0 only): TMA loads into
# 128-byte swizzled tiles, wgmma, a producer warpgroup and CONSUMERS warpgroups of 64 query rows each. Head dims
# in whole 64-column chunks; the others take the mma.sync kernels.
HOPPER_CC = (9, 0)
HOPPER_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class HopperFwdTiles:
    block_n: int      # keys per step (64 or 128)
    stages: int       # K and V slots each in the shared-memory ring
    consumers: int    # consumer warpgroups (64 query rows each): BLOCK_M = 64 * consumers
    pingpong: bool    # two consumers take turns to issue their products (kernels/hopper_fwd.cu)
    persistent: bool  # one CTA per SM walking the tiles (a tile counter under a causal mask or window), else one a tile
    staged_out: bool = False  # two Q buffers; the output staged in the tile's and stored by the copy engine
    masked_pingpong: Optional[bool] = None  # ping-pong under a causal mask or a window (None: as ``pingpong``)
    lazy_rescale: bool = False  # a row's maximum moves only past 2^8 growth; warps whose maxima stay skip O's rescaling
    turns_across_tiles: bool = False  # ping-pong turns run on across tiles: a tile's output under the next one's start

    def pingpong_for(self, masked: bool) -> bool:
        """Whether the consumers take turns on a problem with (``masked``) or without a causal mask or window."""
        return self.pingpong if not masked or self.masked_pingpong is None else self.masked_pingpong


@dataclass(frozen=True)
class HopperBwdTiles:
    stages: int       # Q / dO slots in the shared-memory ring
    dq_bulk: bool     # dQ tiles added to the float32 accumulator by the copy engine (a bulk reduce-add per row), else
                      # by the writer warps' 16-byte atomics
    dq_buffers: int = 1  # dQ buffers the consumers and the writers take in turn (2: a block's dQ is stored while the
                         # writers still add the one before; room for it at d = 64 only)
    query_rows: int = 64  # queries a step (128: at d = 64 only, where the two warpgroups then split dQ's rows)


# H100 sweeps (backends/cupy/NOTES.md, versions 5, B6 and H6).
# The backward (kernels/hopper_bwd.cu): 128 keys a CTA in two consumer warpgroups; per head dim it takes, its ring
# slots, how dQ reaches the accumulator (the bulk reduce-add: +2-13% at d = 128; at d = 64 a third slower than the
# atomics, with or without the writers' sum of the two tiles, B6) and the queries a step (128 at d = 64: +5-17% over
# 64 with three slots, B12; no room for it at d = 128).
HOPPER_BWD_TILES = {64: HopperBwdTiles(2, False, 1, 128), 128: HopperBwdTiles(2, True)}
# The head dims whose reproducible backward is the Hopper kernel with its key blocks adding dQ in turns (B8: at d = 128
# 1.2-1.6x the mma.sync dQ kernel's backward; at d = 64 0.8-1.0x of it, which keeps d = 64).
HOPPER_BWD_DETERMINISTIC_DIMS = (128,)
# The staged output (H6): +1-5% at d = 64 (-2% at 4k without a mask), at d = 128 +11-13% at 1k and from -5% to +6% at
# 4k and 16k; no shared memory for it at d = 256. Ping-pong (H2) is off at d = 64 since H10: without it +0-13% in
# every cell of two sweeps; at d = 128 and 256 it holds the cells without a mask, and is off under a causal mask or a
# window, where the same two sweeps read +3-12% at d = 128 and +1-4% at d = 256 without it (H12). The lazy rescaling
# (H16) only at d = 256 (its 128 multiplies a thread a block): +2-6% in four of six cells there, level to -5% at d = 64
# and 128. The turns running on across tiles (H18) at d = 128: +3-4% at 1k without a mask, level to -2% at 2k-16k; at
# d = 256 from +3% to -4%.
HOPPER_FWD_TILES = {
    64: HopperFwdTiles(128, 3, 2, False, True, True),
    128: HopperFwdTiles(128, 2, 2, True, True, True, masked_pingpong=False, turns_across_tiles=True),
    256: HopperFwdTiles(64, 2, 2, True, True, masked_pingpong=False, lazy_rescale=True),
}

# A tuning override, read once at import: MHATTN_CUPY_TILES='{"fwd": {"128": [128, 32, 4, false]}, ...}'
# with tables "fwd", "fwd_bounded", "dkdv", "dkdv_atomic", "dq", "hopper_fwd", "hopper_bwd" and the fields of each
# tiles class in order.
TILES_ENV = "MHATTN_CUPY_TILES"


def dkdv_tiles_from_fields(*fields) -> object:
    """DkdvTiles from its 5 fields, Dkdv2dTiles from its 7 (the dK/dV tables hold either)."""
    if len(fields) == 7:
        return Dkdv2dTiles(*fields)
    if len(fields) == 5:
        return DkdvTiles(*fields)
    raise ValueError(f"dK/dV tiles: expected 5 fields (DkdvTiles) or 7 (Dkdv2dTiles), got {list(fields)}")


def _apply_tile_override(text: str) -> None:
    tables = {"fwd": (FWD_TILES, FwdTiles), "fwd_bounded": (FWD_TILES_BOUNDED, FwdTiles),
              "dkdv": (DKDV_TILES, dkdv_tiles_from_fields), "dkdv_atomic": (DKDV_ATOMIC_TILES, dkdv_tiles_from_fields),
              "dq": (DQ_TILES, DqTiles), "hopper_fwd": (HOPPER_FWD_TILES, HopperFwdTiles),
              "hopper_bwd": (HOPPER_BWD_TILES, HopperBwdTiles)}
    try:
        entries = json.loads(text)
        for name, per_dim in entries.items():
            table, make = tables[name]
            for d, fields in per_dim.items():
                table[int(d)] = make(*fields)
    except Exception as error:
        raise ValueError(f"{TILES_ENV}: expected JSON like {{\"fwd\": {{\"128\": [128, 32, 4, false]}}}} with tables "
                         f"{sorted(tables)}, got {text!r} ({type(error).__name__}: {error})") from None


if os.environ.get(TILES_ENV):
    _apply_tile_override(os.environ[TILES_ENV])


def _row_bytes(head_dim_pad: int) -> int:
    return (head_dim_pad + 8) * 2  # padded shared-memory row, see kernels/common.cuh


def fwd_smem(tiles: FwdTiles, d: int) -> int:
    return (tiles.block_m + 4 * tiles.block_n) * _row_bytes(d)


def dkdv_smem(tiles, d: int, atomic_dq: bool = False) -> int:
    # K, V, two stages of Q and dO, two of lse and delta; the one-dimensional kernel stages dS^T only for
    # atomic dQ, the two-dimensional one always stages P^T and dS^T
    staged = 0
    if isinstance(tiles, Dkdv2dTiles):
        staged = 2 * tiles.block_n * (tiles.block_m + 8) * 2
    elif atomic_dq:
        staged = tiles.block_n * (tiles.block_m + 8) * 2
    return (2 * tiles.block_n + 4 * tiles.block_m) * _row_bytes(d) + 4 * tiles.block_m * 4 + staged


def dq_smem(tiles: DqTiles, d: int) -> int:
    return (2 * tiles.block_m + 4 * tiles.block_n) * _row_bytes(d)


def fwd_tiles(cc, d: int, level: str = "plain") -> FwdTiles:
    tiles = FWD_TILES_BOUNDED.get(d, FWD_TILES[d]) if level != "plain" else FWD_TILES[d]
    while fwd_smem(tiles, d) > smem_limit(cc) and tiles.block_n > 16:
        tiles = replace(tiles, block_n=tiles.block_n // 2)
    return tiles


def decode_tiles(cc, d: int) -> FwdTiles:
    tiles = DECODE_TILES[d]
    while fwd_smem(tiles, d) > smem_limit(cc) and tiles.block_n > 16:
        tiles = replace(tiles, block_n=tiles.block_n // 2)
    return tiles


def dkdv_2d_problems(tiles: Dkdv2dTiles, d: int) -> list:
    """Why these two-dimensional tiles cannot serve head-dim bucket ``d`` (empty: they can): every phase
    must split into warp tiles of whole 16 x 16 blocks."""
    out = []
    w = tiles.num_warps
    for name, warps, rows, cols in (("s_warps_n", tiles.s_warps_n, tiles.block_n, tiles.block_m),
                                    ("kv_warps_n", tiles.kv_warps_n, tiles.block_n, d),
                                    ("dq_warps_m", tiles.dq_warps_m, tiles.block_m, d)):
        if warps < 1 or w % warps or rows % (16 * warps) or cols % (16 * (w // warps)):
            out.append(f"{name}={warps} does not split {rows} x {cols} over {w} warps in 16 x 16 blocks")
    if tiles.block_m % 16 or tiles.block_m > 128:
        out.append(f"block_m={tiles.block_m}: expected a multiple of 16, at most 128")
    return out


def dkdv_tiles(cc, d: int, atomic_dq: bool = False):
    tiles = (DKDV_ATOMIC_TILES if atomic_dq else DKDV_TILES)[d]
    if isinstance(tiles, Dkdv2dTiles):
        if dkdv_smem(tiles, d) <= smem_limit(cc):
            return tiles
        tiles = DKDV_FALLBACK_TILES[d]
    # sized for the largest mode (3, with its staged dS tile) so every mode launches with these tiles
    while dkdv_smem(tiles, d, True) > smem_limit(cc) and tiles.block_m > 16:
        tiles = replace(tiles, block_m=tiles.block_m // 2)
    while dkdv_smem(tiles, d, True) > smem_limit(cc) and tiles.num_warps > 1:
        tiles = replace(tiles, num_warps=tiles.num_warps // 2, block_n=tiles.block_n // 2)
    return tiles


def dq_tiles(cc, d: int) -> DqTiles:
    tiles = DQ_TILES[d]
    while dq_smem(tiles, d) > smem_limit(cc) and tiles.block_n > 16:
        tiles = replace(tiles, block_n=tiles.block_n // 2)
    while dq_smem(tiles, d) > smem_limit(cc) and tiles.num_warps > 1:
        tiles = replace(tiles, num_warps=tiles.num_warps // 2, block_m=tiles.block_m // 2)
    return tiles


# ---- variants ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One kernel compiled with one set of -D options."""

    # fwd | bwd_preprocess | bwd_dkdv | bwd_dkdv_2d | bwd_dq | kv_combine | kv_append | hopper_fwd | hopper_bwd
    kernel: str
    defines: tuple       # ((name, value), ...) in a fixed order
    num_threads: int
    smem_bytes: int      # dynamic shared memory per CTA
    # Architecture features beyond the compute capability: "a" compiles for the architecture-specific target
    # (sm_90a: wgmma, setmaxnreg), whose code runs only on that exact compute capability.
    arch_features: str = ""

    @property
    def source_file(self) -> str:
        return f"{self.kernel}.cu"

    @property
    def function_name(self) -> str:
        return f"mhattn_{self.kernel}"

    def define(self, name: str):
        return dict(self.defines)[name]

    @property
    def label(self) -> str:
        return f"{self.kernel}{self.arch_features and '@' + self.arch_features}[" + " ".join(
            f"{k}={v}" for k, v in self.defines) + "]"


def _common_defines(dtype_name: str, d: int, level: str) -> list:
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {DTYPE_NAMES}, got {dtype_name!r}")
    if level not in LEVELS:
        raise ValueError(f"level: expected one of {LEVELS}, got {level!r}")
    bounds, extras = _LEVEL_DEFINES[level]
    return [("MHATTN_BF16", int(dtype_name == "bfloat16")), ("HEAD_DIM", d), ("HAS_BOUNDS", bounds),
            ("HAS_EXTRAS", extras)]


def _feature_defines(features, level: str) -> list:
    """(flag, 1) for each feature flag, in FEATURE_FLAGS order; features need the "full" level."""
    unknown = set(features) - set(FEATURE_FLAGS)
    if unknown:
        raise ValueError(f"features: expected names from {FEATURE_FLAGS}, got {sorted(unknown)}")
    if features and level != "full":
        raise ValueError(f"features {sorted(features)} run at the 'full' level, got level {level!r}")
    return [(flag, 1) for flag in FEATURE_FLAGS if flag in features]


def _sequence_defines(sequences, features=(), kernels=("fwd",), kernel="fwd") -> list:
    """[(define, value)] of a per-sequence mode (SEQUENCE_DEFINES; None: [])."""
    if sequences is None:
        return []
    if sequences not in SEQUENCE_DEFINES:
        raise ValueError(f"sequences: expected one of {sorted(SEQUENCE_DEFINES)} or None, got {sequences!r}")
    if "FLOAT_MASK" in features:
        raise ValueError(f"sequences {sequences!r}: no float mask reaches the packed / KV-cache entry points")
    if sequences != "varlen" and kernel != "fwd":
        raise ValueError(f"sequences {sequences!r}: forward only, got kernel {kernel!r}")
    return list(SEQUENCE_DEFINES[sequences])


def fwd_variant(cc, dtype_name: str, d: int, level: str, tiles: FwdTiles = None, features=(),
                sequences=None) -> Variant:
    """sequences: None (dense), or a per-sequence mode of SEQUENCE_DEFINES."""
    tiles = tiles or fwd_tiles(cc, d, level)
    defines = _common_defines(dtype_name, d, level) + [
        ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n), ("NUM_WARPS", tiles.num_warps),
        ("Q_IN_REGS", int(tiles.q_in_regs)),
    ] + _feature_defines(features, level) + _sequence_defines(sequences, features)
    return Variant("fwd", tuple(defines), tiles.num_warps * 32, fwd_smem(tiles, d))


def atomic_dq_possible(tiles, d: int) -> bool:
    """Whether the dK/dV kernel can also form dQ with atomics (mode 3) with these tiles."""
    if isinstance(tiles, Dkdv2dTiles):
        return not dkdv_2d_problems(tiles, d)
    m_tiles = tiles.block_m // 16
    if tiles.split or tiles.num_warps % m_tiles:
        return False
    return (d // 32) % max(1, tiles.num_warps // m_tiles) == 0


def dkdv_variants(cc, dtype_name: str, d: int, level: str, tiles: DkdvTiles = None, atomic_dq: bool = False,
                  features=(), sequences=None) -> list:
    """The dK/dV launches: one (mode 0: dK and dV), two (modes 1, 2: dV, then dK) when ``tiles.split``, or
    with ``atomic_dq`` one that also adds dQ into a float32 accumulator with atomics (mode 3); ``sequences``
    "varlen" (without atomic dQ) for packed sequences."""
    if sequences is not None and atomic_dq:
        raise ValueError(f"sequences {sequences!r}: the backward forms dQ in its own kernel (no atomic dQ)")
    seq_defines = _sequence_defines(sequences, features, kernel="bwd_dkdv")
    tiles = tiles or dkdv_tiles(cc, d, atomic_dq)
    if isinstance(tiles, Dkdv2dTiles):
        problems = dkdv_2d_problems(tiles, d)
        if problems:
            raise ValueError(f"tiles {tiles} at head dim {d}: " + "; ".join(problems))
        defines = _common_defines(dtype_name, d, level) + [
            ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n), ("NUM_WARPS", tiles.num_warps),
            ("S_WARPS_N", tiles.s_warps_n), ("KV_WARPS_N", tiles.kv_warps_n), ("DQ_WARPS_M", tiles.dq_warps_m),
            ("KV_IN_REGS", int(tiles.kv_in_regs)), ("DKDV_MODE", 3 if atomic_dq else 0),
        ] + _feature_defines(features, level) + seq_defines
        return [Variant("bwd_dkdv_2d", tuple(defines), tiles.num_warps * 32, dkdv_smem(tiles, d))]
    if atomic_dq and not atomic_dq_possible(tiles, d):
        raise ValueError(f"atomic_dq: tiles {tiles} at head dim {d} cannot form dQ in the dK/dV kernel")
    modes = (3,) if atomic_dq else (1, 2) if tiles.split else (0,)
    out = []
    for mode in modes:
        defines = _common_defines(dtype_name, d, level) + [
            ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n), ("NUM_WARPS", tiles.num_warps),
            ("KV_IN_REGS", int(tiles.kv_in_regs)), ("DKDV_MODE", mode),
        ] + _feature_defines(features, level) + seq_defines
        out.append(Variant("bwd_dkdv", tuple(defines), tiles.num_warps * 32, dkdv_smem(tiles, d, mode == 3)))
    return out


def dq_variant(cc, dtype_name: str, d: int, level: str, tiles: DqTiles = None, features=(),
               sequences=None) -> Variant:
    tiles = tiles or dq_tiles(cc, d)
    defines = _common_defines(dtype_name, d, level) + [
        ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n), ("NUM_WARPS", tiles.num_warps),
        ("Q_IN_REGS", int(tiles.q_in_regs)),
    ] + _feature_defines(features, level) + _sequence_defines(sequences, features, kernel="bwd_dq")
    return Variant("bwd_dq", tuple(defines), tiles.num_warps * 32, dq_smem(tiles, d))


PREPROCESS_WARPS = 8


def preprocess_variant(dtype_name: str, any_dims: bool = False, varlen: bool = False) -> Variant:
    """any_dims: rows read element by element (head dims that are not multiples of 8); varlen: packed sequences."""
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {DTYPE_NAMES}, got {dtype_name!r}")
    defines = (("MHATTN_BF16", int(dtype_name == "bfloat16")), ("NUM_WARPS", PREPROCESS_WARPS))
    if any_dims:
        defines += (("ANY_DIMS", 1),)
    if varlen:
        defines += SEQUENCE_DEFINES["varlen"]
    return Variant("bwd_preprocess", defines, PREPROCESS_WARPS * 32, 0)


def kernel_variants(cc, dtype_name: str, d: int, level: str, features=()) -> list:
    """The forward, dK/dV (both modes where possible) and dQ variants of one dtype, bucket, level and feature set."""
    out = [fwd_variant(cc, dtype_name, d, level, features=features)]
    out.extend(dkdv_variants(cc, dtype_name, d, level, features=features))
    if atomic_dq_possible(dkdv_tiles(cc, d, True), d):
        out.extend(dkdv_variants(cc, dtype_name, d, level, atomic_dq=True, features=features))
    out.append(dq_variant(cc, dtype_name, d, level, features=features))
    return out


def sequence_variants(cc, dtype_name: str, d: int) -> list:
    """The per-sequence variants of one dtype and bucket: varlen forward and deterministic backward (dK/dV, dQ), and
    the contiguous and paged KV-cache forwards, at every level and feature set those entry points can need (no
    mask; dropout, hence the "full" level without features, only for varlen)."""
    out = []
    for level, features in [("plain", ()), ("bounds", ()), ("full", ())] + [("full", f) for f in SEQUENCE_FEATURE_SETS]:
        out.append(fwd_variant(cc, dtype_name, d, level, features=features, sequences="varlen"))
        out.extend(dkdv_variants(cc, dtype_name, d, level, features=features, sequences="varlen"))
        out.append(dq_variant(cc, dtype_name, d, level, features=features, sequences="varlen"))
        if level != "full" or features:
            out.extend(fwd_variant(cc, dtype_name, d, level, features=features, sequences=mode)
                       for mode in ("kvcache", "paged_kvcache"))
            out.extend(fwd_variant(cc, dtype_name, d, level, tiles=decode_tiles(cc, d), features=features,
                                   sequences=mode) for mode in ("kvcache_split", "paged_kvcache_split"))
    return out


def combine_variant(dtype_name: str) -> Variant:
    """kernels/kv_combine.cu: merges the splits of a split-KV decoding step."""
    return _warp_a_row_variant("kv_combine", dtype_name, COMBINE_WARPS)


def append_variant(dtype_name: str) -> Variant:
    """kernels/kv_append.cu: writes a decoding step's new keys and values into a contiguous or paged cache."""
    return _warp_a_row_variant("kv_append", dtype_name, APPEND_WARPS)


def _warp_a_row_variant(kernel: str, dtype_name: str, warps: int) -> Variant:
    """A kernel of one warp a row, ``warps`` rows a CTA, whose only compile-time choice is the dtype."""
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {DTYPE_NAMES}, got {dtype_name!r}")
    return Variant(kernel, (("MHATTN_BF16", int(dtype_name == "bfloat16")), ("NUM_WARPS", warps)), warps * 32, 0)


COMBINE_WARPS = 4
APPEND_WARPS = 4


def hopper_fwd_smem(tiles: HopperFwdTiles, d: int) -> int:
    """kernels/hopper_fwd.cu's layout: the Q buffers, the K and V slots, the barriers, two tile indices, and 1024 bytes
    to align the base."""
    q_buffers = 2 if tiles.staged_out else 1
    return (1024 + (64 * tiles.consumers * q_buffers + 2 * tiles.stages * tiles.block_n) * d * 2
            + 8 * (2 * q_buffers + 4 + 4 * tiles.stages) + 8)


def _check_hopper_smem(tiles, d: int, smem: int) -> None:
    """A clear error where a Hopper variant's tiles need more shared memory than a CTA can have."""
    if smem > smem_limit(HOPPER_CC):
        raise ValueError(f"tiles {tiles} at head dim {d} need {smem} bytes of shared memory, more than "
                         f"{smem_limit(HOPPER_CC)}")


def hopper_fwd_variant(dtype_name: str, d: int, tiles: HopperFwdTiles = None, masked: bool = False,
                       softcap: bool = False, bool_mask: bool = False, float_mask: bool = False) -> Variant:
    """The Hopper forward at head dim ``d`` with ``tiles`` (default the table's), for problems with (``masked``) or
    without a causal mask or window (the tiles may take turns differently, HopperFwdTiles.masked_pingpong);
    ``softcap``: the scores capped by softcap * tanh(s / softcap); ``bool_mask`` / ``float_mask``: a boolean / an
    additive float32 attn_mask read per score."""
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {DTYPE_NAMES}, got {dtype_name!r}")
    if d not in HOPPER_HEAD_DIMS:
        raise ValueError(f"head dim: the Hopper forward takes {HOPPER_HEAD_DIMS}, got {d}")
    tiles = tiles or HOPPER_FWD_TILES[d]
    smem = hopper_fwd_smem(tiles, d)
    _check_hopper_smem(tiles, d, smem)
    defines = (("MHATTN_BF16", int(dtype_name == "bfloat16")), ("HEAD_DIM", d), ("BLOCK_N", tiles.block_n),
               ("STAGES", tiles.stages), ("CONSUMERS", tiles.consumers), ("PINGPONG", int(tiles.pingpong_for(masked))),
               ("STAGED_OUT", int(tiles.staged_out)), ("LAZY_RESCALE", int(tiles.lazy_rescale)),
               ("TURNS_ACROSS_TILES", int(tiles.turns_across_tiles)), ("BOOL_MASK", int(bool(bool_mask))),
               ("FLOAT_MASK", int(bool(float_mask))), ("SOFTCAP", int(bool(softcap))), ("SMEM_BYTES", smem))
    return Variant("hopper_fwd", defines, 128 * (1 + tiles.consumers), smem, arch_features="a")


def hopper_bwd_smem(stages: int, d: int, dq_buffers: int = 1, query_rows: int = 64) -> int:
    """kernels/hopper_bwd.cu's layout: K, V (128 keys), the Q and dO slots (query_rows queries), two dS^T buffers, the
    lse and delta slots, float32 dQ tiles per dQ buffer (two at d = 64 with 64 queries; rows padded by 8), the
    barriers, and 1024 bytes to align the base."""
    dq_tiles = 2 if d == 64 and query_rows == 64 else 1
    return (1024 + (2 * 128 + 2 * stages * query_rows) * d * 2 + 2 * 128 * query_rows * 2 + 2 * stages * query_rows * 4
            + dq_buffers * dq_tiles * query_rows * (d + 8) * 4 + 8 * (1 + 2 * dq_buffers + 2 * stages))


def hopper_bwd_variant(dtype_name: str, d: int, tiles: HopperBwdTiles = None, deterministic: bool = False,
                       softcap: bool = False, bool_mask: bool = False, float_mask: bool = False,
                       direct_dq: bool = False) -> Variant:
    """kernels/hopper_bwd.cu for one dtype and head dim; ``deterministic``: the key blocks add dQ in turns (bitwise
    reproducible gradients); ``softcap``: the scores capped by softcap * tanh(s / softcap); ``bool_mask`` /
    ``float_mask``: a boolean / an additive float32 attn_mask read per score (a float mask not with a softcap);
    ``direct_dq``: every key in one CTA, whose writers store dQ itself (DQ_DIRECT: no float32 buffer, no atomics,
    reproducible as it is; their own stores, whatever the tiles say of the bulk reduce-add)."""
    if direct_dq and deterministic:
        raise ValueError("a direct dQ (one key block) is reproducible already: no turns to take")
    if softcap and float_mask:
        raise ValueError("the Hopper backward takes a softcap or a float mask, not both (its softcap factor is found "
                         "from P, which the mask's term changes)")
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {DTYPE_NAMES}, got {dtype_name!r}")
    if d not in HOPPER_BWD_TILES:
        raise ValueError(f"head dim: the Hopper backward takes {tuple(HOPPER_BWD_TILES)}, got {d}")
    tiles = tiles or HOPPER_BWD_TILES[d]
    if direct_dq:
        tiles = replace(tiles, dq_bulk=False)
    if tiles.query_rows not in (64, 128) or (tiles.query_rows == 128 and d != 64):
        raise ValueError(f"Hopper backward tiles: query_rows is 64, or 128 at head dim 64; got {tiles.query_rows} at "
                         f"head dim {d}")
    smem = hopper_bwd_smem(tiles.stages, d, tiles.dq_buffers, tiles.query_rows)
    _check_hopper_smem(tiles, d, smem)
    defines = (("MHATTN_BF16", int(dtype_name == "bfloat16")), ("HEAD_DIM", d), ("QUERY_ROWS", tiles.query_rows),
               ("STAGES", tiles.stages),
               ("DQ_BULK", int(tiles.dq_bulk)), ("DQ_BUFFERS", tiles.dq_buffers),
               ("DETERMINISTIC", int(bool(deterministic))), ("BOOL_MASK", int(bool(bool_mask))),
               ("FLOAT_MASK", int(bool(float_mask))), ("SOFTCAP", int(bool(softcap))), ("SMEM_BYTES", smem))
    if direct_dq:
        defines += (("DQ_DIRECT", 1),)
    return Variant("hopper_bwd", defines, 384, smem, arch_features="a")


def hopper_variants() -> list:
    """Every variant of the Hopper family (what ``mhattn build --arch sm_90a`` compiles)."""
    masks = (dict(), dict(bool_mask=True), dict(float_mask=True))
    features = [dict(softcap=softcap, **mask) for softcap in (False, True) for mask in masks]
    backward_features = [f for f in features if not (f["softcap"] and f.get("float_mask"))]
    forward = [hopper_fwd_variant(dtype, d, masked=masked, **f) for f in features for dtype in DTYPE_NAMES
               for d in HOPPER_HEAD_DIMS for masked in (False, True)]
    return (list(dict.fromkeys(forward))  # (a variant the same with and without a causal mask or window, once)
            + [hopper_bwd_variant(dtype, d, **f) for f in backward_features for dtype in DTYPE_NAMES
               for d in HOPPER_BWD_TILES]
            + [hopper_bwd_variant(dtype, d, deterministic=True, **f) for f in backward_features
               for dtype in DTYPE_NAMES for d in HOPPER_BWD_DETERMINISTIC_DIMS]
            + [hopper_bwd_variant(dtype, d, direct_dq=True, **f) for f in backward_features for dtype in DTYPE_NAMES
               for d in HOPPER_BWD_TILES])


def all_variants(cc, features: bool = True, sequences: bool = True) -> list:
    """Every variant a GPU of compute capability ``cc`` may launch (what ``mhattn build`` compiles); with
    ``features=False`` none with feature flags, with ``sequences=False`` none with per-sequence addressing."""
    out = [preprocess_variant(dtype) for dtype in DTYPE_NAMES]
    for dtype in DTYPE_NAMES:
        for d in HEAD_DIM_BUCKETS:
            for level in LEVELS:
                out.extend(kernel_variants(cc, dtype, d, level))
    if features:
        out.extend(preprocess_variant(dtype, any_dims=True) for dtype in DTYPE_NAMES)
        for dtype in DTYPE_NAMES:
            for d in HEAD_DIM_BUCKETS:
                for flags in FEATURE_SETS:
                    out.extend(kernel_variants(cc, dtype, d, "full", features=flags))
    if sequences:
        out.extend(preprocess_variant(dtype, any_dims=any_dims, varlen=True) for dtype in DTYPE_NAMES
                   for any_dims in (False, True))
        out.extend(combine_variant(dtype) for dtype in DTYPE_NAMES)
        out.extend(append_variant(dtype) for dtype in DTYPE_NAMES)
        for dtype in DTYPE_NAMES:
            for d in HEAD_DIM_BUCKETS:
                out.extend(sequence_variants(cc, dtype, d))
    return out


def parse_target(arch: str) -> tuple:
    """('sm_90a' / 'sm90a' / ...) -> ((9, 0), "a"); names without features -> (cc, "")."""
    text = arch.strip().lower()
    if text.endswith("a"):
        return parse_arch(text[:-1]), "a"
    return parse_arch(text), ""


def parse_arch(arch: str) -> tuple:
    """'sm_90' / 'sm90' / '90' / '9.0' -> (9, 0)."""
    text = arch.strip().lower().removeprefix("sm_").removeprefix("sm").removeprefix("compute_")
    if "." in text:
        major, minor = text.split(".", 1)
    else:
        major, minor = text[:-1], text[-1:]
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"arch: expected a name like sm_80 or sm_90, got {arch!r}")
    return int(major), int(minor)
