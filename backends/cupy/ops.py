"""Host side of the CUDA kernels: pick the variants, allocate outputs with torch, build the arguments.

Shapes: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv); any batch/head/sequence strides with a
contiguous last dim (16-byte aligned rows, else one contiguous copy; the ANY_DIMS variants take any rows with a
contiguous last dim as they are). Outputs have the layouts of :mod:`mhattn.backends.layouts` (the kernels take
every output's strides): out (B, Hq, Nq, Dv) with (B, Nq, Hq, Dv) memory, lse (B, Hq, Nq) float32 contiguous;
dq, dk, dv like q, k, v where those are dense, else in out's layout; the float mask's gradient (B, Hq, Nq, Nk)
in the mask's dtype. The variant choice of a call signature is cached (:func:`_fwd_choice`, ...).
"""

from __future__ import annotations

import functools
import math

import torch

from mhattn.errors import BackendUnavailableError

from mhattn.backends import layouts
from mhattn.backends.base import AttentionParams
from mhattn.backends.cupy import variants
from mhattn.backends.cupy.launcher import f32, i32, i64, ptr, u32
from mhattn import dropout_rng
from mhattn.dropout_rng import threshold as dropout_threshold

LOG2E = 1.0 / math.log(2.0)
# An unbounded window side, as the kernels take it (any |j - i - offset| is below this).
UNBOUNDED = 1 << 30
# Largest sequence length the 32-bit index arithmetic of the kernels allows.
MAX_SEQLEN = 1 << 29
# Heads and batch index the grid's y and z dimensions of the backward kernels.
MAX_GRID_YZ = 65535
# With a causal mask or a window the forward's grid x walks (query block, batch, head): at most this many,
# counted with its smallest query block (every forward tile has at least this many rows).
MAX_GRID_X = (1 << 31) - 1
MIN_FWD_BLOCK_M = 64
# The forward runs the query blocks of a group of (batch, head) pairs heaviest first, group by group; a group
# holds as many pairs as have K and V within this many bytes, so their K / V tiles stay in L2 (50 MB on an
# H100) while the group's CTAs run. About what one wave of CTAs of consecutive query blocks of a pair reads.
SCHED_L2_BYTES = 16 << 20
# lse_log2 / delta vectors are padded to a multiple of this, the largest query tile of the backward kernels.
VECTOR_PAD = 128

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}

# When True, outputs are filled with NaN before the kernels write them, so a missed element shows (tests).
POISON_OUTPUTS = False


def _empty(shape, dtype, device):
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if POISON_OUTPUTS else t


def kernel_ready(t: torch.Tensor, any_rows: bool = False) -> torch.Tensor:
    """``t`` itself when its last dim is contiguous and every row starts 16-byte aligned (``any_rows``: the
    ANY_DIMS variants, which load any row element by element: a contiguous last dim is enough), else a copy."""
    if any_rows:
        return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
    aligned = (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s % 8 == 0 for s in t.stride()[:-1])
    )
    return t if aligned else t.contiguous()


def feature_flags(params: AttentionParams, head_dim: int, head_dim_v: int) -> tuple:
    """The feature flags (variants.FEATURE_FLAGS) a problem needs; () for the variants without any."""
    flags = []
    if params.softcap is not None:
        flags.append("SOFTCAP")
    if params.mask is not None and params.mask.dtype != torch.bool:
        flags.append("FLOAT_MASK")
    if head_dim != head_dim_v or head_dim % 8 or head_dim_v % 8:
        flags.append("ANY_DIMS")
    return tuple(flags)


def level_of(params: AttentionParams, features=()) -> str:
    if features or params.mask is not None or params.dropout_p > 0.0:
        return "full"
    if params.has_window:
        return "bounds"
    return "plain"


def _strides(t: torch.Tensor) -> list:
    return [i64(t.stride(0)), i64(t.stride(1)), i64(t.stride(2))]


