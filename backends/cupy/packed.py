"""Host side of the KV-cache and packed (varlen) entry points: the mma.sync kernels with per-sequence addressing
(kernels/sequences.cuh), on every GPU (the Hopper kernels take dense attention only).

- ``forward_kvcache``: kernels/fwd.cu with KV_CACHE 1 (contiguous cache (B, Hkv, Nmax, D)) or 2 (paged pool
  (num_blocks, Hkv, block_size, D) and a block table). Each sequence attends over its first ``cache.seqlens[b]``
  keys with its queries aligned bottom-right; the kernel reads the lengths (and the block table) from the device,
  so a decoding loop's calls share one plan. The cache is never copied: rows that are not 16-byte aligned take the
  ANY_DIMS variants. A decoding step (at most DECODE_MAX_ROWS query rows) takes the KV_SPLIT variants: CTAs of
  16 rows, and where (batch, head) pairs would not fill the GPU each sequence's keys are split over ``kv_splits``
  CTAs whose float32 partial results kernels/kv_combine.cu merges (split-KV decoding). A step of one query under
  GQA packs the query heads of a key/value head as the rows of one CTA (``packs_query_heads``), so each head's keys
  and values are read once per step instead of once per query head. Dense attention of one query row over at least
  DENSE_DECODING_MIN_KEYS keys (``mhattn.attention`` of a decoding step) runs the same way, its k and v as a full
  cache (``decodes_dense``), with a boolean mask if it has one (a batch of left-padded prompts decoding: the padding
  mask (B, 1, 1, Nk)), which the kernels read a key block at a time as the dense kernels do; a mask that is the same
  for every head keeps the query heads packed.
- ``forward_varlen`` / ``backward_varlen``: the packed (total, H, D) tensors reach the kernels with batch stride
  0 and VARLEN 1; each CTA finds its sequence's rows in cu_seqlens and leaves at once when its block lies past
  that sequence's end. Grids are sized by the longest sequence. The backward forms dQ in its own kernel
  (deterministic); its lse_log2 / delta vectors hold each head's sequences one after the other, each padded to
  a multiple of VECTOR_PAD rows (sequences.cuh's vector_start).

Shapes and layouts as the backend contract (mhattn.backends.base) gives them: kvcache out (B, Hq, Nq, Dv) with
(B, Nq, Hq, Dv) memory and lse (B, Hq, Nq); varlen out (total_q, Hq, Dv), lse (Hq, total_q), dq / dk / dv
contiguous like q / k / v.
"""

from __future__ import annotations

import functools

import torch

from mhattn.backends import layouts
from mhattn.backends.base import AttentionParams, KVCache, Packing, cache_capacity, new_rows_contiguous
from mhattn.backends.splits import split_count
from mhattn.backends.cupy import ops, variants
from mhattn.backends.cupy.launcher import i32, i64, f32, slot
from mhattn.backends.cupy.ops import LOG2E, _NULL, _empty, _extra_args, _feature_args, _prepared, cdiv
from mhattn.caches import put_bounded

# Sequence b's rows of the backward's per-head vectors start at (cu_seqlens_q[b] rounded up to 4) + b * VECTOR_GAP
# (kernels/sequences.cuh): room for its rows padded to a multiple of VECTOR_PAD.
VECTOR_PAD = 128
VECTOR_GAP = VECTOR_PAD + 4

# The data pointers of a call, in these orders (the launches' argument templates name them by position).
FWD_POINTERS = ("q", "k", "v", "out", "lse", "seq_q", "seq_k", "block_table", "o_split", "lse_split")
BWD_POINTERS = ("q", "k", "v", "out", "grad_out", "lse", "grad_lse", "lse_log2", "delta", "dq", "dk", "dv",
                "seq_q", "seq_k")
_FWD = {name: slot(i) for i, name in enumerate(FWD_POINTERS)}
_BWD = {name: slot(i) for i, name in enumerate(BWD_POINTERS)}
# No mask and no float mask reach the varlen entry points (see _seed_slots: dropout's seed only), a boolean mask only a
# dense decoding step's (forward_kvcache: its address follows FWD_POINTERS, no seed).
_KVCACHE_FWD = dict(_FWD, mask=slot(len(FWD_POINTERS)), seed=_NULL)

_plans = ops._Plans()


