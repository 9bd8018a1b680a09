"""Host side of the CUDA kernels: pick the variants, allocate outputs with torch, build the arguments.

Shapes: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv); any batch/head/sequence strides with a
contiguous last dim (16-byte aligned rows, else one contiguous copy; the ANY_DIMS variants take any rows with a
contiguous last dim as they are). Outputs have the layouts of :mod:`mhattn.backends.layouts` (the kernels take
every output's strides): out (B, Hq, Nq, Dv) with (B, Nq, Hq, Dv) memory, lse (B, Hq, Nq) float32 contiguous;
dq, dk, dv like q, k, v where those are dense, else in out's layout; the float mask's gradient (B, Hq, Nq, Nk)
in the mask's dtype.

Per call signature (shapes, strides, dtypes, parameters, ...; see "plans" below) everything that does not change
between calls is worked out once: the variants, grids and the kernels' arguments but the data pointers (each
launch prepared by the launcher), the output layouts and which inputs need a copy. A call then allocates its
outputs, gathers its data pointers and launches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
from typing import Optional

import torch

from mhattn.errors import BackendUnavailableError

from mhattn.backends import layouts
from mhattn.backends.base import AttentionParams
from mhattn.backends.cupy import tensor_maps, variants
from mhattn.backends.cupy.launcher import ArgumentTemplate, f32, i32, i64, ptr, slot, u32
from mhattn.caches import put_bounded
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
# The Hopper forward's groups where every tile costs the same (no causal mask or window: the persistent CTAs take
# the tiles at a fixed stride, so no heaviest-first order is at stake): a pair or two, whose query tiles then run
# side by side and read each K / V tile while it is in L2. At d = 128, N = 1k (ncu, clocks locked) against 16 MB: 201
# instead of 301 MB read from DRAM (Q, K and V once), L2 traffic 1.04 instead of 1.69 GB, 2.5% less time; causal
# tiles (taken from a counter) kept SCHED_L2_BYTES, which read faster there (NOTES.md, H19).
SCHED_L2_BYTES_EQUAL_TILES = 1 << 20
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


# ---- the data pointers of a call --------------------------------------------------------------------------
# Every launch of a call takes its data pointers from one tuple made per call, in these orders; the launches'
# argument templates name them by position (launcher.slot). A pointer the call does not have is 0.

FWD_POINTERS = ("q", "k", "v", "out", "lse", "mask", "seed", "float_mask")
BWD_POINTERS = ("q", "k", "v", "out", "grad_out", "lse", "grad_lse", "lse_log2", "delta", "dq", "dk", "dv",
                "dq_accum", "mask", "seed", "float_mask", "dmask", "dq_turns")
_FWD = {name: slot(i) for i, name in enumerate(FWD_POINTERS)}
_BWD = {name: slot(i) for i, name in enumerate(BWD_POINTERS)}
_NULL = ptr(None)


def _feature_args(params: AttentionParams, slots: dict) -> list:
    """diag_offset, window bounds, mask and its strides, dropout seed (a pointer) / threshold / scale."""
    args = [i32(max(-UNBOUNDED, min(params.diag_offset, UNBOUNDED))), i32(_clamp_bound(params.window_left)),
            i32(_clamp_bound(params.window_right))]
    mask = params.mask
    if mask is not None and mask.dtype == torch.bool:
        args += [slots["mask"]] + [i64(s) for s in mask.stride()]
    else:
        args += [_NULL, i64(0), i64(0), i64(0), i64(0)]
    p = float(params.dropout_p)
    if p > 0:  # the kernels read the seed words from the device (graph-safe)
        args += [slots["seed"], u32(dropout_threshold(p)), f32(1.0 / (1.0 - p))]
    else:
        args += [_NULL, u32(0), f32(1.0)]
    return args


def float_mask_view(mask: torch.Tensor) -> torch.Tensor:
    """A float attn_mask (B, H, Nq, Nk), broadcast by strides, as float32 with the same broadcast: only the
    distinct elements are converted (dims of stride 0 or size 1 stay stride 0)."""
    broadcast = [mask.shape[i] == 1 or mask.stride(i) == 0 for i in range(4)]
    distinct = mask[tuple(slice(0, 1) if b else slice(None) for b in broadcast)]
    if distinct.dtype != torch.float32:
        distinct = distinct.to(torch.float32)
    return distinct.expand(mask.shape)


def _extra_args(params: AttentionParams, head_dim_v: int, slots: dict, float_mask=None, dmask: bool = False) -> list:
    """The arguments every main kernel takes after the feature arguments (used only by the variants with
    feature flags): value head dim, softcap factors, the float mask (float_mask_view's result: its strides
    depend only on the mask's shape, strides and dtype, which are in the call signature) and its strides, the
    float32 mask-gradient buffer (``dmask``: the dQ kernel writes it) or null."""
    if params.softcap is not None:
        args = [i32(head_dim_v), f32(2.0 * LOG2E * params.scale / params.softcap), f32(params.softcap * LOG2E)]
    else:
        args = [i32(head_dim_v), f32(0.0), f32(0.0)]
    if float_mask is not None:
        args += [slots["float_mask"]] + [i64(0 if float_mask.shape[i] == 1 else float_mask.stride(i)) for i in range(4)]
    else:
        args += [_NULL, i64(0), i64(0), i64(0), i64(0)]
    return args + [slots["dmask"] if dmask else _NULL]


def _hopper_extra_args(params: AttentionParams, slots: dict, float_mask) -> list:
    """The Hopper kernels' last arguments: common.cuh's Softcap factors (zeros without a softcap), the float32 mask
    (``float_mask``: float_mask_view's result, or None) and its four strides."""
    return _extra_args(params, 0, slots, float_mask)[1:8]


def _float_mask_of(features, params: AttentionParams):
    return float_mask_view(params.mask) if "FLOAT_MASK" in features else None


def _prepared(launcher, variant, grid, args, device, cc):
    """``launch(pointers)`` of one kernel launch: through the launcher's ``prepare`` where it has one, else its
    ``launch`` with the call's ``(kind, value)`` arguments."""
    template = ArgumentTemplate(args)
    prepare = getattr(launcher, "prepare", None)
    if prepare is not None:
        return prepare(variant, grid, template, device, cc)
    return lambda pointers: launcher.launch(variant, grid, template.bind(pointers), device, cc)


# ---- plans: what the calls of one signature share ------------------------------------------------------------
# A call signature is everything the variant choice, the grid and the kernels' non-pointer arguments depend on:
# the launcher, compute capability, device, dtype, shapes and strides, each input's address modulo 16 (whether
# kernel_ready copies it), the parameters (the fields AttentionParams compares: all but the mask and the seed),
# and the mask's dtype, shape and strides. A plan keeps the tile-table entries its variants were chosen from and is
# made again when one of them changed (a tuning sweep, a test). A call with a plan only allocates its outputs,
# copies the inputs the plan says kernel_ready copies, gathers the data pointers and launches.

PLANS_LIMIT = 1024


class _Plans(dict):
    """Plans by call signature; beyond PLANS_LIMIT the oldest makes room."""

    def put(self, key: tuple, plan):
        return put_bounded(self, key, plan, PLANS_LIMIT)


_forward_plans = _Plans()
_backward_plans = _Plans()


# The fields AttentionParams compares (all but the mask and the seed), as one tuple: a key that holds no tensor.
_params_signature = operator.attrgetter(*(f.name for f in dataclasses.fields(AttentionParams) if f.compare))


def _mask_signature(mask):
    return None if mask is None else (mask.dtype, mask.shape, mask.stride())


def _copied(tensors, copies) -> list:
    return [t.contiguous() if copy else t for t, copy in zip(tensors, copies)]


class _ForwardPlan:
    __slots__ = ("d", "tiles", "out_shape", "out_stride", "lse_shape", "no_keys", "copies", "bool_mask", "dropout",
                 "float_mask", "maps", "tile_counter", "launch", "lse_scratch")


def _forward_tiles(d):
    return variants.FWD_TILES.get(d), variants.FWD_TILES_BOUNDED.get(d), variants.HOPPER_FWD_TILES.get(d)


# ---- the Hopper family ------------------------------------------------------------------------------------------
# The forward runs the Hopper kernel (kernels/hopper_fwd.cu) on an sm_90 GPU for the problems it covers, through a
# launcher that passes tensor maps (CupyLauncher); MHATTN_CUPY_HOPPER=0 (read at import; HOPPER_ENABLED at run
# time) keeps the mma.sync kernels everywhere.
HOPPER_ENV = "MHATTN_CUPY_HOPPER"
HOPPER_ENABLED = os.environ.get(HOPPER_ENV, "1").strip().lower() not in ("0", "false", "no", "off", "never")


def hopper_refusal(cc, dtype, head_dim: int, head_dim_v: int, dropout: bool, float_mask: bool, backward: bool = False,
                   deterministic: bool = False, softcap: bool = False, mask_grad: bool = False) -> Optional[str]:
    """Why the Hopper forward (``backward``: the Hopper backward, with head dims of its own; ``deterministic``: with
    reproducible gradients asked for; ``mask_grad``: a float mask's gradient asked for) does not run a problem (None:
    it does, where the tensors can be mapped)."""
    head_dims = tuple(variants.HOPPER_BWD_TILES) if backward else variants.HOPPER_HEAD_DIMS
    if not HOPPER_ENABLED:
        return f"{HOPPER_ENV}=0"
    if tuple(cc or ()) != variants.HOPPER_CC:
        return "not an sm_90 GPU"
    if dtype not in _DTYPE_NAMES:
        return f"dtype {dtype}"
    if head_dim != head_dim_v or head_dim not in head_dims:
        return f"head dims {head_dim}/{head_dim_v} (equal, one of {head_dims})"
    if dropout:
        return "dropout"
    if backward and mask_grad:
        return "a float mask's gradient (formed by the mma.sync dQ kernel)"
    if backward and float_mask and softcap:
        return "a float mask with a softcap (the Hopper backward finds the softcap's factor from P)"
    if backward and deterministic and head_dim not in variants.HOPPER_BWD_DETERMINISTIC_DIMS:
        return (f"a deterministic backward at head dim {head_dim} (there the Hopper backward's dQ in turns is slower "
                "than the mma.sync dQ kernel)")
    return None


def hopper_problem_refusal(problem, backward: bool = False, deterministic: bool = False) -> Optional[str]:
    """:func:`hopper_refusal` of a dispatcher Problem (no tensors: their alignment is not known there); ``backward``:
    the backward's head dims (``deterministic``: with reproducible gradients)."""
    features = problem.features
    return hopper_refusal(problem.compute_capability, problem.dtype, problem.head_dim, problem.head_dim_v,
                          "dropout" in features, "float_mask" in features, backward, deterministic,
                          "softcap" in features, "mask_grad" in features)


def _mask_kinds(params: AttentionParams) -> tuple:
    """(a boolean attn_mask?, a float one?) of a call."""
    mask = params.mask
    return mask is not None and mask.dtype == torch.bool, mask is not None and mask.dtype != torch.bool


def _hopper_call_refusal(launcher, cc, params: AttentionParams, tensors: dict, backward: bool = False,
                         deterministic: bool = False) -> Optional[str]:
    """:func:`hopper_refusal` of a call; ``tensors``: name -> the (B, H, N, D) tensors the kernel reads through maps."""
    if not getattr(launcher, "tensor_maps", False):
        return "a launcher without tensor maps"
    q, v = tensors["q"], tensors["v"]
    float_mask = _mask_kinds(params)[1]
    reason = hopper_refusal(cc, q.dtype, q.shape[-1], v.shape[-1], params.dropout_p > 0, float_mask, backward,
                            deterministic, params.softcap is not None, bool(params.mask_requires_grad))
    if reason is None and not backward and float_mask and _varies_by_query(params.mask):
        return FLOAT_MASK_BY_QUERY
    if reason is None:
        for name, t in tensors.items():
            why = tensor_maps.why_not_mappable(t)
            if why:
                return f"{name}: {why}"
    return reason


# A float mask that varies along the queries is read per score, four bytes each: the Hopper forward measured level
# with the mma.sync one on it (NOTES.md, H15), so the forward keeps the mma.sync kernel (the backward takes the Hopper
# kernel: 1.4x there).
FLOAT_MASK_BY_QUERY = "a float mask that varies along the queries (the mma.sync forward is as fast on it)"


def _varies_by_query(mask: torch.Tensor) -> bool:
    return mask.shape[2] > 1 and mask.stride(2) != 0


def _row_maps(launcher, tensors, box_rows) -> tuple:
    wrap = getattr(launcher, "struct_value", None)
    return tuple(tensor_maps.RowMaps(t, rows, wrap) for t, rows in zip(tensors, box_rows))


# The Hopper forward's pointer slots that _feature_args and _extra_args read (it takes no dropout).
_HOPPER_FWD_SLOTS = {"mask": slot(7), "float_mask": slot(8), "seed": _NULL}


def _hopper_forward_plan(plan: _ForwardPlan, launcher, cc, q, k, v, out, params: AttentionParams, device) -> None:
    """The plan's launch through kernels/hopper_fwd.cu; its pointer tuple is (q map, k map, v map, out, lse, tile
    counter or 0, the output's map with the output staged for the copy engine or 0, the boolean mask or 0, the float
    mask's float32 view or 0)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    mask = params.mask
    bool_mask, float_mask = _mask_kinds(params)
    variant = variants.hopper_fwd_variant(_DTYPE_NAMES[q.dtype], head_dim, masked=params.has_window,
                                          softcap=params.softcap is not None, bool_mask=bool_mask,
                                          float_mask=float_mask)
    block_m, block_n = 64 * variant.define("CONSUMERS"), variant.define("BLOCK_N")
    staged = bool(variant.define("STAGED_OUT"))
    # the output's map: boxes of one consumer's 64 rows
    plan.maps = _row_maps(launcher, (q, k, v, out)[:4 if staged else 3], (block_m, block_n, block_n, 64))
    pairs = batch * heads_q
    args = [slot(0), slot(1), slot(2)] + [slot(6)] * staged + [slot(3), slot(4), slot(5)] + _strides(out)
    args += [i32(seqlen_q), i32(seqlen_k), i32(heads_q), i32(heads_q // heads_kv), i32(pairs),
             i32(sched_pairs(pairs, seqlen_k, head_dim, q.element_size(),
                             SCHED_L2_BYTES if params.has_window else SCHED_L2_BYTES_EQUAL_TILES)),
             f32(params.scale * LOG2E)]
    # diag_offset, window_left, window_right, the boolean mask and its strides; the softcap factors, the float mask and
    # its strides (those of float_mask_view's result, which depend only on the mask's shape, strides and dtype)
    args += _feature_args(params, _HOPPER_FWD_SLOTS)[:8] + _hopper_extra_args(
        params, _HOPPER_FWD_SLOTS, float_mask_view(mask) if float_mask else None)
    plan.bool_mask, plan.float_mask = bool_mask, float_mask
    # Persistent: one CTA per SM (at most one fits), each walking tiles; under a causal mask or a window (tiles of
    # unequal cost) the CTAs take the next tile from a counter (zeroed per call), whichever is free first.
    tiles = cdiv(seqlen_q, block_m) * pairs
    persistent = variants.HOPPER_FWD_TILES[head_dim].persistent
    plan.tile_counter = persistent and params.has_window
    grid = (min(tiles, sm_count(device)) if persistent else tiles, 1, 1)
    plan.launch = _prepared(launcher, variant, grid, args, device, cc)


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward(launcher, cc, q, k, v, params: AttentionParams, keep_lse: bool = True):
    """Returns (out, lse) as the backend contract specifies. keep_lse False: lse is the plan's scratch view
    (layouts.scratch_rows), for a caller that drops it (one allocation fewer)."""
    device = q.device
    mask = params.mask
    key = (launcher, cc, device, q.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
           q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, _params_signature(params), _mask_signature(mask),
           HOPPER_ENABLED)
    plan = _forward_plans.get(key)
    if plan is None or (plan.tiles is not None and plan.tiles != _forward_tiles(plan.d)):
        plan = _forward_plans.put(key, _forward_plan(launcher, cc, q, k, v, params, device))
    out = torch.empty_strided(plan.out_shape, plan.out_stride, dtype=q.dtype, device=device)
    if keep_lse:
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=device)
    else:
        if plan.lse_scratch is None:
            plan.lse_scratch = layouts.scratch_rows(device, plan.lse_shape)
        lse = plan.lse_scratch
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    if plan.launch is None:
        return (out.zero_(), lse.fill_(float("-inf"))) if plan.no_keys else (out, lse)
    if plan.maps is not None:
        q_map, k_map, v_map = plan.maps[:3]
        counter = torch.zeros(1, dtype=torch.int32, device=device) if plan.tile_counter else None
        float_mask = float_mask_view(mask) if plan.float_mask else None  # (held until the launch is enqueued)
        pointers = (q_map(q.data_ptr()), k_map(k.data_ptr()), v_map(v.data_ptr()), out.data_ptr(), lse.data_ptr(),
                    0 if counter is None else counter.data_ptr(),
                    plan.maps[3](out.data_ptr()) if len(plan.maps) == 4 else 0,  # the output staged: its map
                    mask.data_ptr() if plan.bool_mask else 0,
                    0 if float_mask is None else float_mask.data_ptr())
        plan.launch(pointers)
        return out, lse
    if plan.copies:
        q, k, v = _copied((q, k, v), plan.copies)
    seed = _seed(params, device) if plan.dropout else None
    float_mask = float_mask_view(mask) if plan.float_mask else None
    plan.launch((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                 mask.data_ptr() if plan.bool_mask else 0, 0 if seed is None else seed.data_ptr(),
                 0 if float_mask is None else float_mask.data_ptr()))
    return out, lse


def _forward_plan(launcher, cc, q, k, v, params: AttentionParams, device) -> _ForwardPlan:
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    plan = _ForwardPlan()
    out = layouts.output_buffer(q, v)
    plan.out_shape, plan.out_stride, plan.lse_shape = tuple(out.shape), out.stride(), (batch, heads_q, seqlen_q)
    plan.d = plan.tiles = plan.launch = plan.copies = plan.maps = plan.lse_scratch = None
    plan.no_keys = seqlen_k == 0 and out.numel() != 0  # an empty output is returned as it is
    if out.numel() == 0 or seqlen_k == 0:
        return plan
    if _hopper_call_refusal(launcher, cc, params, {"q": q, "k": k, "v": v}) is None:
        plan.d = head_dim
        plan.tiles = _forward_tiles(head_dim)
        _hopper_forward_plan(plan, launcher, cc, q, k, v, out, params, device)
        return plan
    features = feature_flags(params, head_dim, head_dim_v)
    any_rows = "ANY_DIMS" in features
    ready = [kernel_ready(t, any_rows) for t in (q, k, v)]
    copies = tuple(r is not t for r, t in zip(ready, (q, k, v)))
    plan.copies = copies if any(copies) else None
    q, k, v = ready
    d = plan.d = variants.head_dim_bucket(max(head_dim, head_dim_v))
    plan.tiles = _forward_tiles(d)
    variant, block_m, has_bounds = _fwd_choice(cc, q.dtype, d, level_of(params, features), features, *plan.tiles)
    if has_bounds:  # query blocks of unequal cost: (group, query block, pair) in x, see fwd.cu
        grid = (cdiv(seqlen_q, block_m) * batch * heads_q, 1, 1)
    else:
        grid = (cdiv(seqlen_q, block_m), heads_q, batch)
    p = _FWD
    args = [p["q"], p["k"], p["v"], p["out"], p["lse"]]
    args += _strides(q) + _strides(k) + _strides(v) + _strides(out)
    args += [i32(seqlen_q), i32(seqlen_k), i32(heads_q), i32(heads_q // heads_kv), i32(head_dim),
             i32(sched_pairs(batch * heads_q, seqlen_k, head_dim, q.element_size())), f32(params.scale * LOG2E)]
    args += _feature_args(params, p) + _extra_args(params, head_dim_v, p, _float_mask_of(features, params))
    plan.bool_mask = _mask_kinds(params)[0]
    plan.dropout = params.dropout_p > 0
    plan.float_mask = "FLOAT_MASK" in features
    plan.launch = _prepared(launcher, variant, grid, args, device, cc)
    return plan


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


def sched_pairs(pairs: int, seqlen_k: int, head_dim: int, element_size: int, group_bytes: Optional[int] = None) -> int:
    """(batch, head) pairs per scheduling group of the forward grid: as many as have K and V within ``group_bytes``
    (default SCHED_L2_BYTES), at least one."""
    kv_bytes = 2 * seqlen_k * head_dim * element_size
    return max(1, min(pairs, (SCHED_L2_BYTES if group_bytes is None else group_bytes) // max(kv_bytes, 1)))


class _BackwardPlan:
    __slots__ = ("d", "tiles", "grads", "trivial", "mask_grad", "dmask_shape", "copies", "convert_lse",
                 "convert_grad_lse", "vector_shape", "dropout", "bool_mask", "float_mask", "atomic_dq", "dq_shape",
                 "dq_turns", "maps", "launches")


def _backward_tiles(d):
    return (variants.DKDV_TILES.get(d), variants.DKDV_ATOMIC_TILES.get(d), variants.DKDV_FALLBACK_TILES.get(d),
            variants.DQ_TILES.get(d), variants.HOPPER_BWD_TILES.get(d))


def backward(launcher, cc, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse=None,
             deterministic: bool = True):
    """Returns (dq, dk, dv, dmask); dK/dV summed over the query heads of a group; dmask the gradient of a float
    mask when ``params.mask_requires_grad`` (B, Hq, Nq, Nk) in the mask's dtype, else None.

    deterministic: dQ from its own kernel over key blocks (bitwise reproducible); False forms dQ inside the
    dK/dV kernel with float32 atomic adds (fewer operations, summation order varies) where the tiles allow
    and no mask gradient is asked for (the dQ kernel writes dS, the mask's gradient).
    """
    device = q.device
    mask = params.mask
    key = (launcher, cc, device, q.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
           out.stride(), grad_out.stride(), q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
           out.data_ptr() & 15, grad_out.data_ptr() & 15, lse.dtype, lse.stride(),
           None if grad_lse is None else (grad_lse.dtype, grad_lse.stride()), _params_signature(params),
           _mask_signature(mask), bool(deterministic), HOPPER_ENABLED)
    plan = _backward_plans.get(key)
    if plan is None or (plan.tiles is not None and plan.tiles != _backward_tiles(plan.d)):
        plan = _backward_plans.put(key, _backward_plan(launcher, cc, grad_out, q, k, v, out, lse, params, grad_lse,
                                                       deterministic, device))
    (dq_shape, dq_stride), (dk_shape, dk_stride), (dv_shape, dv_stride) = plan.grads
    dq = torch.empty_strided(dq_shape, dq_stride, dtype=q.dtype, device=device)
    dk = torch.empty_strided(dk_shape, dk_stride, dtype=k.dtype, device=device)
    dv = torch.empty_strided(dv_shape, dv_stride, dtype=v.dtype, device=device)
    if POISON_OUTPUTS:
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
    # zeros: the blocks outside the causal / window band are never visited, and their gradient is 0
    dmask = torch.zeros(plan.dmask_shape, dtype=torch.float32, device=device) if plan.mask_grad else None
    if plan.trivial:
        return dq.zero_(), dk.zero_(), dv.zero_(), _mask_grad_out(dmask, params)
    if plan.copies:
        q, k, v, out, grad_out = _copied((q, k, v, out, grad_out), plan.copies)
    if plan.convert_lse:
        lse = lse.to(torch.float32).contiguous()
    if plan.convert_grad_lse:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    # delta = rowsum(dO * O) - grad_lse and lse in log2 units, padded per (b, h) to a multiple of VECTOR_PAD.
    lse_log2 = torch.empty(plan.vector_shape, dtype=torch.float32, device=device)
    delta = torch.empty(plan.vector_shape, dtype=torch.float32, device=device)
    seed = _seed(params, device) if plan.dropout else None
    float_mask = float_mask_view(mask) if plan.float_mask else None
    dq_accum = dq_turns = None
    if plan.atomic_dq:
        # one zeroed buffer: the float32 accumulator, then the deterministic Hopper backward's int32 turn counters
        # (zero bits either way)
        accum_size = math.prod(plan.dq_shape)
        zeros = torch.zeros(accum_size + plan.dq_turns, dtype=torch.float32, device=device)
        dq_accum = zeros[:accum_size].view(plan.dq_shape)
        dq_turns = zeros[accum_size:].view(torch.int32) if plan.dq_turns else None
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(),
                0 if grad_lse is None else grad_lse.data_ptr(), lse_log2.data_ptr(), delta.data_ptr(),
                dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), 0 if dq_accum is None else dq_accum.data_ptr(),
                mask.data_ptr() if plan.bool_mask else 0, 0 if seed is None else seed.data_ptr(),
                0 if float_mask is None else float_mask.data_ptr(), 0 if dmask is None else dmask.data_ptr(),
                0 if dq_turns is None else dq_turns.data_ptr())
    if plan.maps is not None:  # the Hopper backward's tensor maps follow, in _HOPPER_BWD_MAPS order
        pointers += tuple(make(t.data_ptr()) for make, t in zip(plan.maps, (q, k, v, grad_out)))
    for launch in plan.launches:
        launch(pointers)
    if dq_accum is not None:
        dq.copy_(dq_accum)
        return dq, dk, dv, None
    return dq, dk, dv, _mask_grad_out(dmask, params)


def _backward_plan(launcher, cc, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse, deterministic,
                   device) -> _BackwardPlan:
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    features = feature_flags(params, head_dim, head_dim_v)
    if "FLOAT_MASK" in features and grad_lse is not None:
        # On the H100 this combination gave NaN in dQ, dK and the mask gradient (the emulator does not show it):
        # refused with a clear error rather than computed wrongly.
        raise BackendUnavailableError(
            "cupy backend: a gradient flowing into the returned lse together with a float attn_mask is not "
            "supported yet; use backend='triton' (or no return_lse gradient)")
    plan = _BackwardPlan()
    dq, dk, dv = (layouts.grad_buffer(t) for t in (q, k, v))
    plan.grads = tuple((tuple(t.shape), t.stride()) for t in (dq, dk, dv))
    plan.mask_grad = "FLOAT_MASK" in features and params.mask_requires_grad
    plan.dmask_shape = (batch, heads_q, seqlen_q, seqlen_k)
    plan.d = plan.tiles = plan.copies = plan.maps = None
    plan.dq_turns = 0
    plan.trivial = seqlen_q == 0 or seqlen_k == 0 or batch == 0 or heads_q == 0
    if plan.trivial:
        return plan
    any_rows = "ANY_DIMS" in features
    inputs = (q, k, v, out, grad_out)
    ready = [kernel_ready(t, any_rows) for t in inputs]
    copies = tuple(r is not t for r, t in zip(ready, inputs))
    plan.copies = copies if any(copies) else None
    q, k, v, out, grad_out = ready
    plan.convert_lse = lse.to(torch.float32).contiguous() is not lse
    plan.convert_grad_lse = grad_lse is not None and grad_lse.to(torch.float32).contiguous() is not grad_lse
    d = plan.d = variants.head_dim_bucket(max(head_dim, head_dim_v))
    plan.tiles = _backward_tiles(d)
    # The mask gradient needs dS, which only the dQ kernel writes: no atomic dQ then.
    pre, dkdv_variants, dq_variant = _bwd_choice(
        cc, q.dtype, d, level_of(params, features), bool(deterministic) or plan.mask_grad, features, *plan.tiles)
    group = heads_q // heads_kv
    p = _BWD
    launches = []

    seqlen_q_pad = cdiv(seqlen_q, VECTOR_PAD) * VECTOR_PAD
    plan.vector_shape = (batch, heads_q, seqlen_q_pad)
    rows = batch * heads_q * seqlen_q_pad
    args = [p["out"], p["grad_out"], p["lse"], p["grad_lse"] if grad_lse is not None else _NULL, p["lse_log2"],
            p["delta"]]
    args += _strides(out) + _strides(grad_out)
    args += [i32(heads_q), i32(seqlen_q), i32(seqlen_q_pad), i32(head_dim_v), i64(rows)]
    launches.append(_prepared(launcher, pre, (cdiv(rows, variants.PREPROCESS_WARPS), 1, 1), args, device, cc))

    # (a float mask's gradient: refused there, the dQ kernel writes dS)
    hopper_refused = _hopper_call_refusal(launcher, cc, params, {"q": q, "k": k, "v": v, "grad_out": grad_out},
                                          backward=True, deterministic=bool(deterministic))
    if hopper_refused is None:
        _hopper_backward_plan(plan, launcher, cc, q, k, v, grad_out, params, launches, bool(deterministic), device)
        return plan

    shape_args = [i32(seqlen_q), i32(seqlen_q_pad), i32(seqlen_k), i32(heads_q), i32(group), i32(head_dim),
                  f32(params.scale * LOG2E), f32(params.scale)]
    float_mask = _float_mask_of(features, params)
    feature_args = _feature_args(params, p) + _extra_args(params, head_dim_v, p, float_mask)

    plan.atomic_dq = dq_variant is None
    plan.dq_shape = (batch, heads_q, seqlen_q, head_dim)
    for variant in dkdv_variants:
        grid = (cdiv(seqlen_k, variant.define("BLOCK_N")), heads_kv, batch)
        args = [p["q"], p["k"], p["v"], p["grad_out"], p["lse_log2"], p["delta"], p["dk"], p["dv"],
                p["dq_accum"] if plan.atomic_dq else _NULL]
        args += _strides(q) + _strides(k) + _strides(v) + _strides(grad_out) + _strides(dk) + _strides(dv)
        launches.append(_prepared(launcher, variant, grid, args + shape_args + feature_args, device, cc))
    if not plan.atomic_dq:
        variant = dq_variant
        grid = (cdiv(seqlen_q, variant.define("BLOCK_M")), heads_q, batch)
        args = [p["q"], p["k"], p["v"], p["grad_out"], p["lse_log2"], p["delta"], p["dq"]]
        args += _strides(q) + _strides(k) + _strides(v) + _strides(grad_out) + _strides(dq)
        # the dQ kernel writes dS, the mask's gradient
        dq_feature_args = _feature_args(params, p) + _extra_args(params, head_dim_v, p, float_mask, plan.mask_grad)
        launches.append(_prepared(launcher, variant, grid, args + shape_args + dq_feature_args, device, cc))
    plan.bool_mask = _mask_kinds(params)[0]
    plan.dropout = params.dropout_p > 0
    plan.float_mask = float_mask is not None
    plan.launches = tuple(launches)
    return plan


# Keys a CTA of the Hopper backward takes (kernels/hopper_bwd.cu, BLOCK_N).
HOPPER_BWD_KEYS = 128
# Whether the Hopper backward of a problem whose keys fit one CTA stores dQ itself (DQ_DIRECT; False: always through
# the float32 buffer, e.g. to compare the two). Read when a call signature's plan is made (_backward_plans).
HOPPER_BWD_DIRECT_DQ = True


def hopper_bwd_stores_dq(seqlen_k: int) -> bool:
    """Whether the Hopper backward of ``seqlen_k`` keys stores dQ itself (DQ_DIRECT), where dQ is (B, Hq, Nq, D)
    contiguous: every key in one CTA, and the switch on."""
    return HOPPER_BWD_DIRECT_DQ and seqlen_k <= HOPPER_BWD_KEYS


# Slots of the Hopper backward's maps in a call's pointer tuple: after BWD_POINTERS, of q, k, v, grad_out.
_HOPPER_BWD_MAPS = {name: slot(len(BWD_POINTERS) + i) for i, name in enumerate(("q", "k", "v", "grad_out"))}


def _hopper_backward_plan(plan: _BackwardPlan, launcher, cc, q, k, v, grad_out, params: AttentionParams, launches,
                          deterministic: bool, device) -> None:
    """The plan's launches after the preprocess: kernels/hopper_bwd.cu (dK, dV; dQ into the float32 accumulator;
    ``deterministic``: the key blocks add it in turns, with a counter per query block). Where every key fits one CTA
    and dQ is laid out (B, Hq, Nq, D) contiguous, the kernel stores dQ itself (DQ_DIRECT): no accumulator to zero and
    convert, and reproducible whatever ``deterministic`` says."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    mask = params.mask
    bool_mask, float_mask = _mask_kinds(params)
    dq_shape, dq_stride = plan.grads[0]
    direct = hopper_bwd_stores_dq(seqlen_k) and dq_stride == layouts.contiguous_strides(dq_shape)
    turns = deterministic and not direct  # a direct dQ is reproducible as it is
    variant = variants.hopper_bwd_variant(_DTYPE_NAMES[q.dtype], head_dim, deterministic=turns,
                                          softcap=params.softcap is not None, bool_mask=bool_mask,
                                          float_mask=float_mask, direct_dq=direct)
    query_rows = variant.define("QUERY_ROWS")
    plan.maps = _row_maps(launcher, (q, k, v, grad_out), (query_rows, HOPPER_BWD_KEYS, HOPPER_BWD_KEYS, query_rows))
    dk, dv = (torch.empty_strided(shape, stride, device="meta") for shape, stride in plan.grads[1:])
    m, p = _HOPPER_BWD_MAPS, _BWD
    args = [m["q"], m["k"], m["v"], m["grad_out"], p["lse_log2"], p["delta"], p["dq"] if direct else p["dq_accum"],
            p["dq_turns"] if turns else _NULL, p["dk"], p["dv"]]
    args += _strides(dk) + _strides(dv)
    args += [i32(seqlen_q), i32(plan.vector_shape[2]), i32(seqlen_k), i32(heads_q), i32(heads_q // heads_kv),
             f32(params.scale * LOG2E), f32(params.scale)]
    # diag_offset, window_left, window_right, the boolean mask and its strides; the softcap factors, the float mask and
    # its strides
    args += _feature_args(params, p)[:8] + _hopper_extra_args(params, p, float_mask_view(mask) if float_mask else None)
    launches.append(_prepared(launcher, variant, (cdiv(seqlen_k, HOPPER_BWD_KEYS), heads_kv, batch), args, device,
                              cc))
    plan.atomic_dq = not direct
    plan.dq_shape = (batch, heads_q, seqlen_q, head_dim)
    # one dQ turn counter a (batch, head, query block)
    plan.dq_turns = batch * heads_q * cdiv(seqlen_q, query_rows) if turns else 0
    plan.bool_mask, plan.float_mask = bool_mask, float_mask
    plan.dropout = False
    plan.launches = tuple(launches)


def _mask_grad_out(dmask, params: AttentionParams):
    return None if dmask is None else dmask.to(params.mask.dtype)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