def _clamp_bound(x) -> int:
    return UNBOUNDED if x is None else max(-UNBOUNDED, min(int(x), UNBOUNDED))


def _seed(params: AttentionParams, device):
    """The seed tensor the kernels read (None without dropout); the caller holds it until the launch."""
    return dropout_rng.seed_tensor(params.seed, device) if params.dropout_p > 0 else None


def _feature_args(params: AttentionParams, seed) -> list:
    """diag_offset, window bounds, mask and its strides, dropout seed (a pointer) / threshold / scale."""
    args = [i32(max(-UNBOUNDED, min(params.diag_offset, UNBOUNDED))), i32(_clamp_bound(params.window_left)),
            i32(_clamp_bound(params.window_right))]
    mask = params.mask
    if mask is not None and mask.dtype == torch.bool:
        args += [ptr(mask)] + [i64(s) for s in mask.stride()]
    else:
        args += [ptr(None), i64(0), i64(0), i64(0), i64(0)]
    p = float(params.dropout_p)
    if p > 0:  # the kernels read the seed words from the device (graph-safe)
        args += [ptr(seed), u32(dropout_threshold(p)), f32(1.0 / (1.0 - p))]
    else:
        args += [ptr(None), u32(0), f32(1.0)]
    return args


def float_mask_view(mask: torch.Tensor) -> torch.Tensor:
    """A float attn_mask (B, H, Nq, Nk), broadcast by strides, as float32 with the same broadcast: only the
    distinct elements are converted (dims of stride 0 or size 1 stay stride 0)."""
    broadcast = [mask.shape[i] == 1 or mask.stride(i) == 0 for i in range(4)]
    distinct = mask[tuple(slice(0, 1) if b else slice(None) for b in broadcast)]
    if distinct.dtype != torch.float32:
        distinct = distinct.to(torch.float32)
    return distinct.expand(mask.shape)


def _extra_args(params: AttentionParams, head_dim_v: int, float_mask=None, dmask=None) -> list:
    """The arguments every main kernel takes after the feature arguments (used only by the variants with
    feature flags): value head dim, softcap factors, the float mask (float_mask_view's result, which the caller
    keeps alive until the launches are queued) and its strides, the float32 mask-gradient buffer or null."""
    if params.softcap is not None:
        args = [i32(head_dim_v), f32(2.0 * LOG2E * params.scale / params.softcap), f32(params.softcap * LOG2E)]
    else:
        args = [i32(head_dim_v), f32(0.0), f32(0.0)]
    if float_mask is not None:
        args += [ptr(float_mask)] + [i64(0 if float_mask.shape[i] == 1 else float_mask.stride(i)) for i in range(4)]
    else:
        args += [ptr(None), i64(0), i64(0), i64(0), i64(0)]
    return args + [ptr(dmask)]


def _float_mask_of(features, params: AttentionParams):
    return float_mask_view(params.mask) if "FLOAT_MASK" in features else None