def _aligned(t: torch.Tensor) -> bool:
    """Rows start 16-byte aligned (what the variants without ANY_DIMS need), for any strides."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def _features(params: AttentionParams, head_dim: int, head_dim_v: int, tensors) -> tuple:
    """The feature flags of a call; ANY_DIMS also where an input's rows are not 16-byte aligned (those tensors are
    read as they are, never copied: a cache is written in place by its owner)."""
    features = ops.feature_flags(params, head_dim, head_dim_v)
    if "ANY_DIMS" not in features and not all(_aligned(t) for t in tensors):
        features += ("ANY_DIMS",)
    return tuple(flag for flag in variants.FEATURE_FLAGS if flag in features)


def _packed_strides(t: torch.Tensor) -> list:
    """(batch, head, row) strides of a packed (total, H, D) tensor seen as a batch of sequences."""
    return [i64(0), i64(t.stride(1)), i64(t.stride(0))]


def _sequence_args(slots: dict, table_stride: int = 0, page_size: int = 0, packed_stride: int = 0,
                   splits: int = 1) -> list:
    """The kernels' sequence arguments (SEQUENCE_PARAMS): seq_q, seq_k, block_table, its row stride, the page size,
    the packed lse's head stride, the split outputs and the number of splits."""
    return [slots.get("seq_q", _NULL), slots["seq_k"], slots.get("block_table", _NULL), i64(table_stride),
            i32(page_size), i64(packed_stride), slots["o_split"] if splits > 1 else _NULL, i32(splits)]


# Split-KV decoding: a split gets at least SPLIT_MIN_KEYS keys of the cache's capacity, and the splits aim at
# SPLITS_PER_SM CTAs per SM. The emulator (CPU tensors) counts EMULATED_SM_COUNT SMs.
SPLIT_MIN_KEYS = 256
SPLITS_PER_SM = 2
MAX_SPLITS = 64
EMULATED_SM_COUNT = 4


def kv_splits(ctas: int, capacity: int, sm_count: int, min_keys: int = None) -> int:
    """How many CTAs share the keys of one (sequence, head, query block) (backends/splits.py): one where the unsplit
    grid of ``ctas`` already fills the GPU or the cache is short."""
    return split_count(ctas, capacity, sm_count, SPLIT_MIN_KEYS if min_keys is None else min_keys, SPLITS_PER_SM,
                       MAX_SPLITS)


def packs_query_heads(q: torch.Tensor, heads_kv: int, params: AttentionParams) -> bool:
    """Whether a KV-cache call runs the query heads of each key/value head as the rows of one (sequence, key/value
    head) CTA: a step of one query (Nq = 1) under GQA. That one query sits at its sequence's last position, so a
    causal mask or a right window hides none of its keys and every packed row sees the same keys; a left window
    would bound each row by its own position, so it keeps one CTA a query head, as does a mask that differs between
    heads (its addressing is per head; a dense decoding step's boolean mask that is the same for every head is read
    by every packed row alike: mask_as_rows). The KV path has no dropout."""
    mask = params.mask
    return (q.shape[2] == 1 and q.shape[1] > heads_kv and params.window_left is None and params.dropout_p == 0.0
            and (mask is None or mask.shape[1] == 1 or mask.stride(1) == 0))


def mask_as_rows(mask: torch.Tensor, rows_shape) -> torch.Tensor:
    """A decoding step's mask (B, Hq, 1, Nk), the same for every head (size 1 or stride 0 along a broadcast dim), as
    the packed CTAs read it: rows_shape (B, Hkv, Hq / Hkv, ...) of heads_as_rows, every row of every key/value head
    reading the batch entry's one row of the mask."""
    batch, heads_kv, group = rows_shape[:3]
    batch_stride = mask.stride(0) if mask.shape[0] > 1 else 0
    return mask.as_strided((batch, heads_kv, group, mask.shape[3]), (batch_stride, 0, 0, mask.stride(3)))


