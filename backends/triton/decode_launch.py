"""Host side of the split-KV decoding kernels (decode.py): when they run, how many splits, the launches.

Used by ``TritonBackend.forward_kvcache`` (contiguous and paged caches, any Nq) and by
``TritonBackend.forward`` for dense attention with few query rows per key/value head (decoding steps
through ``mhattn.attention``). The kernel module is imported on first use, like the others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from mhattn.backends.base import AttentionParams, KVCache, cache_capacity, new_rows_contiguous
from mhattn.backends.splits import split_count
from mhattn.backends.streams import current_stream
from mhattn.backends.triton import configs, key_padding, scores
from mhattn.caches import put_bounded

# mhattn.attention takes this path when Hq / Hkv * Nq (the rows one key/value head serves) is at most this.
DECODE_MAX_ROWS = 16
# Rows of one program's tile; more packed rows (e.g. a chunk of a prompt over a cache) take more programs.
MAX_BLOCK_M = 64
# A split gets at least this many keys: fewer would spend more on the combine than they save. 128 (256 before):
# replayed from a CUDA graph on the H100 (Hq 32, Hkv 8, d 128, Nq 1), B = 1 with 1k / 2k / 8k keys took 7.8 / 8.3 /
# 14.1 -> 6.1 / 7.8 / 12.8 us and B = 8 with 1k 13.9 -> 13.2, level at B = 8 with 2k and B = 1 with 32k (NOTES).
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 128
# Programs per SM to aim for when splitting (memory-bound work wants several in flight per SM).
PROGRAMS_PER_SM = 2
# On sm_90 the combine kernel is a programmatic dependent launch of the split kernel (decode.py): its launch overlaps
# the splits. False launches it after them, as on older GPUs (kept for the A/B in benchmarks/check_inference.py).
DEPENDENT_LAUNCH = True


@dataclass(frozen=True)
class DecodeTile:
    block_n: int
    num_warps: int
    num_stages: int


# Keys per step on GPUs by the wider padded head dim (of K and of V) of 16-bit inputs, for a paged cache; decode_tile
# scales wider elements and dims past the table down. Only d = 128 is swept (benchmarks/check_inference.py
# --sweep-tiles, H100, bf16, Nq = 1, B 1-64, 8k-128k keys): there three stages suit the paged cache's gathered rows
# (two lost up to 16% at B = 64), and two stages a contiguous cache (3-6% faster than three at B = 8 and 64,
# level at B = 1), so CONTIGUOUS_TILES differs there.
GPU_TILES = {16: DecodeTile(128, 4, 3), 32: DecodeTile(128, 4, 3), 64: DecodeTile(128, 4, 3),
             128: DecodeTile(64, 4, 3), 256: DecodeTile(32, 4, 2)}
CONTIGUOUS_TILES = {**GPU_TILES, 128: DecodeTile(64, 4, 2)}
# Beyond the table (float32 at d = 256: 512 bytes-equivalent of 16-bit columns): the K and V stages stay near 64 KiB.
WIDEST_TILE = DecodeTile(16, 4, 2)
# Split grids (each sequence's keys shared by several programs, so each program streams a long run of them) on a
# Hopper GPU with HBM3e (split_and_tile: the H200) take 128 keys a step over two stages at d = 128, contiguous and paged
# cache alike: 128 KiB of K and V stages by the count the tables above keep within 96 KiB (for GPUs with 99 KiB a
# block), within Hopper's 227 KiB. Swept on the H200 (--sweep-tiles, bf16, Nq = 1): B = 1 with 128k keys 149 -> 139
# us contiguous and 156 -> 139 paged; B = 8 with 32k and 128k keys 266 -> 266 and 993 -> 1008 contiguous, 272 -> 263
# and 1028 -> 987 paged. Unsplit grids (B = 64) keep the tables: 128-key steps there took 480 -> 551 us with 8k keys.
# On the H100 the same tile was level at B = 1 and 2-3.5% slower at B = 8 (NOTES.md, the d = 128 tile sweep), so the
# H100 keeps the tables.
HOPPER_SPLIT_TILES = {128: DecodeTile(128, 4, 2)}
# A Hopper GPU with more memory than this has HBM3e (H200 141 GB at 4.8 TB/s; the H100's 80-94 GB are HBM3 at 3.35-3.9
# TB/s): the split-KV kernel's bandwidth-bound steps were swept on such a GPU with their own tile and split count.
HBM3E_MIN_MEMORY = 100 << 30


def decode_tile(block_d: int, block_dv: int, element_size: int, paged: bool = False,
                hopper_split: bool = False) -> DecodeTile:
    """The split-KV kernel's tile for padded head dims block_d (K) and block_dv (V) of ``element_size``-byte
    inputs, over a paged cache or not: the table's entry for the wider of the two, counted in 16-bit columns (so
    that float32 at d = 16 with a value head dim of 256 does not ask for 288 KB of shared memory). Padded dims are
    powers of two from 16, so a width the table lacks is wider than its widest. ``hopper_split``: a split grid on a
    Hopper GPU with HBM3e (split_and_tile), which takes HOPPER_SPLIT_TILES' entry where it has one."""
    width = max(block_d, block_dv) * element_size // 2
    if hopper_split and width in HOPPER_SPLIT_TILES:
        return HOPPER_SPLIT_TILES[width]
    return (GPU_TILES if paged else CONTIGUOUS_TILES).get(width, WIDEST_TILE)