def forward(launcher, cc, q, k, v, params: AttentionParams):
    """Returns (out, lse) as the backend contract specifies."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    out = _poisoned(layouts.output_buffer(q, v))
    lse = _empty((batch, heads_q, seqlen_q), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    features = feature_flags(params, head_dim, head_dim_v)
    any_rows = "ANY_DIMS" in features
    q, k, v = (kernel_ready(t, any_rows) for t in (q, k, v))
    d = variants.head_dim_bucket(max(head_dim, head_dim_v))
    variant, block_m, has_bounds = _fwd_choice(cc, q.dtype, d, level_of(params, features), features,
                                               variants.FWD_TILES.get(d), variants.FWD_TILES_BOUNDED.get(d))
    if has_bounds:  # query blocks of unequal cost: (group, query block, pair) in x, see fwd.cu
        grid = (cdiv(seqlen_q, block_m) * batch * heads_q, 1, 1)
    else:
        grid = (cdiv(seqlen_q, block_m), heads_q, batch)
    args = [ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse)]
    args += _strides(q) + _strides(k) + _strides(v) + _strides(out)
    args += [i32(seqlen_q), i32(seqlen_k), i32(heads_q), i32(heads_q // heads_kv), i32(head_dim),
             i32(sched_pairs(batch * heads_q, seqlen_k, head_dim, q.element_size())), f32(params.scale * LOG2E)]
    seed = _seed(params, q.device)
    float_mask = _float_mask_of(features, params)
    args += _feature_args(params, seed) + _extra_args(params, head_dim_v, float_mask)
    launcher.launch(variant, grid, args, q.device, cc)
    return out, lse


# The variant choices of a call signature, cached. Their keys hold the tile-table entries the choice reads
# (``*tables``), so a table changed at run time (a tuning sweep, a test) is seen at the next call.


@functools.lru_cache(maxsize=512)
def _fwd_choice(cc, dtype, d: int, level: str, features: tuple, *tables) -> tuple:
    """(variant, BLOCK_M, HAS_BOUNDS) of the forward at head-dim bucket ``d`` with the feature flags ``features``."""
    variant = variants.fwd_variant(cc, _DTYPE_NAMES[dtype], d, level, features=features)
    return variant, variant.define("BLOCK_M"), bool(variant.define("HAS_BOUNDS"))


@functools.lru_cache(maxsize=512)
def _bwd_choice(cc, dtype, d: int, level: str, deterministic: bool, features: tuple, *tables) -> tuple:
    """(preprocess variant, dK/dV variants, dQ variant or None when dQ comes from atomics) of the backward with
    the feature flags ``features``; ``deterministic`` (or a mask gradient) keeps the dQ kernel."""
    dtype_name = _DTYPE_NAMES[dtype]
    atomic_dq = not deterministic and variants.atomic_dq_possible(variants.dkdv_tiles(cc, d, True), d)
    dkdv = tuple(variants.dkdv_variants(cc, dtype_name, d, level, atomic_dq=atomic_dq, features=features))
    dq = None if atomic_dq else variants.dq_variant(cc, dtype_name, d, level, features=features)
    return variants.preprocess_variant(dtype_name, any_dims="ANY_DIMS" in features), dkdv, dq


def sched_pairs(pairs: int, seqlen_k: int, head_dim: int, element_size: int) -> int:
    """(batch, head) pairs per scheduling group of the forward grid (see SCHED_L2_BYTES)."""
    kv_bytes = 2 * seqlen_k * head_dim * element_size
    return max(1, min(pairs, SCHED_L2_BYTES // max(kv_bytes, 1)))


def backward(launcher, cc, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse=None,
             deterministic: bool = True):
    """Returns (dq, dk, dv, dmask); dK/dV summed over the query heads of a group; dmask the gradient of a float
    mask when ``params.mask_requires_grad`` (B, Hq, Nq, Nk) in the mask's dtype, else None.

    deterministic: dQ from its own kernel over key blocks (bitwise reproducible); False forms dQ inside the
    dK/dV kernel with float32 atomic adds (fewer operations, summation order varies) where the tiles allow
    and no mask gradient is asked for (the dQ kernel writes dS, the mask's gradient).
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    features = feature_flags(params, head_dim, head_dim_v)
    if "FLOAT_MASK" in features and grad_lse is not None:
        # On the H100 this combination gave NaN in dQ, dK and the mask gradient (the emulator does not show it):
        # refused with a clear error rather than computed wrongly.
        raise BackendUnavailableError(
            "cupy backend: a gradient flowing into the returned lse together with a float attn_mask is not "
            "supported yet; use backend='triton' (or no return_lse gradient)")
    dq, dk, dv = (_poisoned(layouts.grad_buffer(t)) for t in (q, k, v))
    mask_grad = "FLOAT_MASK" in features and params.mask_requires_grad
    # zeros: the blocks outside the causal / window band are never visited, and their gradient is 0
    dmask = torch.zeros((batch, heads_q, seqlen_q, seqlen_k), dtype=torch.float32, device=q.device) if mask_grad else None
    if seqlen_q == 0 or seqlen_k == 0 or batch == 0 or heads_q == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), _mask_grad_out(dmask, params)
    any_rows = "ANY_DIMS" in features
    q, k, v, out, grad_out = (kernel_ready(t, any_rows) for t in (q, k, v, out, grad_out))
    lse = lse.to(torch.float32).contiguous()
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    d = variants.head_dim_bucket(max(head_dim, head_dim_v))
    # The mask gradient needs dS, which only the dQ kernel writes: no atomic dQ then.
    pre, dkdv_variants, dq_variant = _bwd_choice(
        cc, q.dtype, d, level_of(params, features), bool(deterministic) or mask_grad, features,
        variants.DKDV_TILES.get(d), variants.DKDV_ATOMIC_TILES.get(d), variants.DKDV_FALLBACK_TILES.get(d),
        variants.DQ_TILES.get(d))
    group = heads_q // heads_kv

    # delta = rowsum(dO * O) - grad_lse and lse in log2 units, padded per (b, h) to a multiple of VECTOR_PAD.
    seqlen_q_pad = cdiv(seqlen_q, VECTOR_PAD) * VECTOR_PAD
    lse_log2 = torch.empty((batch, heads_q, seqlen_q_pad), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse_log2)
    rows = batch * heads_q * seqlen_q_pad
    args = [ptr(out), ptr(grad_out), ptr(lse), ptr(grad_lse), ptr(lse_log2), ptr(delta)]
    args += _strides(out) + _strides(grad_out)
    args += [i32(heads_q), i32(seqlen_q), i32(seqlen_q_pad), i32(head_dim_v), i64(rows)]
    launcher.launch(pre, (cdiv(rows, variants.PREPROCESS_WARPS), 1, 1), args, q.device, cc)

    shape_args = [i32(seqlen_q), i32(seqlen_q_pad), i32(seqlen_k), i32(heads_q), i32(group), i32(head_dim),
                  f32(params.scale * LOG2E), f32(params.scale)]
    seed = _seed(params, q.device)
    float_mask = _float_mask_of(features, params)
    feature_args = _feature_args(params, seed) + _extra_args(params, head_dim_v, float_mask)

    atomic_dq = dq_variant is None
    dq_accum = torch.zeros((batch, heads_q, seqlen_q, head_dim), dtype=torch.float32, device=q.device) if atomic_dq else None
    for variant in dkdv_variants:
        grid = (cdiv(seqlen_k, variant.define("BLOCK_N")), heads_kv, batch)
        args = [ptr(q), ptr(k), ptr(v), ptr(grad_out), ptr(lse_log2), ptr(delta), ptr(dk), ptr(dv), ptr(dq_accum)]
        args += _strides(q) + _strides(k) + _strides(v) + _strides(grad_out) + _strides(dk) + _strides(dv)
        launcher.launch(variant, grid, args + shape_args + feature_args, q.device, cc)
    if atomic_dq:
        dq.copy_(dq_accum)
        return dq, dk, dv, None

    variant = dq_variant
    grid = (cdiv(seqlen_q, variant.define("BLOCK_M")), heads_q, batch)
    args = [ptr(q), ptr(k), ptr(v), ptr(grad_out), ptr(lse_log2), ptr(delta), ptr(dq)]
    args += _strides(q) + _strides(k) + _strides(v) + _strides(grad_out) + _strides(dq)
    # the dQ kernel writes dS, the mask's gradient
    dq_feature_args = _feature_args(params, seed) + _extra_args(params, head_dim_v, float_mask, dmask)
    launcher.launch(variant, grid, args + shape_args + dq_feature_args, q.device, cc)
    return dq, dk, dv, _mask_grad_out(dmask, params)


def _mask_grad_out(dmask, params: AttentionParams):
    return None if dmask is None else dmask.to(params.mask.dtype)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