def heads_as_rows(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(B, Hq, 1, D) as (B, Hkv, Hq / Hkv, D): the query heads of key/value head j become its rows (a view; head
    j * group + r is row r of head j, so the head stride serves as the row stride)."""
    batch, heads_q, _, dim = t.shape
    group = heads_q // heads_kv
    return t.as_strided((batch, heads_kv, group, dim), (t.stride(0), group * t.stride(1), t.stride(1), t.stride(3)))


def _sm_count(device) -> int:
    return ops.sm_count(device) if device.type == "cuda" else EMULATED_SM_COUNT


def _shape_args(q_rows, k_rows, heads_q, group, head_dim, params: AttentionParams, pairs, element_size) -> list:
    """The forward's sizes, scheduling group and scale (kernels/fwd.cu), as ops' dense forward passes them."""
    return [i32(q_rows), i32(k_rows), i32(heads_q), i32(group), i32(head_dim),
            i32(ops.sched_pairs(pairs, k_rows, head_dim, element_size)), f32(params.scale * LOG2E)]


@functools.lru_cache(maxsize=512)
def _fwd_choice(cc, dtype, d: int, level: str, features: tuple, sequences: str, *tables) -> tuple:
    tiles = variants.decode_tiles(cc, d) if sequences.endswith("_split") else None
    variant = variants.fwd_variant(cc, ops._DTYPE_NAMES[dtype], d, level, tiles=tiles, features=features,
                                   sequences=sequences)
    return variant, variant.define("BLOCK_M"), bool(variant.define("HAS_BOUNDS"))


def _fwd_tiles(d) -> tuple:
    """The tile-table entries a forward of head-dim bucket d is chosen from."""
    return ops._forward_tiles(d) + (variants.DECODE_TILES.get(d),)


@functools.lru_cache(maxsize=512)
def _bwd_choice(cc, dtype, d: int, level: str, features: tuple, *tables) -> tuple:
    name = ops._DTYPE_NAMES[dtype]
    return (variants.preprocess_variant(name, any_dims="ANY_DIMS" in features, varlen=True),
            tuple(variants.dkdv_variants(cc, name, d, level, features=features, sequences="varlen")),
            variants.dq_variant(cc, name, d, level, features=features, sequences="varlen"))


def _forward_launch(launcher, cc, device, q, k, v, params, features, sequences, batch, heads_q, heads_kv, q_rows,
                    k_rows, strides, sequence_args, slots, splits=1):
    """The prepared launch of kernels/fwd.cu for ``sequences``; ``strides``: q, k, v, out (batch, head, row)."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    d = variants.head_dim_bucket(max(head_dim, head_dim_v))
    variant, block_m, has_bounds = _fwd_choice(cc, q.dtype, d, ops.level_of(params, features), features, sequences,
                                               *_fwd_tiles(d))
    if sequences.endswith("_split"):  # (query block + blocks * split, head, batch), see fwd.cu
        grid = (cdiv(q_rows, block_m) * splits, heads_q, batch)
    elif has_bounds:  # query blocks of unequal cost: (group, query block, pair) in x, see fwd.cu
        grid = (cdiv(q_rows, block_m) * batch * heads_q, 1, 1)
    else:
        grid = (cdiv(q_rows, block_m), heads_q, batch)
    args = [slots["q"], slots["k"], slots["v"], slots["out"], slots["lse_split" if splits > 1 else "lse"]] + strides
    args += _shape_args(q_rows, k_rows, heads_q, heads_q // heads_kv, head_dim, params, batch * heads_q,
                        q.element_size())
    args += _feature_args(params, slots) + _extra_args(params, head_dim_v, slots) + sequence_args
    return d, _prepared(launcher, variant, grid, args, device, cc)


# ---- forward_kvcache -----------------------------------------------------------------------------------------


def forward_kvcache(launcher, cc, q, cache: KVCache, params: AttentionParams):
    """(out, lse) of q (B, Hq, Nq, D) over each sequence's first cache.seqlens[b] keys (Backend.forward_kvcache)."""
    device = q.device
    k, v = cache.k, cache.v
    seqlens = cache.seqlens if cache.seqlens.is_contiguous() else cache.seqlens.contiguous()
    table = cache.block_table
    if table is not None and table.stride(-1) != 1:
        table = table.contiguous()
    batch, heads_q, seqlen_q, _ = q.shape
    splits = 0  # not a decoding step
    if 0 < seqlen_q <= variants.DECODE_MAX_ROWS:
        ctas = batch * heads_q  # one 16-row query block per (sequence, head); packed: the heads' rows of a kv head
        if packs_query_heads(q, k.shape[1], params):
            ctas = batch * k.shape[1] * cdiv(heads_q // k.shape[1], variants.DECODE_MAX_ROWS)
        splits = kv_splits(ctas, cache.capacity, _sm_count(device))
    key = ("kvcache", launcher, cc, device, q.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
           q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, None if table is None else table.shape,
           None if table is None else table.stride(), ops._params_signature(params), ops._mask_signature(params.mask),
           splits)
    plan = _plans.get(key)
    if plan is None or (plan[0] is not None and plan[1] != _fwd_tiles(plan[0])):
        plan = _plans.put(key, _kvcache_plan(launcher, cc, device, q, k, v, table, params, splits))
    out = layouts.output_buffer(q, v)
    lse = _empty(q.shape[:3], torch.float32, device)
    if ops.POISON_OUTPUTS:
        out.fill_(float("nan"))
    launches = plan[2]
    if not launches:  # an empty output
        return out, lse
    o_split = lse_split = None
    if splits > 1:
        o_split = _empty((splits,) + tuple(out.shape), torch.float32, device)
        lse_split = _empty((splits,) + tuple(lse.shape), torch.float32, device)
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 0, seqlens.data_ptr(),
                0 if table is None else table.data_ptr(), 0 if o_split is None else o_split.data_ptr(),
                0 if lse_split is None else lse_split.data_ptr(),
                0 if params.mask is None else params.mask.data_ptr())  # (FWD_POINTERS, then the mask)
    for launch in launches:
        launch(pointers)
    return out, lse


def _kvcache_plan(launcher, cc, device, q, k, v, table, params: AttentionParams, splits: int) -> tuple:
    """(head-dim bucket, its tile-table entries, the launches: the forward, and the combine of its splits)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    out = torch.empty_strided(*layouts.rows_major_layout(batch, heads_q, seqlen_q, v.shape[-1]), device="meta")
    if out.numel() == 0:
        return None, None, ()
    paged = table is not None
    capacity = cache_capacity(k, table)
    # What the forward kernel sees: q and out as they are, or (packed) each key/value head's query heads as its rows,
    # with no causal or right bound (none hides a key from the one query) and one query head per key/value head.
    q_rows, out_rows, kernel_params, kernel_heads = q, out, params, heads_q
    if packs_query_heads(q, k.shape[1], params):
        q_rows, out_rows = heads_as_rows(q, k.shape[1]), heads_as_rows(out, k.shape[1])
        mask = None if params.mask is None else mask_as_rows(params.mask, q_rows.shape)
        kernel_params, kernel_heads = params.replace(window_right=None, mask=mask), k.shape[1]
    strides = ops._strides(q_rows) + ops._strides(k) + ops._strides(v) + ops._strides(out_rows)  # k, v: the pool's
    slots = _KVCACHE_FWD  # (_feature_args reads the mask's slot where there is a boolean mask)
    sequence_args = _sequence_args(slots, table.stride(0) if paged else 0, k.shape[2] if paged else 0, 0,
                                   max(splits, 1))
    features = _features(kernel_params, head_dim, v.shape[-1], (q_rows, k, v))
    mode = ("paged_kvcache" if paged else "kvcache") + ("_split" if splits else "")
    d, launch = _forward_launch(launcher, cc, device, q_rows, k, v, kernel_params, features, mode, batch,
                                kernel_heads, k.shape[1], q_rows.shape[2], capacity, strides, sequence_args, slots,
                                max(splits, 1))
    launches = (launch,)
    if splits > 1:  # kernels/kv_combine.cu: one warp a row
        rows = batch * heads_q * seqlen_q
        args = [slots["o_split"], slots["lse_split"], slots["out"], slots["lse"]] + ops._strides(out)
        args += [i32(heads_q), i32(seqlen_q), i32(v.shape[-1]), i32(splits), i64(rows)]
        combine = variants.combine_variant(ops._DTYPE_NAMES[q.dtype])
        launches += (_prepared(launcher, combine, (cdiv(rows, variants.COMBINE_WARPS), 1, 1), args, device, cc),)
    return d, _fwd_tiles(d), launches


# ---- the KV cache's append -------------------------------------------------------------------------------------


def append_kvcache(launcher, cc, k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Backend.append_kvcache: kernels/kv_append.cu writes k (B, Hkv, Nq, D) and v (B, Hkv, Nq, Dv) into the cache
    at positions cache_seqlens[b] + i (through block_table when paged), in place, and returns the key counts after the
    append (cache_seqlens + Nq, (B,) int32): one launch where torch's indexing takes several. None where the kernel
    does not take the call: new rows whose head dims are not contiguous (the front end's indexing writes those)."""
    if not new_rows_contiguous(k, v):
        return None
    device = k.device
    batch, heads_kv, seqlen_q, _ = k.shape
    if batch * heads_kv * seqlen_q == 0:  # no row to write
        return cache_seqlens + seqlen_q
    paged = block_table is not None
    key = ("append", launcher, cc, device, k.dtype, k.shape, k.stride(), v.shape, v.stride(), k_cache.shape,
           k_cache.stride(), v_cache.shape, v_cache.stride(), cache_seqlens.stride(),
           None if not paged else (block_table.shape, block_table.stride()))
    launch = _plans.get(key)
    if launch is None:
        rows = batch * heads_kv * seqlen_q
        capacity, block_size = cache_capacity(k_cache, block_table), k_cache.shape[2] if paged else 0
        # pointers: k, v, k_cache, v_cache, cache_seqlens, the counts after, the block table
        args = [slot(i) for i in range(7)] + ops._strides(k) + ops._strides(v) + ops._strides(k_cache)
        args += ops._strides(v_cache) + [i64(cache_seqlens.stride(0))]
        args += [i64(block_table.stride(0)), i64(block_table.stride(1))] if paged else [i64(0), i64(0)]
        args += [i32(heads_kv), i32(seqlen_q), i32(k.shape[-1]), i32(v.shape[-1]), i32(capacity), i32(block_size),
                 i32(k_cache.shape[0]), i64(rows)]
        variant = variants.append_variant(ops._DTYPE_NAMES[k.dtype])
        launch = _plans.put(key, _prepared(launcher, variant, (cdiv(rows, variants.APPEND_WARPS), 1, 1), args,
                                           device, cc))
    after = torch.empty(batch, dtype=torch.int32, device=device)
    if ops.POISON_OUTPUTS:
        after.fill_(-1)
    launch((k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr(),
            after.data_ptr(), block_table.data_ptr() if paged else 0))
    return after


# ---- dense attention of a decoding step ------------------------------------------------------------------------


# Fewest keys at which a dense call of one query row runs as a decoding step. On the H100 (bf16, 32 / 8 heads, d = 128;
# NOTES.md, version 8, the limit's table) the decoding route wins by GPU time from 3k keys at B = 1 and 8 (4k: 48 / 90
# us against the dense kernels' 55 / 109), but its host path (the KV-cache entry, two launches) costs about 58 us a
# call, so at B = 1 a loop of calls gains only from about 6k keys (4k: 59 against 53 us).
DENSE_DECODING_MIN_KEYS = 4096


def decodes_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams) -> bool:
    """Whether the backend's dense forward runs as a decoding step over k and v as a full cache: one query row, at
    least DENSE_DECODING_MIN_KEYS keys, no float mask or dropout (a boolean mask is read as the dense kernels read
    it), a causal mask or window (if any) aligned bottom-right (the cache kernels' alignment), rows with their last dim
    contiguous. The dense kernels' tiles of 64-128 query
    rows would hold one real row, one CTA per (batch, head) with no split of the keys. On the H100 (NOTES.md, version
    8) this took a step over 128k keys from 1509 to 341 us; with 4 query rows the decoding kernels' one-warp CTAs, one
    per query head, were up to 2.3x slower than the dense kernels at B = 8, so several rows stay on those."""
    masked = (params.mask is not None and params.mask.dtype != torch.bool) or params.dropout_p != 0.0
    return (_decoding_shape(q.shape[2], k.shape[2], masked, params.has_window, params.diag_offset)
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def problem_decodes_dense(problem) -> bool:
    """decodes_dense from a Problem (for the backend's description of its path; strides are not in it)."""
    masked = bool(problem.features & {"float_mask", "dropout"})
    bounded = "causal" in problem.features or "window" in problem.features
    return _decoding_shape(problem.seqlen_q, problem.seqlen_k, masked, bounded, problem.diag_offset)


def _decoding_shape(seqlen_q: int, seqlen_k: int, masked: bool, bounded: bool, diag_offset: int) -> bool:
    """decodes_dense's conditions on the call's sizes and features: one query row, enough keys, no float mask or
    dropout, bounds (if any) aligned bottom-right."""
    return (seqlen_q == 1 and seqlen_k >= max(DENSE_DECODING_MIN_KEYS, 1) and not masked
            and (not bounded or diag_offset == seqlen_k - seqlen_q))


# (device, batch, keys) -> an int32 (batch,) tensor of `keys`: the lengths of a dense decoding step's full cache,
# made once (a decoding loop's steps with the same number of keys share it; it is never written). One made while a
# CUDA graph is being captured is not kept: its fill runs only when the graph is replayed.
_full_lengths: dict = {}
_FULL_LENGTHS_LIMIT = 256


def forward_dense_decoding(launcher, cc, q, k, v, params: AttentionParams):
    """(out, lse) of a dense call that decodes_dense: k and v read in place as a contiguous cache every sequence of
    which holds all Nk keys."""
    key = (q.device, q.shape[0], k.shape[2])
    lengths = _full_lengths.get(key)
    if lengths is None:
        lengths = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            put_bounded(_full_lengths, key, lengths, _FULL_LENGTHS_LIMIT)
    return forward_kvcache(launcher, cc, q, KVCache(k, v, lengths), params)


# ---- forward_varlen / backward_varlen -----------------------------------------------------------------------------


def _varlen_key(kind, launcher, cc, tensors, packing: Packing, params: AttentionParams, extra=()) -> tuple:
    return (kind, launcher, cc, tensors[0].device, tensors[0].dtype, packing.batch, packing.max_seqlen_q,
            packing.max_seqlen_k, ops._params_signature(params)) + tuple(
        (t.shape, t.stride(), t.data_ptr() & 15) for t in tensors) + tuple(extra)


def _seed_slots(params: AttentionParams, slots: dict) -> dict:
    """The slots _feature_args reads: no mask; the seed (varlen dropout) where there is dropout."""
    return dict(slots, mask=_NULL, seed=slots["seed"] if params.dropout_p > 0 else _NULL)


_VARLEN_FWD = dict(_FWD, seed=slot(len(FWD_POINTERS)))  # the seed tensor's pointer follows FWD_POINTERS
_VARLEN_BWD = dict(_BWD, seed=slot(len(BWD_POINTERS)))


def forward_varlen(launcher, cc, q, k, v, packing: Packing, params: AttentionParams):
    """(out (total_q, Hq, Dv), lse (Hq, total_q) float32) of packed sequences (Backend.forward_varlen)."""
    device = q.device
    total_q, heads_q, _ = q.shape
    out = _empty((total_q, heads_q, v.shape[-1]), q.dtype, device)
    lse = _empty((heads_q, total_q), torch.float32, device)
    if total_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no sequence has a key: every row sees none
        return out.zero_(), lse.fill_(float("-inf"))
    key = _varlen_key("varlen_fwd", launcher, cc, (q, k, v), packing, params)
    plan = _plans.get(key)
    if plan is None or plan[1] != _fwd_tiles(plan[0]):
        plan = _plans.put(key, _varlen_forward_plan(launcher, cc, device, q, k, v, out, lse, packing, params))
    seed = ops._seed(params, device)
    plan[2]((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
             packing.cu_seqlens_q.data_ptr(), packing.cu_seqlens_k.data_ptr(), 0, 0, 0,
             0 if seed is None else seed.data_ptr()))
    return out, lse


def _varlen_forward_plan(launcher, cc, device, q, k, v, out, lse, packing: Packing, params) -> tuple:
    strides = _packed_strides(q) + _packed_strides(k) + _packed_strides(v) + _packed_strides(out)
    slots = _seed_slots(params, _VARLEN_FWD)
    features = _features(params, q.shape[-1], v.shape[-1], (q, k, v))
    d, launch = _forward_launch(launcher, cc, device, q, k, v, params, features, "varlen", packing.batch,
                                q.shape[1], k.shape[1], packing.max_seqlen_q, packing.max_seqlen_k, strides,
                                _sequence_args(slots, packed_stride=lse.stride(0)), slots)
    return d, _fwd_tiles(d), launch


def vector_length(total_q: int, batch: int) -> int:
    """Rows of each head's lse_log2 / delta vector for ``batch`` packed sequences of ``total_q`` queries: every
    sequence's stretch (see VECTOR_GAP) fits, and each head's vector starts 16-byte aligned."""
    return cdiv(total_q + batch * VECTOR_GAP + 4, 4) * 4


def backward_varlen(launcher, cc, grad_out, q, k, v, out, lse, packing: Packing, params: AttentionParams,
                    grad_lse=None):
    """(dq, dk, dv) of forward_varlen, shaped like q, k, v (Backend.backward_varlen)."""
    device = q.device
    dq, dk, dv = (_empty(t.shape, t.dtype, device) for t in (q, k, v))
    if q.shape[0] == 0 or k.shape[0] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.to(torch.float32).contiguous()
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    key = _varlen_key("varlen_bwd", launcher, cc, (q, k, v, out, grad_out), packing, params,
                      (grad_lse is not None,))
    plan = _plans.get(key)
    if plan is None or plan[1] != ops._backward_tiles(plan[0]):
        plan = _plans.put(key, _varlen_backward_plan(launcher, cc, device, grad_out, q, k, v, out, dq, dk, dv,
                                                     packing, params, grad_lse is not None))
    vectors = plan[2]
    lse_log2 = _empty(vectors, torch.float32, device)  # poisoned in tests: every row a kernel reads is written
    delta = _empty(vectors, torch.float32, device)
    seed = ops._seed(params, device)
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(),
                0 if grad_lse is None else grad_lse.data_ptr(), lse_log2.data_ptr(), delta.data_ptr(),
                dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), packing.cu_seqlens_q.data_ptr(),
                packing.cu_seqlens_k.data_ptr(), 0 if seed is None else seed.data_ptr())
    for launch in plan[3]:
        launch(pointers)
    return dq, dk, dv