# The interpreter: small steps and small splits so that tiny test shapes take several of each.
INTERPRETER_TILE = DecodeTile(16, 4, 1)
INTERPRETER_MIN_KEYS_PER_SPLIT = 16
INTERPRETER_SM_COUNT = 16


def eligible(q: torch.Tensor, k: torch.Tensor, params: AttentionParams) -> bool:
    """Whether mhattn.attention's forward runs on the split-KV kernels: few rows per key/value head, no dropout, and
    no attn_mask or one without a gradient to give (mask_kind)."""
    rows = q.shape[2] * (q.shape[1] // k.shape[1])
    return (0 < rows <= DECODE_MAX_ROWS and params.dropout_p == 0.0
            and (params.mask is None or mask_kind(params) != 0))


def mask_kind(params: AttentionParams) -> int:
    """The split kernel's MASK_KIND for the call's attn_mask, one with no gradient to give: scores.MASK_KEYS for a
    boolean mask and scores.MASK_KEYS_FLOAT for a float one that varies over neither the heads nor the query rows (a
    padding mask of a batch of decoding steps, (B, 1, 1, Nk)), else MASK_BOOL or MASK_FLOAT (a speculative step's
    (B, 1, Nq, Nk) mask, a per-head bias (B or 1, Hq, Nq, Nk): the split kernel's rows are the query heads of a
    key/value head, each reading its own head's entries); 0 for none, or for a mask with a gradient (the split kernel
    does not take it)."""
    mask = params.mask
    if mask is None or params.mask_requires_grad:
        return 0
    boolean = mask.dtype == torch.bool
    if key_padding.shared_by_heads_and_rows(mask):
        return scores.MASK_KEYS if boolean else scores.MASK_KEYS_FLOAT
    return scores.MASK_BOOL if boolean else scores.MASK_FLOAT


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(programs: int, keys: int, sm_count: int, min_keys: int = MIN_KEYS_PER_SPLIT,
               within: bool = False) -> int:
    """How many programs share the keys of one (batch, key/value head, row block): enough to put
    PROGRAMS_PER_SM programs on every SM, each with at least ``min_keys`` keys (backends/splits.py). One when the
    unsplit grid already fills the GPU. ``within``: no more than PROGRAMS_PER_SM programs an SM."""
    return split_count(programs, keys, sm_count, min_keys, PROGRAMS_PER_SM, MAX_SPLITS, within)


def split_and_tile(device: torch.device, programs: int, keys: int, block_d: int, block_dv: int, element_size: int,
                   paged: bool) -> tuple:
    """(splits, tile) of a split-KV grid of ``programs`` (batch x key/value heads x row blocks) over ``keys`` keys
    (a cache's capacity) on ``device``. On a Hopper GPU with HBM3e (hbm3e_hopper) a split grid takes
    HOPPER_SPLIT_TILES' tile and as many splits as keep it within PROGRAMS_PER_SM programs an SM: swept on the H200
    with that tile (--sweep-splits, bf16, Nq = 1, contiguous cache), B = 8 (64 programs) with 32k and 128k keys took
    272 / 1024 us in 5 splits (rounded up: 320 programs), 258 / 963 in 4 (256 programs), 265 / 975 in 6; B = 1 (8
    programs) keeps 33 (141 us with 128k keys)."""
    if device.type != "cuda":  # Triton's interpreter
        return num_splits(programs, keys, INTERPRETER_SM_COUNT, INTERPRETER_MIN_KEYS_PER_SPLIT), INTERPRETER_TILE
    index = device.index if device.index is not None else torch.cuda.current_device()
    fast_memory = hbm3e_hopper(index)
    splits = num_splits(programs, keys, _sm_count(index), within=fast_memory)
    return splits, decode_tile(block_d, block_dv, element_size, paged, hopper_split=fast_memory and splits > 1)


@functools.lru_cache(maxsize=16)
def hbm3e_hopper(device_index: int) -> bool:
    """Whether GPU ``device_index`` is a Hopper GPU with HBM3e (HBM3E_MIN_MEMORY), which takes the split-KV tile and
    split count swept on the H200."""
    properties = torch.cuda.get_device_properties(device_index)
    return properties.major == 9 and properties.total_memory > HBM3E_MIN_MEMORY


# (plan, device, keys, paged) -> (tile, splits, block_m, row_blocks): the same for every step of a decoding loop.
_split_plans: dict = {}
_SPLIT_PLANS_LIMIT = 1024


def _split_plan(plan, device: torch.device, keys: int, paged: bool) -> tuple:
    """The tile, the number of splits and the row blocking of a call (``plan``: the backend's cached plan of
    its shapes, so a repeated call looks this up instead of working it out)."""
    key = (plan, device, keys, paged)
    found = _split_plans.get(key)
    if found is None:
        rows = plan.kv_group * plan.seqlen_q
        block_m = max(16, configs.triton_next_power_of_2(min(rows, MAX_BLOCK_M)))
        row_blocks = -(-rows // block_m)
        programs = plan.batch * plan.heads_kv * row_blocks
        splits, tile = split_and_tile(device, programs, keys, plan.block_d, plan.block_dv, plan.dtype.itemsize, paged)
        found = put_bounded(_split_plans, key, (tile, splits, block_m, row_blocks), _SPLIT_PLANS_LIMIT)
    return found


def split_kv_forward(q, k, v, params: AttentionParams, cache: Optional[KVCache] = None, signature=None,
                     keep_lse: bool = True, new_kv: Optional[tuple] = None):
    """out (B, Hq, Nq, Dv) and lse (B, Hq, Nq) fp32 of q over k, v (see _split_kv_launches)."""
    return _split_kv_launches(q, k, v, params, cache, signature, keep_lse, new_kv, False)[:2]


def _split_kv_launches(q, k, v, params: AttentionParams, cache: Optional[KVCache] = None, signature=None,
                       keep_lse: bool = True, new_kv: Optional[tuple] = None, keep: bool = True):
    """(out, lse, launches): out (B, Hq, Nq, Dv) and lse (B, Hq, Nq) fp32 of q over k, v, and with ``keep`` the
    _KeptLaunches that ran them (None where nothing was launched, or without ``keep``).

    Dense (cache None): k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), diagonal at params.diag_offset. With a
    cache, k and v are its tensors (contiguous or the paged pool) and each sequence b attends over its
    first cache.seqlens[b] keys with its diagonal at seqlens[b] - Nq. ``signature``: the backend's _Signature
    of these arguments when the caller has it already. keep_lse False: lse is the plan's scratch view (for a caller
    that drops it: one allocation fewer). ``new_kv`` (with a cache): the step's new keys and values (k_new
    (B, Hkv, Nq, D), v_new (B, Hkv, Nq, Dv), last dims contiguous), which the split kernel writes into the cache at
    positions cache.seqlens[b] + i before attending over cache.seqlens[b] + Nq keys (its APPEND): cache.seqlens
    then counts the keys before the step.
    """
    backend = _backend or _import_backend()
    signature = signature or backend._signature_for(q, k, v, params, dense=False)
    plan = signature.plan
    out, lse = plan.output_buffers(q, keep_lse)
    rows = plan.batch * plan.heads_q * plan.seqlen_q
    if rows == 0:  # out and lse are empty
        return out, lse, None

    paged = cache is not None and cache.paged
    keys = k.shape[2] if cache is None else cache.capacity
    if plan.cuda_index is None and not backend.INTERPRET:
        raise ValueError("triton backend: CPU tensors need TRITON_INTERPRET=1 (set before import)")
    tile, splits, block_m, row_blocks = _split_plan(plan, q.device, keys, paged)
    dependent = splits > 1 and DEPENDENT_LAUNCH and _dependent_launch_ok(plan)

    out_split, lse_split = _partials(q, plan, lse, rows, splits)
    seqlens = cache.seqlens if cache is not None else None
    table = cache.block_table if paged else None
    table_strides = table.stride() if paged else (0, 0)
    seqlens_stride = seqlens.stride(0) if cache is not None else 0
    new_k, new_v = new_kv if new_kv is not None else (None, None)
    # What the append adds to the launch: the new rows' strides, the cache's capacity and the pool's size.
    appending = () if new_kv is None else (*new_k.stride()[:3], *new_v.stride()[:3], keys, k.shape[0])
    kernel = backend.launchers()
    split_kv, combine = kernel.split_kv, kernel.combine_splits
    mask = params.mask if cache is None else None
    # The mask's batch, head, query row and key strides (0 along a broadcast dim; the signature fixes them)
    mask_strides = (0, 0, 0, 0) if mask is None else tuple(backend._mask_strides(mask))

    # The launches are prepared once per signature and what the signature does not fix (the cache's capacity and
    # block table stride): a repeated decoding step only passes its tensors (launcher.PreparedLaunch).
    def prepare_split_kv():
        run = backend._Launch(q, k, v, params, signature=signature)  # the signature's scalars
        return (plan.batch * plan.heads_kv, splits, row_blocks), (
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *table_strides, seqlens_stride,
            *(appending or (0, 0, 0, 0, 0, 0, 0, 0)), *mask_strides,
            plan.heads_q, plan.heads_kv, plan.kv_group, plan.seqlen_q, k.shape[2], splits,
            run.qk_scale2, run.softcap_in2, run.softcap_out2,
            run.diag_offset, run.window_left, run.window_right,
        ), split_kv.cached_constexprs(
            tile.num_warps, tile.num_stages,
            HEAD_DIM=plan.head_dim, HEAD_DIM_V=plan.head_dim_v, BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv,
            BLOCK_M=block_m, BLOCK_N=tile.block_n,
            HAS_SEQLENS=cache is not None, PAGED=paged, PAGE_SIZE=k.shape[2] if paged else 1,
            HAS_LEFT=plan.has_left, HAS_RIGHT=plan.has_right, HAS_SOFTCAP=plan.has_softcap,
            SPLIT=splits > 1, DOT_PRECISION=plan.dot_precision, RELEASE_DEPENDENTS=dependent,
            APPEND=new_kv is not None, MASK_KIND=mask_kind(params),
        )

    def prepare_combine():
        return (rows,), (*out.stride()[:3], plan.heads_q, plan.seqlen_q, splits), \
            combine.cached_constexprs(combine_warps(plan.block_dv), 1, {"launch_pdl": True} if dependent else None,
                                      HEAD_DIM_V=plan.head_dim_v, BLOCK_DV=plan.block_dv,
                                      BLOCK_S=max(2, configs.triton_next_power_of_2(splits)), WAIT_PRIMARY=dependent)

    with backend._OnDevice(q.device):
        split_site = backend._launch_site(signature, (split_kv, keys, cache is not None, paged, table_strides,
                                                      seqlens_stride, dependent, appending), split_kv,
                                          _split_tensors(q, k, v, out, lse, out_split, lse_split, seqlens, table,
                                                         new_k, new_v, mask), (),
                                          prepare_split_kv)
        combine_site = None
        if splits > 1:
            combine_site = backend._launch_site(signature, (combine, keys, dependent), combine,
                                                (out, lse, out_split, lse_split), (), prepare_combine)
    return out, lse, _KeptLaunches(plan, rows, splits, split_site, combine_site) if keep else None


def _partials(q, plan, lse, rows: int, splits: int) -> tuple:
    """(out_split, lse_split) of a launch: the stream's kept partials (split_partials) when the keys are split, else
    lse twice (the kernel writes its output directly; the arguments only hold their places)."""
    if splits > 1:
        return split_partials(q.device, plan.device_index, rows, splits, plan.head_dim_v)
    return lse, lse


def _split_tensors(q, k, v, out, lse, out_split, lse_split, seqlens, table, new_k, new_v, mask=None) -> tuple:
    """split_kv_kernel's leading tensor arguments in its order; lse holds the place of the key counts, the block table,
    the new rows and the mask where a call has none (the kernel does not read them then)."""
    return (q, k, v, out, lse, out_split, lse_split, lse if seqlens is None else seqlens,
            lse if table is None else table, lse if new_k is None else new_k, lse if new_v is None else new_v,
            lse if mask is None else mask)


class _KeptLaunches(NamedTuple):
    """The launches of one split-KV call, kept by a step prepared for calls like it (PreparedSplitStep): the plan,
    the rows, the split count, and the split kernel's and the combine's launch sites (backend._launch_site: the
    prepared launch and the arguments between its tensors and the end; no combine site with one split)."""
    plan: object
    rows: int
    splits: int
    split_site: tuple
    combine_site: Optional[tuple]


class PreparedSplitStep:
    """A split-KV step prepared for calls of one signature: a KV cache's (Backend.kvcache_call; ``cache`` True) or
    a dense decoding step's that autograd does not track (TritonBackend.native_call; ``cache`` False, through
    :meth:`output`). Every shape, stride, dtype and flag of its arguments is the first call's (the front ends' memo
    keys hold them all), so the first call's split plan, grid and launch arguments hold for every later call, which
    passes only its tensors to the launches the first one prepared. Called as ``step(q, k_cache, v_cache, k, v,
    cache_seqlens, block_table[, mask])`` -> (out, lse); k and v None for a step that appends nothing; mask: a dense
    step's mask (mask_kind), whose layout the signature fixes. ``signature``: the
    backend's _Signature of q and the cache, or None to work it out at the first call. float32 inputs' dot precision
    follows torch's matmul setting, read at every call (the prepared launches are dropped when it changes)."""

    __slots__ = ("params", "signature", "keep_lse", "appends", "cache", "kept")

    def __init__(self, params: AttentionParams, signature, keep_lse: bool, appends: bool, cache: bool = True):
        self.params, self.signature, self.keep_lse, self.appends, self.cache = (params, signature, keep_lse, appends,
                                                                                cache)
        self.kept: Optional[_KeptLaunches] = None

    def output(self, q, k, v, params: AttentionParams):
        """A dense step's output (no cache): what TritonBackend.native_call hands the front end."""
        return self(q, k, v, None, None, None, None, params.mask)[0]

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, mask=None):
        kept = self.kept
        if kept is not None and q.dtype == torch.float32 and (
                _backend._dot_precision(q.dtype) != kept.plan.dot_precision):
            kept = self.kept = self.signature = None  # torch's matmul setting changed: another plan
        if kept is None:  # the first call (or one whose rows were all empty): every step, keeping its launches
            backend = _backend or _import_backend()
            signature = self.signature = self.signature or backend._signature_for(q, k_cache, v_cache, self.params,
                                                                                  dense=True)
            cache = KVCache(k_cache, v_cache, cache_seqlens, block_table) if self.cache else None
            params = self.params if mask is None else self.params.replace(mask=mask)  # (this call's mask)
            out, lse, self.kept = _split_kv_launches(q, k_cache, v_cache, params, cache=cache,
                                                     signature=signature, keep_lse=self.keep_lse,
                                                     new_kv=(k, v) if self.appends else None)
            return out, lse
        plan = kept.plan
        out, lse = plan.output_buffers(q, self.keep_lse)
        out_split, lse_split = _partials(q, plan, lse, kept.rows, kept.splits)
        prepared, middle = kept.split_site
        on_device = _backend._on_device
        on_device(plan.cuda_index, prepared.launch,
                  _split_tensors(q, k_cache, v_cache, out, lse, out_split, lse_split, cache_seqlens, block_table, k,
                                 v, mask) + middle)
        if kept.combine_site is not None:
            prepared, middle = kept.combine_site
            on_device(plan.cuda_index, prepared.launch, (out, lse, out_split, lse_split) + middle)
        return out, lse


# The KV cache's prepared append launches (decode.append_kv_kernel) by what their arguments besides the tensors come
# from: the shapes and strides of the new and cached keys and values, of cache_seqlens and of the block table, the
# dtype and the device. A decoding loop appends with one such signature per layer.
_append_sites: dict = {}
APPEND_SITES_LIMIT = 1024
# Rows of the new keys one append program writes (a decoding step has one; speculative decoding a few).
APPEND_BLOCK_M = 16


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table) -> Optional[torch.Tensor]:
    """A decoding step's append (decode.append_kv_kernel) in one launch: k (B, Hkv, Nq, D) and v (B, Hkv, Nq, Dv)
    written into the cache (contiguous, or paged through ``block_table``) at positions cache_seqlens[b] + i, in place;
    returns the key counts after it, cache_seqlens + Nq (B,) int32. Where torch's indexing does it instead, a step
    launches five to ten kernels (positions, block look-ups, one index_put for K and one for V). None where the kernel
    does not take the call (a new key or value whose head dim is not contiguous; CPU tensors without Triton's
    interpreter): the caller appends with torch's indexing. The caller has checked the shapes, dtypes and devices,
    and the positions and blocks against the cache (mhattn.decode)."""
    backend = _backend or _import_backend()
    if not new_rows_contiguous(k, v):
        return None
    device = k.device
    if device.type != "cuda" and not backend.INTERPRET:
        return None
    paged = block_table is not None
    key = (k.shape, k.stride(), v.shape, v.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
           cache_seqlens.stride(), None if block_table is None else (block_table.shape, block_table.stride()), k.dtype,
           device)
    batch, heads_kv, seqlen_q, head_dim = k.shape
    if batch * heads_kv * seqlen_q == 0:  # nothing to write (no program would write the counts either)
        return cache_seqlens + seqlen_q
    seqlens = torch.empty(batch, dtype=torch.int32, device=device)
    table = block_table if paged else cache_seqlens
    tensors = (k, v, k_cache, v_cache, cache_seqlens, seqlens, table)
    site = _append_sites.get(key)
    if site is None:
        head_dim_v = v.shape[3]
        launcher = backend.launchers().append_kv
        middle = (*k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
                  cache_seqlens.stride(0), *(block_table.stride() if paged else (0, 0)), heads_kv, seqlen_q,
                  cache_capacity(k_cache, block_table), k_cache.shape[0])
        constexprs = launcher.cached_constexprs(
            append_warps(head_dim, head_dim_v), 1, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
            BLOCK_D=configs.padded_head_dim(head_dim), BLOCK_DV=configs.padded_head_dim(head_dim_v),
            BLOCK_M=APPEND_BLOCK_M, PAGED=paged, PAGE_SIZE=k_cache.shape[2] if paged else 1)
        grid = (batch * heads_kv, -(-seqlen_q // APPEND_BLOCK_M))
        device_index = device.index if device.type == "cuda" else 0
        site = put_bounded(_append_sites, key, (launcher.prepare(grid, tensors + middle, constexprs, device_index),
                                                middle), APPEND_SITES_LIMIT)
    prepared, middle = site
    with backend._OnDevice(device):
        prepared.launch(tensors + middle)
    return seqlens


# The split kernel's partial outputs and lse by (device, stream, rows, splits, value head dim), kept: one stream's
# launches run in order, so a step's combine has read them before the next step's split kernel writes them, and a
# decoding loop makes them once instead of allocating two tensors a step. A call being captured into a CUDA graph gets
# its own (a graph may be replayed on another stream while this one's calls use theirs). Bounded: past this many the
# oldest goes (freed while a launch on its stream may still read it, its memory is reused only by that stream's
# later work).
_split_partials: dict = {}
SPLIT_PARTIALS_LIMIT = 64


def split_partials(device: torch.device, device_index: int, rows: int, splits: int, head_dim_v: int) -> tuple:
    """(out_split (rows, splits, Dv), lse_split (rows, splits)) float32 for a split launch on the current stream (see
    _split_partials); their contents are whatever the last launch on the stream left."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _new_split_partials(device, rows, splits, head_dim_v)
    key = (device, current_stream(device_index) if device.type == "cuda" else 0, rows, splits, head_dim_v)
    found = _split_partials.get(key)
    if found is None:
        found = put_bounded(_split_partials, key, _new_split_partials(device, rows, splits, head_dim_v),
                            SPLIT_PARTIALS_LIMIT)
    return found


def _new_split_partials(device, rows: int, splits: int, head_dim_v: int) -> tuple:
    # Ordinary tensors even under torch.inference_mode: an inference tensor could not be written by a later call
    # outside it.
    with torch.inference_mode(False):
        return (torch.empty(rows, splits, head_dim_v, dtype=torch.float32, device=device),
                torch.empty(rows, splits, dtype=torch.float32, device=device))


def append_warps(head_dim: int, head_dim_v: int) -> int:
    """Warps of an append program (APPEND_BLOCK_M rows of K and of V) at these head dims."""
    return 4 if max(head_dim, head_dim_v) >= 128 else 2


def combine_warps(block_dv: int) -> int:
    """Warps of a combine program (one query row) at padded value head dim ``block_dv``."""
    return 4 if block_dv >= 128 else 2


def _dependent_launch_ok(plan) -> bool:
    """Whether this plan's launches can be programmatic dependent ones: an sm_90 GPU (plan.sm90 is False under
    Triton's interpreter) and a Triton that has the instructions."""
    return plan.sm90 and _triton_has_dependent_launch()


@functools.lru_cache(maxsize=1)
def _triton_has_dependent_launch() -> bool:
    from mhattn.backends.triton import decode

    return decode.gdc_wait is not None


_backend = None


def _import_backend():
    """The backend module (backend.py), imported at the first call: it imports this module."""
    global _backend
    from mhattn.backends.triton import backend

    _backend = backend
    return backend