def _varlen_backward_plan(launcher, cc, device, grad_out, q, k, v, out, dq, dk, dv, packing: Packing, params,
                          has_grad_lse: bool) -> tuple:
    """(head-dim bucket, its tile-table entries, the vectors' shape, the launches: preprocess, dK/dV, dQ)."""
    total_q, heads_q, head_dim = q.shape
    heads_kv, head_dim_v = k.shape[1], v.shape[-1]
    batch, max_q, max_k = packing.batch, packing.max_seqlen_q, packing.max_seqlen_k
    features = _features(params, head_dim, head_dim_v, (q, k, v, out, grad_out))
    d = variants.head_dim_bucket(max(head_dim, head_dim_v))
    tiles = ops._backward_tiles(d)
    pre, dkdv_variants, dq_variant = _bwd_choice(cc, q.dtype, d, ops.level_of(params, features), features, *tiles)
    vec_len = vector_length(total_q, batch)
    p = _seed_slots(params, _VARLEN_BWD)
    sequence_args = _sequence_args(p, packed_stride=total_q)  # lse and grad_lse (Hq, total_q), contiguous
    launches = []

    args = [p["out"], p["grad_out"], p["lse"], p["grad_lse"] if has_grad_lse else _NULL, p["lse_log2"], p["delta"]]
    args += _packed_strides(out) + _packed_strides(grad_out)
    args += [i32(heads_q), i32(max_q), i32(vec_len), i32(head_dim_v), i64(0)] + sequence_args
    grid = (cdiv(cdiv(max_q, VECTOR_PAD) * VECTOR_PAD, variants.PREPROCESS_WARPS), heads_q, batch)
    launches.append(_prepared(launcher, pre, grid, args, device, cc))

    shape_args = [i32(max_q), i32(vec_len), i32(max_k), i32(heads_q), i32(heads_q // heads_kv), i32(head_dim),
                  f32(params.scale * LOG2E), f32(params.scale)]
    tail = shape_args + _feature_args(params, p) + _extra_args(params, head_dim_v, p) + sequence_args
    for variant in dkdv_variants:
        args = [p["q"], p["k"], p["v"], p["grad_out"], p["lse_log2"], p["delta"], p["dk"], p["dv"], _NULL]
        args += (_packed_strides(q) + _packed_strides(k) + _packed_strides(v) + _packed_strides(grad_out)
                 + _packed_strides(dk) + _packed_strides(dv))
        grid = (cdiv(max_k, variant.define("BLOCK_N")), heads_kv, batch)
        launches.append(_prepared(launcher, variant, grid, args + tail, device, cc))
    args = [p["q"], p["k"], p["v"], p["grad_out"], p["lse_log2"], p["delta"], p["dq"]]
    args += (_packed_strides(q) + _packed_strides(k) + _packed_strides(v) + _packed_strides(grad_out)
             + _packed_strides(dq))
    grid = (cdiv(max_q, dq_variant.define("BLOCK_M")), heads_q, batch)
    launches.append(_prepared(launcher, dq_variant, grid, args + tail, device, cc))
    return d, tiles, (heads_q, vec_len), tuple(launches)
