"""When the Triton backend runs the Hopper kernels (hopper_forward.py, hopper_backward.py), and their launches.

The Hopper kernel covers the dense training shapes: sm_90, fp16/bf16, head dims 64/96/128/192/256 (96 and 192 in the
128- and 256-wide tiles: TILE_WIDTH) with equal value head dim, a softcap or none, a causal mask of either alignment or
none, a sliding window's left bound (its right bound the causal diagonal, or none), no mask or a key-padding mask
that is one run of keys per sequence (right or left padding: taken as each sequence's first key and key count, the
mask itself unread: key_padding.padding_kind, NOT_KEY_LENGTHS), dropout with the shared RNG, a positive scale,
16-byte aligned rows (and no broadcast batch or head). It pays once each program has enough key blocks to amortise
its start (the first copies) and its output write; below MIN_KEYS (fewer where the query tiles fill the GPU:
FULL_GRID_MIN_KEYS) the FlashAttention-2 kernel (forward.py) is faster (backends/triton/NOTES.md, versions 5, 8 and 11
on the H100, "Short forward tiles" on the H200). Everything else runs forward.py.

The Hopper backward covers the same problems (from BACKWARD_MIN_KEYS keys); a deterministic backward runs its build that
adds dQ's shares in a fixed order (hopper_backward.dq_turn), from DETERMINISTIC_MIN_KEYS keys. backward.py's kernels run
the rest.

Both kernels read their tiles through host tensor maps (:func:`tensor_map`, 4-D over batch, head, row and column).
A call signature's first launch prepares a site with its maps' geometry (launcher.PreparedMapLaunch: the forward's
ForwardLaunch, the one-launch backward's site); later calls pass their tensors, and each map is encoded once per
address.

``MHATTN_TRITON_HOPPER=0`` turns the Hopper kernels off (the FlashAttention-2 kernels everywhere), e.g. to
compare the two; ``MHATTN_TRITON_HOPPER=always`` runs them at any key count (e.g. for a conformance run).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple, Optional

import torch

from mhattn import environment
from mhattn.backends.streams import current_stream
from mhattn.backends.triton import configs, key_padding, scores
from mhattn.backends.triton.decode_launch import _sm_count
from mhattn.backends.triton.launcher import CompiledLauncher
from mhattn.caches import put_bounded

# Head dim -> the kernels' tile width: the tables below are keyed by it. Gluon's tiles are a power of two wide, so head
# dims 96 and 192 run the 128- and 256-wide kernels: the copy engine zero-fills a tile's columns past the tensor's
# last one (Q's and K's zeros add nothing to Q K^T, V's give output columns that are never written) and clips the
# stores of the output and the gradients (HEAD_COLS in the kernels: the stores made by threads mask those columns).
# The padded products cost 128/96 = 256/192 = 4/3 of the work the head dim needs.
TILE_WIDTH = {64: 64, 96: 128, 128: 128, 192: 256, 256: 256}
# Head dims whose forward products skip the zero fill: the 192 columns of a 256-wide tile as two products, 128 and 64
# wide (hopper_forward.output_parts, SPLIT_PRODUCTS), 3/4 of the padded products' work. The same in the backward
# (hopper_backward.wide_compute_partition; NOTES version 30); at d = 96 the backward's S^T and dP^T only (64 + 32
# columns: narrow_compute_partition, version 31), and not the forward (its 32-column P V product, version 28).
FORWARD_SPLIT_HEAD_DIMS = (192, )
BACKWARD_SPLIT_HEAD_DIMS = (96, 192)
# Tile width -> key block: the largest whose K/V ring, both Q tiles and the register budget fit.
KEY_BLOCK = {64: 128, 128: 128, 256: 64}
QUERY_ROWS_PER_CONSUMER = 64   # one wgmma row block per consumer warpgroup
# Head dim -> K/V ring slots of the forward (two fill shared memory at d = 128 and 256).
FORWARD_STAGES = {64: 2, 128: 2, 256: 2}
# Head dim -> whether the forward runs a tile's unmasked key blocks and its masked ones (the causal diagonal, a partial
# last block) as two loops (hopper_forward.consume_tile): over one loop that checks each block, +1-8% at d = 128 up to
# 4k keys and +2-7% at d = 256 (level at 1k without a mask), but 2-6% slower at d = 64 causal (NOTES version 18).
FORWARD_SPLIT_MASKED = {64: False, 128: True, 256: True}
# Head dim -> Q buffers of the forward: two where shared memory has room (d = 64: 48 + 64 KB; d = 128: 64 + 128 KB of
# Q and the K/V ring), so the next tile's Q loads during this one and this one's output is staged in its Q slot for
# the copy engine (hopper_forward.consume_tile); one at d = 256 (its Q and ring take 192 KB).
Q_BUFFERS = {64: 2, 128: 2, 256: 1}
# Head dim -> the most keys at which a one-buffer forward takes three Q slots in turn (hopper_forward.q_slot,
# Q_ROTATING): d = 256's Q and ring leave room for a third consumer tile (96 + 128 KB), so the lower consumer's next Q
# loads during this tile and starts it without waiting, and the upper consumer's output goes through the copy engine.
# NOTES version 21, H100 (three runs): +5-12% at 1k and 2k keys, +1-8% at 4k; at 16k level without a mask and 2-5%
# slower in three of four causal readings (the upper consumer starts each tile later than the lower one).
FORWARD_Q_ROTATING_MAX_KEYS = {256: 4096}
# Head dim -> the most keys at which the lower consumer of a causal tile whose diagonal starts at a key block's first
# key runs that block at half width (hopper_forward.attend_block on half its keys: its rows see only the first half;
# the kernel has it where the key block is twice a consumer's rows, d = 64 and 128). NOTES version 19, H100 bf16: at
# d = 64 +2-3% at 1k-2k keys and +1.5% at 4k, -1.5% at 16k; at d = 128 level or slower (-2% at 4k), so not there.
FORWARD_HALF_DIAGONAL_MAX_KEYS = {64: 4096}
# Head dim -> whether the forward rescales its output lazily (hopper_forward.softmax_step, LAZY_RESCALE): a row's
# maximum moves only when a block's top passes it by more than 2^8, and a consumer whose rows' maxima all stayed skips
# the HEAD_DIM / 2 multiplies a thread of the rescaling (at the cost of a vote over the warpgroup's rows).
FORWARD_LAZY_RESCALE = {64: False, 128: False, 256: True}
# Fewest keys at which the Hopper forward beats forward.py, per head dim: a key count, or a pair (without a causal mask,
# with one). H100 (NOTES version 11): at d = 64 +16% at 1k, causal or not, and ahead at every longer length; d = 256
# ahead everywhere. H200 (NOTES "Short forward tiles", bf16, CUDA-graph replay, against forward.py's short tiles): at
# d = 64 and 128 ahead from 384 keys with 32 heads or 384, causal or not, within 4% at d = 64 causal 384.
MIN_KEYS = {64: 384, 128: 384, 256: 1}
# Fewer keys where the query tiles fill the GPU: head dim -> fewest keys at which the Hopper forward runs when there are
# at least as many tiles of FORWARD_TILE_ROWS query rows as SMs. H200, d = 128: 1.2-1.5x forward.py from 128 keys with
# 256 heads (level at 128 causal), while with 32 heads forward.py's smaller tiles give more programs and 1.3x it below
# 384 keys. At d = 64 forward.py's 32-key tiles lead from 77 to 256 keys whatever the grid.
FULL_GRID_MIN_KEYS = {128: 128}
FORWARD_TILE_ROWS = 2 * QUERY_ROWS_PER_CONSUMER  # the forward's tile: two consumer warpgroups of rows
_NO_GRID_MIN_KEYS: dict = {}  # the backward's (no lower threshold where the grid fills)
# The backward: head dim -> fewest keys at which it beats backward.py's kernels. H100 (NOTES versions 8 and 13): d = 64
# +1.5-12% from 1k, d = 128 +12-18% from 2k. H200 (NOTES "Short forward tiles": forward+backward with both Hopper
# kernels less the forward): d = 64 1.0-1.15x backward.py's three kernels from 197 keys (32 and 384 heads), d = 128
# 1.03-1.15x from 128 keys; below these the short backward (one launch, up to 128 keys at d = 64) leads.
BACKWARD_MIN_KEYS = {64: 192, 128: 128, 256: 1}
# A deterministic backward (torch.use_deterministic_algorithms(True)): tile width -> fewest keys, or a pair (without a
# causal mask, with one), at which the Gluon backward's deterministic build (dQ's shares added in a fixed order,
# hopper_backward.dq_turn) beats backward.py's deterministic kernels (the dQ kernel apart). H200, bf16, B * N = 16k,
# H * d = 2048 (NOTES version 27): at d = 128 1.01-1.25x faster from 1k keys, causal or not; at d = 64 level at 2k
# without a causal mask and ahead from 4k (1.05-1.16x; 0.94x at 1k), with one ahead at 16k (1.06x; 0.80-0.91x at
# 1k-8k); at d = 256 ahead at every length without a causal mask (1.09-1.49x) and from 4k with one (0.95x at 1k, 0.98x
# at 2k).
DETERMINISTIC_MIN_KEYS = {64: (2048, 16384), 128: 128, 256: (1, 4096)}
# Keys per program: two compute warpgroups of 64 keys, except at d = 256, where dK and dV of 64 keys fill both
# warpgroups' registers (they split the columns); there Q and dO have one shared-memory slot (the float32 dQ
# chunks take the second's room).
BACKWARD_KEY_BLOCK = {64: 128, 128: 128, 256: 64}
BACKWARD_STAGES = {64: 2, 128: 2, 256: 1}
# Query rows per step. At d = 64 a step of 64 rows left each step's five short products behind its barriers and the
# dQ hand-over (0.80x-0.89x of cuDNN); 128 rows measured +16-26% (NOTES version 14) and fill shared memory (231.9 of
# 232.4 KB). d = 128 and 256 have no registers for a taller step (dK and dV take 64 or 128 a thread).
BACKWARD_QUERY_BLOCK = {64: 128, 128: 64, 256: 64}
# Query rows per step of the builds with dropout or a softcap, where they differ: at d = 64 the 128-row step spills
# with either (Triton 3.9: a stack of 312 bytes a thread with a softcap, 152 with dropout; 24 plain), the 64-row one
# does not (0) and takes 133 of the 232 KB of shared memory. H200, bf16, 4k causal: the dropout backward 3% faster
# than the 128-row one; the softcap backward 1.21x the FlashAttention-2 one (NOTES, version 32). A third Q/dO slot
# read level (softcap 1% slower, dropout 1% faster): two, as the plain build.
BACKWARD_FEATURE_QUERY_BLOCK = {64: 64}
# dK and dV written through shared memory by the copy engine (NOTES version 16: +1-7% at d = 128 and 256); at d = 64
# the kernel's loop compiled 1-5% slower with it, so there each thread stores its rows itself.
BACKWARD_STAGED_DK_DV = {64: False, 128: True, 256: True}
ENV_SWITCH = "MHATTN_TRITON_HOPPER"
# The forward's grid: persistent (one program per SM walking the tiles, the next tile's loads under this one's last
# products and output) without a causal mask up to PERSISTENT_MAX_KEYS keys, one program per tile otherwise (NOTES
# version 9: +2-14% at 1k-4k without a mask, mixed at 8k).
PERSISTENT_MAX_KEYS = 4096
# With a causal mask, persistent up to CAUSAL_PERSISTENT_MAX_KEYS keys (every key count), each program taking the next
# tile not yet taken from its stream's counter, which each launch leaves at 0 (tile_counter; NOTES version 10: +9-15%
# over one program per tile at d = 128 1k-2k, +5-7% at d = 256, +1-5% from 4k keys, with tiles from a table made on
# the host; version 17: the counter reads level with that table, and needs no host work per shape; a static
# round-robin balanced causal tiles badly, version 9).
CAUSAL_PERSISTENT_MAX_KEYS = 1 << 31
# Causal tiles go longest first across groups of heads whose K/V take about CAUSAL_GROUP_BYTES (they stay in L2
# while the group runs; hopper_forward.tile_rows); 0 orders each head's tiles alone, heaviest first.
CAUSAL_GROUP_BYTES = 16 << 20
# The head dims whose dropout forward runs the Gluon kernel: at d = 64 the FlashAttention-2 forward measured faster
# (H200, bf16, 4k causal: 1.342 against 1.530 ms; the Gluon backward still runs: NOTES, version 24).
FORWARD_DROPOUT_HEAD_DIMS = (128, 256)
DROPOUT_FORWARD = "dropout at this head dim (the FlashAttention-2 forward measured faster: FORWARD_DROPOUT_HEAD_DIMS)"
# The head dims whose softcapped calls run the Gluon kernels, forward and backward. H200, bf16, 4k causal, softcap 30
# (NOTES, version 25): the Gluon forward 1.05-1.31x the FlashAttention-2 one, the Gluon backward 1.27x at d = 128 and
# 1.83x at d = 256; at d = 64 its 128-row step spilled (0.65x), and the 64-row one (BACKWARD_FEATURE_QUERY_BLOCK) is
# 1.21x the FlashAttention-2 backward (2.35 against 2.84 ms; NOTES, version 32).
FORWARD_SOFTCAP_HEAD_DIMS = (64, 128, 256)
BACKWARD_SOFTCAP_HEAD_DIMS = (64, 128, 256)
SOFTCAP = ("a softcap at this head dim in this direction (the FlashAttention-2 kernel measured faster: "
           "FORWARD_SOFTCAP_HEAD_DIMS, BACKWARD_SOFTCAP_HEAD_DIMS)")

_launcher: list = []
_backward_launcher: list = []
_gluon: list = []


def gluon_available() -> bool:
    if not _gluon:
        _gluon.append(importlib.util.find_spec("triton.experimental.gluon") is not None)
    return _gluon[0]


def _switch() -> str:
    """MHATTN_TRITON_HOPPER's value: "0" (or false, no, off) turns the Hopper kernels off; "always" runs them
    wherever they apply, whatever the key count (to qualify them on a conformance run's small shapes). Read at every
    call on an sm_90 GPU (it may change between calls), so through os.environ's own store."""
    raw = _switch_store.get(_switch_key)
    return "1" if raw is None else _switch_value(raw)


_switch_store, _switch_key = environment.raw_store(ENV_SWITCH)


@functools.lru_cache(maxsize=16)
def _switch_value(raw) -> str:
    return environment.decoded(raw).strip().lower()


def why_not(plan, run, min_keys: Optional[dict] = None, deterministic: bool = False,
            padding: Optional[str] = None) -> Optional[str]:
    """None when the Hopper kernel runs this call's forward (min_keys None: MIN_KEYS, and FULL_GRID_MIN_KEYS) or, with
    BACKWARD_MIN_KEYS (or DETERMINISTIC_MIN_KEYS and ``deterministic``), its backward; otherwise the reason it does
    not. The plan's part is worked out once per plan and setting. ``padding``: the call's key_padding.padding_kind
    where the plan has key lengths and the caller has it (else run.key_padding_kind() is asked)."""
    if plan.has_right and run.window_right != 0:
        return "a right window bound other than causal"
    if run.qk_scale2 <= 0:
        return "a scale <= 0 (the Hopper forward takes each row's maximum of the unscaled scores)"
    forward = min_keys is None
    min_keys = MIN_KEYS if forward else min_keys
    grid_min_keys = FULL_GRID_MIN_KEYS if forward else _NO_GRID_MIN_KEYS
    softcap_dims = _softcap_dims(forward)
    # Keyed by the thresholds' identity (a replaced dict is a new key; so the dicts must be kept ones, not made per
    # call); the entry holds the dicts, so their ids cannot be reused by others while the entry lives.
    key = (_switch(), id(min_keys), id(grid_min_keys), configs.pinned() is None, FORWARD_DROPOUT_HEAD_DIMS,
           softcap_dims)
    found = plan.hopper_reasons.get(key)
    if found is None:
        fills = bool(grid_min_keys) and plan.sm90 and fills_grid(plan.batch, plan.heads_q, plan.seqlen_q,
                                                                  plan.device_index)
        found = plan.hopper_reasons[key] = (min_keys, grid_min_keys, _rule(
            key[0], plan.sm90, plan.dtype, plan.head_dim, plan.head_dim_v, plan.seqlen_q, plan.seqlen_k, plan.has_right,
            plan.mask_kind not in (0, scores.MASK_KEYS), forward and plan.has_dropout, min_keys,
            grid_min_keys if fills else _NO_GRID_MIN_KEYS, softcap_dims if plan.has_softcap else None))
    reason = found[2]
    if reason is None and not run.tma_ok:
        return "rows or starts not 16-byte aligned for the copy engine, or a broadcast batch or head"
    if reason is None and plan.key_lengths:
        kind = padding or run.key_padding_kind()
        if kind == key_padding.OTHER:
            return NOT_KEY_LENGTHS
    return reason


# Why a key-padding mask (a boolean mask the same for every head and query row) is left to the FlashAttention-2
# kernels, which read it: the Gluon kernels take such a mask only as each sequence's first key and key count.
NOT_KEY_LENGTHS = ("a boolean mask other than one run of keys per sequence (True exactly on keys [first, last] of "
                   "each, the same for every head and query: right or left padding), or one met during CUDA graph "
                   "capture (key_padding.padding_kind)")


def why_not_backward(plan, run, grad_out_ready: bool, deterministic: bool = False,
                     padding: Optional[str] = None) -> Optional[str]:
    """None when the Hopper kernel runs this call's backward (deterministic: its deterministic build); otherwise the
    reason it does not. grad_out_ready: the output gradient can be read through tensor maps
    (backend._descriptor_ready). padding: as why_not's."""
    reason = why_not(plan, run, backward_min_keys(deterministic), deterministic, padding)
    if reason is None and not grad_out_ready:
        return ("the output gradient's rows or start not 16-byte aligned for the copy engine, or a broadcast batch or "
                "head")
    return reason


def backward_min_keys(deterministic: bool) -> dict:
    """The backward's key thresholds: BACKWARD_MIN_KEYS, or DETERMINISTIC_MIN_KEYS for a deterministic one."""
    return DETERMINISTIC_MIN_KEYS if deterministic else BACKWARD_MIN_KEYS


def why_not_problem(problem, min_keys: Optional[dict] = None) -> Optional[str]:
    """:func:`why_not` from a dispatcher Problem (no tensors: alignment is not known there)."""
    # (a boolean mask may be right padding, which the Gluon kernels take: the caller says so, backend._conditions)
    extras = problem.features & {"float_mask", "value_dim"}
    sm90 = problem.compute_capability == (9, 0)
    fills = min_keys is None and sm90 and fills_grid(problem.batch, problem.heads_q, problem.seqlen_q,
                                                       problem.device_index)
    return _rule(_switch(), sm90, problem.dtype, problem.head_dim, problem.head_dim_v,
                 problem.seqlen_q, problem.seqlen_k, "causal" in problem.features, bool(extras),
                 min_keys is None and "dropout" in problem.features, MIN_KEYS if min_keys is None else min_keys,
                 FULL_GRID_MIN_KEYS if fills else _NO_GRID_MIN_KEYS,
                 _softcap_dims(min_keys is None) if "softcap" in problem.features else None)


def _softcap_dims(forward: bool) -> tuple:
    """The head dims whose softcapped forward (or backward) runs the Hopper kernel."""
    return FORWARD_SOFTCAP_HEAD_DIMS if forward else BACKWARD_SOFTCAP_HEAD_DIMS


def fills_grid(batch: int, heads_q: int, seqlen_q: int, device_index: Optional[int]) -> bool:
    """Whether the forward's query tiles (FORWARD_TILE_ROWS rows of one head) are at least as many as the GPU's SMs."""
    if device_index is None or not torch.cuda.is_available():  # (explain on a machine without the GPU)
        return False
    return batch * heads_q * -(-seqlen_q // FORWARD_TILE_ROWS) >= _sm_count(device_index)


def _rule(switch, sm90, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, extras, dropout_forward, min_keys,
          grid_min_keys, softcap_dims=None) -> Optional[str]:
    """The reason against the Hopper kernel from a call's plan (None: none); softcap_dims: with a softcap, the head
    dims whose softcapped calls it runs in this direction (_softcap_dims), else None."""
    if switch in ("0", "false", "no", "off"):
        return f"{ENV_SWITCH}=0"
    if not sm90:
        return "not an sm_90 GPU"
    if not gluon_available():
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if configs.pinned() is not None:
        return "a pinned tile configuration (forward.py's tiles)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (fp16/bf16 only)"
    width = TILE_WIDTH.get(head_dim)
    if head_dim != head_dim_v or width not in min_keys:
        return f"head dims {head_dim}/{head_dim_v} (equal, one of {sorted(TILE_WIDTH)})"
    if extras:
        return "a float mask, or a boolean mask other than key padding"
    if dropout_forward and width not in FORWARD_DROPOUT_HEAD_DIMS:
        return DROPOUT_FORWARD
    if softcap_dims is not None and width not in softcap_dims:
        return SOFTCAP
    if seqlen_q == 0 or seqlen_k == 0:
        return "an empty query or key set"
    fewest = min_keys[width]
    if isinstance(fewest, tuple):  # (without a causal mask, with one)
        fewest = fewest[bool(causal)]
    fewest = min(fewest, grid_min_keys.get(width, fewest))
    if seqlen_k < fewest and switch != "always":
        return f"{seqlen_k} keys < {fewest} (the FlashAttention-2 kernel is faster there)"
    return None


def compile_time_args(head_dim: int, causal: bool, tile_counter: bool = False, seqlen_k: Optional[int] = None,
                      window: bool = False, key_lengths: bool = False, dropout: bool = False,
                      softcap: bool = False, key_starts: bool = False) -> dict:
    """The kernel's compile-time arguments for a head dim, causal or not, tiles from a counter or round-robin,
    ``seqlen_k`` keys (None: as many as the longest; the launch, `mhattn build` and the GPU check script use the
    same), a sliding window's left bound or not, per-batch key counts (a right-padding key mask) or not, dropout or
    not, a softcap or not, and with the key counts per-batch first keys (a left-padding key mask) or not. HEAD_DIM is
    the tile width (TILE_WIDTH), HEAD_COLS the head dim."""
    width = TILE_WIDTH[head_dim]
    half_diagonal = (causal and not window and seqlen_k is not None
                     and seqlen_k <= FORWARD_HALF_DIAGONAL_MAX_KEYS.get(width, 0))
    q_rotating = (Q_BUFFERS[width] == 1 and seqlen_k is not None
                  and seqlen_k <= FORWARD_Q_ROTATING_MAX_KEYS.get(width, 0))
    return dict(HEAD_DIM=width, HEAD_COLS=head_dim, BLOCK_M=QUERY_ROWS_PER_CONSUMER, BLOCK_N=KEY_BLOCK[width],
                NUM_STAGES=FORWARD_STAGES[width], Q_BUFFERS=Q_BUFFERS[width], CAUSAL=causal,
                TILE_COUNTER=tile_counter, SPLIT_MASKED=FORWARD_SPLIT_MASKED[width],
                HALF_DIAGONAL=half_diagonal, LAZY_RESCALE=FORWARD_LAZY_RESCALE[width],
                Q_ROTATING=q_rotating, WINDOW=window, KEY_LENGTHS=key_lengths, DROPOUT=dropout, SOFTCAP=softcap,
                SPLIT_PRODUCTS=head_dim in FORWARD_SPLIT_HEAD_DIMS, KEY_STARTS=key_starts)


class ForwardSchedule(NamedTuple):
    """The forward's grid and tile order (see hopper_forward_kernel): ``programs`` programs over ``num_tiles`` tiles
    of ``num_m_blocks`` per head, causal groups of ``group_heads`` heads; ``tile_counter``: the programs take their
    tiles from a counter (else round-robin)."""

    programs: int
    num_m_blocks: int
    num_tiles: int
    group_heads: int
    tile_counter: bool


def forward_schedule(batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, causal: bool, head_bytes: int,
                     sm_count: int, persistent: Optional[bool] = None) -> ForwardSchedule:
    """The forward's schedule: a persistent grid (``persistent`` None: the rules above) has one program per SM, or
    fewer when there are fewer tiles; causal, its programs take their tiles from a counter. head_bytes: the bytes of
    K and V one query head reads (its share of its key/value head's), which size the causal groups."""
    num_m_blocks = -(-seqlen_q // (2 * QUERY_ROWS_PER_CONSUMER))
    num_heads = batch * heads_q
    num_tiles = num_heads * num_m_blocks
    if persistent is None:
        persistent = seqlen_k <= (CAUSAL_PERSISTENT_MAX_KEYS if causal else PERSISTENT_MAX_KEYS)
    group_heads = max(1, min(num_heads, CAUSAL_GROUP_BYTES // max(1, head_bytes))) if causal else 1
    programs = min(num_tiles, sm_count) if persistent else num_tiles
    return ForwardSchedule(programs, num_m_blocks, num_tiles, group_heads, causal and programs < num_tiles)


def forward_head_bytes(seqlen_k: int, head_dim: int, element_size: int, kv_group: int) -> int:
    """The bytes of K and V one query head reads: its key/value head's, shared by kv_group query heads."""
    return -(-2 * seqlen_k * head_dim * element_size // kv_group)


def tensor_map(tensor, block_shape):
    """The copy engine's host tensor map of ``tensor``, read in blocks of ``block_shape`` into the swizzled
    shared-memory tile wgmma reads. The callers have checked the alignments (why_not); a dim of extent 1 gets a
    stride the map accepts whatever the tensor's says."""
    shape, strides = list(tensor.shape), list(tensor.stride())
    if 1 in shape:
        inner = 1
        for dim in range(len(shape) - 1, -1, -1):
            if shape[dim] == 1:
                strides[dim] = inner
            inner = strides[dim] * shape[dim]
    return _unchecked_descriptor(tensor, shape, strides, list(block_shape), _map_layout(block_shape, tensor.dtype))


def _unchecked_descriptor(base, shape, strides, block_shape, layout):
    """Gluon's ``TensorDescriptor(base, shape, strides, block_shape, layout)`` without its constructor's checks, which
    took 60% of the host time of making the maps (the backward makes nine per launch): what they check (rank, 16-byte
    aligned base and strides, a contiguous last dim, the layout's type and width) holds by construction here or was
    checked before the launch (why_not). tests/test_triton_backend.py holds these equal to the checked ones."""
    if not _descriptor_type:
        import dataclasses

        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        defaults = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                    if f.default is not dataclasses.MISSING}
        _descriptor_type.extend((TensorDescriptor, defaults))
    kind, defaults = _descriptor_type
    descriptor = object.__new__(kind)
    fields = descriptor.__dict__
    fields.update(defaults)
    fields["base"], fields["shape"], fields["strides"], fields["block_shape"], fields["layout"] = \
        base, shape, strides, block_shape, layout
    return descriptor


_descriptor_type: list = []  # Gluon's TensorDescriptor class and its fields' defaults, found on first use


def _map_layout(block_shape: tuple, dtype):
    """The shared-memory layout of a tensor map's blocks, made once per (block shape, dtype): building a Gluon
    layout object costs more host time than encoding the map."""
    layout = _map_layouts.get((block_shape, dtype))
    if layout is None:
        from triton.experimental.gluon import language as gl

        from mhattn.backends.triton.hopper_forward import tile_layout

        bits = torch.empty((), dtype=dtype).element_size() * 8
        if block_shape[-2] == 1:  # a row of per-query values (lse2, delta), read as a vector: no swizzle
            layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=len(block_shape))
        else:
            layout = tile_layout(block_shape[-2], block_shape[-1], bits, len(block_shape))
        layout = _map_layouts[(block_shape, dtype)] = layout
    return layout


_map_layouts: dict = {}  # a handful of entries: the kernels' block shapes by dtype


def forward_maps(q, k, v, out, head_dim: int) -> tuple:
    """The forward kernel's tensor maps of q, k, v and out, in blocks of the head dim's tile width."""
    width = TILE_WIDTH[head_dim]
    key_block = (1, 1, KEY_BLOCK[width], width)
    query_block = (1, 1, QUERY_ROWS_PER_CONSUMER, width)
    return (tensor_map(q, query_block), tensor_map(k, key_block), tensor_map(v, key_block),
            tensor_map(out, query_block))


def backward_query_block(head_dim: int, dropout: bool = False, softcap: bool = False, key_starts: bool = False) -> int:
    """The backward's query rows per step at ``head_dim``, with or without dropout, a softcap or per-sequence first
    keys (KEY_STARTS, whose mask at d = 64 spills 80 bytes a thread in 128-row steps under Triton 3.6, none in 64)."""
    width = TILE_WIDTH[head_dim]
    if dropout or softcap or key_starts:
        return BACKWARD_FEATURE_QUERY_BLOCK.get(width, BACKWARD_QUERY_BLOCK[width])
    return BACKWARD_QUERY_BLOCK[width]


def backward_maps(q, k, v, grad_out, lse2, delta, dq_acc, dk, dv, head_dim: int, query_rows: Optional[int] = None
                  ) -> tuple:
    """The backward kernel's tensor maps of q, k, v, grad_out, lse2, delta, the float32 dQ buffer, dk and dv (written
    in K's blocks), in blocks of the head dim's tile width; Q, dO, lse2, delta and dQ in steps of ``query_rows`` (the
    build's BLOCK_M: backward_query_block; by default the plain build's)."""
    width = TILE_WIDTH[head_dim]
    query_rows = query_rows or BACKWARD_QUERY_BLOCK[width]
    query_block = (1, 1, query_rows, width)
    key_block = (1, 1, BACKWARD_KEY_BLOCK[width], width)
    rows_block = (1, 1, query_rows)
    return (tensor_map(q, query_block), tensor_map(k, key_block), tensor_map(v, key_block),
            tensor_map(grad_out, query_block), tensor_map(lse2, rows_block), tensor_map(delta, rows_block),
            tensor_map(dq_acc, (1, 1, query_rows, min(width, 128))), tensor_map(dk, key_block),
            tensor_map(dv, key_block))


def forward(q, k, v, out, lse, run, plan, device_index: int) -> "ForwardLaunch":
    """Launch the Hopper kernel into ``out`` and ``lse`` (allocated by the caller) through the call signature's
    prepared launch (``run.signature.hopper_forward``, made here at its first call; a call whose key-padding mask
    starts past some sequence's first key, ``hopper_forward_spans``); returns it."""
    signature = getattr(run, "signature", None)
    spans = None if run.key_bounds is None else run.key_spans()
    where = "hopper_forward" if spans is None else "hopper_forward_spans"
    prepared = None if signature is None else getattr(signature, where)
    if prepared is None or not prepared.current(plan):
        prepared = ForwardLaunch(q, k, v, out, lse, run, plan, device_index, key_starts=spans is not None)
        if signature is not None:
            setattr(signature, where, prepared)
    prepared.launch((q, k, v, out, lse), run.key_bounds if spans is None else spans,
                    run.seed if plan.has_dropout else None)
    return prepared


def _forward_setup(plan, q, device_index: int, key_starts: bool = False) -> tuple:
    """(launcher, schedule, compile-time set) of the forward, made once per plan: the schedule, and the build's set
    (key_starts: the build that takes each sequence's first key, KEY_STARTS) at its first use."""
    if not _launcher:
        from mhattn.backends.triton import hopper_forward

        _launcher.append(CompiledLauncher(hopper_forward.hopper_forward_kernel))
    launcher = _launcher[0]
    found = plan.hopper_schedule
    if found is None:
        head_bytes = forward_head_bytes(plan.seqlen_k, plan.head_dim, q.element_size(), plan.kv_group)
        schedule = forward_schedule(plan.batch, plan.heads_q, plan.seqlen_q, plan.seqlen_k, plan.has_right, head_bytes,
                                    _sm_count(device_index))
        found = plan.hopper_schedule = (schedule, {})  # (the sets by key_starts)
    schedule, sets = found
    constexprs = sets.get(key_starts)
    if constexprs is None:
        # (key starts come with key lengths and without dropout: why_not)
        constexprs = sets[key_starts] = launcher.constexprs(
            4, 1, **compile_time_args(plan.head_dim, plan.has_right, schedule.tile_counter, plan.seqlen_k,
                                      plan.has_left, plan.key_lengths, plan.has_dropout, plan.has_softcap, key_starts))
    return launcher, schedule, constexprs


class ForwardLaunch:
    """The Gluon forward of one call signature, prepared at its first call: the launch site with the geometry of that
    call's tensor maps (launcher.PreparedMapLaunch), the arguments besides the tensors, whether it takes a tile
    counter. It holds what why_not reads of a call (window_right, tma_ok, qk_scale2), so the backend's repeated call
    asks why_not of it and launches without making the call's state again. ``launch((q, k, v, out, lse))``."""

    __slots__ = ("site", "setup", "middle", "counted", "device_index", "window_right", "tma_ok", "qk_scale2")

    def __init__(self, q, k, v, out, lse, run, plan, device_index: int, key_starts: bool = False):
        launcher, schedule, constexprs = _forward_setup(plan, q, device_index, key_starts)
        self.setup = plan.hopper_schedule
        self.counted, self.device_index = schedule.tile_counter, device_index
        self.middle = (*out.stride()[:3], lse.stride(0), lse.stride(1), plan.heads_q, plan.kv_group, plan.seqlen_q,
                       plan.seqlen_k, *schedule[1:4], scores_scale2(run, plan), run.diag_offset, run.window_left,
                       run.threshold, run.dropout_scale, run.softcap_in2)
        counter = tile_counter(q.device, device_index) if self.counted else lse
        self.site = launcher.prepare_maps((schedule.programs,), (
            *forward_maps(q, k, v, out, plan.head_dim), out, lse, counter,
            counter if run.key_bounds is None else (run.key_spans() if key_starts else run.key_bounds),
            run.seed if plan.has_dropout else counter,
            *self.middle), constexprs, device_index)
        self.window_right, self.tma_ok, self.qk_scale2 = run.window_right, True, run.qk_scale2

    def current(self, plan) -> bool:
        """Whether this launch still stands for the plan's forward: made with its current schedule (remade when
        the forward's settings change) and the forward's current launcher."""
        return self.setup is plan.hopper_schedule and self.site.launcher is _launcher[0]

    def launch(self, tensors: tuple, key_bounds=None, seed=None) -> None:
        """Launch into out and lse of ``tensors`` = (q, k, v, out, lse), of the signature's shapes and strides and
        aligned for the copy engine (the caller's checks); key_bounds: each batch entry's key count where the plan has
        key lengths (a launch made with key_starts: the spans of key_padding.padding_kind); seed: the call's dropout
        seed words where it has dropout."""
        q, k, v, out, lse = tensors
        counter = tile_counter(q.device, self.device_index) if self.counted else lse
        self.site.launch((q, k, v, out, out, lse, counter, counter if key_bounds is None else key_bounds,
                          counter if seed is None else seed, *self.middle))


def scores_scale2(run, plan) -> float:
    """What the Hopper kernels' qk_scale2 multiplies: the raw scores (scale * log2(e)), or with a softcap their
    tanh (softcap * log2(e): hopper_forward.softmax_step)."""
    return run.softcap_out2 if plan.has_softcap else run.qk_scale2


def tile_counter(device: torch.device, device_index: int) -> torch.Tensor:
    """The int32 tile counter of the forward's launches on the current stream: one per (GPU, stream), zeroed when
    made; each launch leaves it at 0 (hopper_forward.next_counted_tile), and one stream's launches run in order. A
    launch being captured into a CUDA graph gets one of its own (zeroed in the graph): a graph may be replayed on
    another stream while this stream's launches use theirs."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device, current_stream(device_index) if device.type == "cuda" else 0)
    counter = _tile_counters.get(key)
    if counter is None:
        counter = put_bounded(_tile_counters, key, torch.zeros(1, dtype=torch.int32, device=device), COUNTERS_LIMIT)
    return counter


# The forward's tile counters by (device, stream); a program with ever-new streams keeps working past this many (the
# oldest goes; a counter freed while a launch on its stream still runs is reused only by that stream's later work).
_tile_counters: dict = {}
COUNTERS_LIMIT = 64


def backward_compile_time_args(head_dim: int, causal: bool, window: bool = False, key_lengths: bool = False,
                               dropout: bool = False, softcap: bool = False, deterministic: bool = False,
                               key_starts: bool = False, partial_dk_dv: bool = False) -> dict:
    """The backward kernel's compile-time arguments (launch, `mhattn build`, the GPU check script); window: a sliding
    window's left bound; key_lengths: per-batch key counts (a right-padding key mask); dropout; softcap; deterministic:
    dQ's shares added in a fixed order; key_starts (with key_lengths): per-batch first keys too (a left-padding key
    mask); partial_dk_dv: a key/value head's query heads split over programs that add float32 partial dK and dV
    (backward_group_parts). HEAD_DIM is the tile width (TILE_WIDTH), HEAD_COLS the head dim."""
    width = TILE_WIDTH[head_dim]
    rows = backward_query_block(head_dim, dropout, softcap, key_starts)
    return dict(HEAD_DIM=width, HEAD_COLS=head_dim, BLOCK_M=rows,
                BLOCK_N=BACKWARD_KEY_BLOCK[width], NUM_STAGES=BACKWARD_STAGES[width], CAUSAL=causal,
                STAGED_DK_DV=BACKWARD_STAGED_DK_DV[width],
                WINDOW=window, KEY_LENGTHS=key_lengths, DROPOUT=dropout, SOFTCAP=softcap, DETERMINISTIC=deterministic,
                SPLIT_PRODUCTS=head_dim in BACKWARD_SPLIT_HEAD_DIMS, KEY_STARTS=key_starts, PARTIAL_DK_DV=partial_dk_dv)


# GQA: a key/value head's query heads split over group_parts programs per key block, each adding float32 partial dK
# and dV (hopper_backward_kernel's PARTIAL_DK_DV), where the tile is as wide as the head dim and at most 128. With one
# program walking the group, a causal grid has few programs of very unequal lengths (a key block near the diagonal
# walks all queries of all the group's heads), and the ones launched last leave SMs idle: a Llama-shaped training step
# (B = 2, 16 query heads on 4 key/value heads, 4k keys, d = 128, causal) on the H200 took 1.03 ms in the backward with
# 256 such programs, 0.85 ms with 1024 of one query head each, SDPA's 0.85 ms (NOTES version 35). The rule, from those
# runs: a causal grid at head dim 128 and at least BACKWARD_SPLIT_MIN_KEYS keys is split until it has
# BACKWARD_SPLIT_PROGRAMS_PER_SM programs per SM (at 512 keys, twice as slow split); any other grid short of one program
# per SM (MQA) until it has one. Not without a causal mask (programs of equal lengths: no gain, 0-5% slower), nor at
# head dim 64, whose times moved by up to 1.7x between processes at the same setting.
BACKWARD_SPLIT_PROGRAMS_PER_SM = 6
BACKWARD_SPLIT_MIN_KEYS = 2048
# None: the rule; a number: that many query heads per program wherever it divides the group (benchmarks set it).
BACKWARD_HEADS_PER_PROGRAM = None


def backward_group_parts(plan, deterministic: bool = False, device_index: Optional[int] = None) -> int:
    """How many programs share a key block's query heads in the plan's backward (group_parts)."""
    return group_parts(plan.batch, plan.heads_kv, plan.kv_group, plan.seqlen_k, plan.head_dim,
                       plan.has_right and not plan.has_left, deterministic, device_index)


def group_parts(batch: int, heads_kv: int, kv_group: int, seqlen_k: int, head_dim: int, causal: bool,
                deterministic: bool = False, device_index: Optional[int] = None) -> int:
    """How many programs share a key block's kv_group query heads (1 without GQA): a divisor of kv_group (see
    above). causal: a causal mask without a window. 1 (one program walks the group, dK and dV summed in its registers)
    for a deterministic backward, whose additions must keep their order, and at head dims whose tile is wider than the
    head dim or wider than 128."""
    if kv_group == 1 or deterministic or TILE_WIDTH[head_dim] != head_dim or head_dim > 128:
        return 1
    if BACKWARD_HEADS_PER_PROGRAM is not None:
        heads = BACKWARD_HEADS_PER_PROGRAM
        return kv_group // heads if kv_group % heads == 0 else 1
    programs = batch * heads_kv * backward_key_blocks(seqlen_k, head_dim)
    sm_count = _sm_count(device_index)
    if causal and head_dim == 128 and seqlen_k >= BACKWARD_SPLIT_MIN_KEYS:
        wanted = BACKWARD_SPLIT_PROGRAMS_PER_SM * sm_count
    elif programs < sm_count:
        wanted = sm_count
    else:
        return 1
    return next((parts for parts in range(1, kv_group) if kv_group % parts == 0 and programs * parts >= wanted),
                kv_group)


def _backward_setup(plan, device_index: int, deterministic: bool = False, key_starts: bool = False,
                    partial: bool = False) -> tuple:
    """(launcher, compile-time set, (batches, key/value heads) per launch) of the backward, deterministic or not, with
    per-sequence first keys or not (KEY_STARTS), with partial dK and dV sums or not (PARTIAL_DK_DV), made once per
    plan."""
    if not _backward_launcher:
        from mhattn.backends.triton import hopper_backward

        _backward_launcher.append(CompiledLauncher(hopper_backward.hopper_backward_kernel))
    launcher = _backward_launcher[0]
    # ((deterministic, key_starts) -> compile-time set)
    constexprs = plan.hopper_backward_constexprs.get((deterministic, key_starts, partial))
    if constexprs is None:
        constexprs = plan.hopper_backward_constexprs[(deterministic, key_starts, partial)] = launcher.constexprs(
            8, 1, **backward_compile_time_args(plan.head_dim, plan.has_right, plan.has_left, plan.key_lengths,
                                               plan.has_dropout, plan.has_softcap, deterministic, key_starts,
                                               partial))
    return launcher, constexprs, _backward_slices(plan, device_index)


def _backward_slices(plan, device_index: int) -> tuple:
    """(batches, key/value heads) per launch of the plan's backward (backward_slices), made once per plan (sized for
    the backward that is not deterministic: its float32 sums are dQ's and, with partial dK and dV, theirs)."""
    if plan.hopper_backward_slices is None:
        parts = backward_group_parts(plan, False, device_index)
        words = plan.kv_group * plan.seqlen_q * plan.head_dim + (_partial_words(plan, 1, 1) if parts > 1 else 0)
        plan.hopper_backward_slices = backward_slices(plan.batch, plan.heads_kv, words * 4,
                                                      parts * backward_programs_per_head(plan),
                                                      _sm_count(device_index))
    return plan.hopper_backward_slices


def backward_programs_per_head(plan) -> int:
    """The backward's programs per (batch, key/value head) with its group in one program: its key blocks."""
    return backward_key_blocks(plan.seqlen_k, plan.head_dim)


def backward_key_blocks(seqlen_k: int, head_dim: int) -> int:
    """The backward's key blocks (of BACKWARD_KEY_BLOCK keys at the head dim's tile width) over seqlen_k keys."""
    return -(-seqlen_k // BACKWARD_KEY_BLOCK[TILE_WIDTH[head_dim]])


def backward_sums_words(plan, device_index: int, deterministic: bool = False) -> int:
    """float32 words of the dQ sums and their counters (one int32 word per (batch, key/value head); deterministic,
    then one per (batch, query head, query block): the turn counters) when the backward runs as one launch, which the
    caller allocates beside lse2 and delta and zeroes with them (backward.py's preprocess); 0 when it runs in slices
    (:func:`backward` allocates and zeroes a slice's buffer itself)."""
    batches, heads = _backward_slices(plan, device_index)
    if batches != plan.batch or heads != plan.heads_kv:
        return 0
    return _sums_words(plan, batches, heads, deterministic, device_index)


def _sums_words(plan, batches: int, heads: int, deterministic: bool = False, device_index: Optional[int] = None) -> int:
    """float32 words of one launch's dQ sums and counters over ``batches`` x ``heads`` (batch, key/value head) pairs:
    each pair's sums for its kv_group query heads, then its int32 counter; with partial dK and dV sums
    (backward_group_parts), dK's then dV's (_partial_words); deterministic, then the int32 turn counters of each query
    head's query blocks (as many as the build with the shortest steps has: a build with per-sequence first keys may
    take shorter steps than the call's others, backward_query_block)."""
    query_rows = backward_query_block(plan.head_dim, key_starts=True)
    turns = plan.kv_group * -(-plan.seqlen_q // query_rows) if deterministic else 0
    words = batches * heads * (plan.kv_group * plan.seqlen_q * plan.head_dim + 1 + turns)
    if backward_group_parts(plan, deterministic, device_index) > 1:
        return _partial_start(words) + _partial_words(plan, batches, heads)
    return words


def _partial_start(words: int) -> int:
    """Where the partial dK and dV sums start after ``words`` words of dQ sums and counters: the next 16-byte boundary
    (the kernel adds them in pairs of floats, and its ahead-of-time builds take 16-byte aligned pointers)."""
    return -(-words // 4) * 4


def _partial_words(plan, batches: int, heads: int) -> int:
    """float32 words of the partial dK and dV sums over ``batches`` x ``heads`` (batch, key/value head) pairs."""
    return 2 * batches * heads * plan.seqlen_k * plan.head_dim


def backward(q, k, v, grad_out, lse2, delta, dq, dk, dv, run, plan, device_index: int,
             sums=None, deterministic: bool = False) -> Optional["BackwardSite"]:
    """Launch the Hopper backward into dq, dk, dv (allocated by the caller); lse2 and delta from backward.py's
    preprocess, rows padded to a 16-byte stride. dQ is summed in float32; where a (batch, key/value head)'s sums take
    at most CONVERT_IN_KERNEL_MAX_BYTES the kernel's program that adds last converts them into dq, else they are
    copied into dq after the launch. ``sums``: the zeroed buffer of :func:`backward_sums_words` words when the backward
    runs as one launch. To bound that buffer, large problems run as several launches over slices of the batch or of
    the key/value heads (:func:`backward_slices`), each zeroing its own and drawing the dropout keep-mask by the
    call's batch and head numbers. deterministic: the build that adds dQ's shares in a fixed order, with its turn
    counters after the sums' (:func:`backward_sums_words`). Returns the launch as a BackwardSite where it ran as one
    launch through the call signature's prepared site (a repeated call may launch it again), else None."""
    spans = None if run.key_bounds is None else run.key_spans()  # (a left-padding key mask: key_padding.SPAN)
    parts = backward_group_parts(plan, deterministic, device_index)
    launcher, constexprs, (batches, heads) = _backward_setup(plan, device_index, deterministic, spans is not None,
                                                             parts > 1)
    head_dim = plan.head_dim
    num_n_blocks = backward_programs_per_head(plan)
    group = plan.kv_group
    query_rows = backward_query_block(head_dim, plan.has_dropout, plan.has_softcap, spans is not None)
    convert_in_kernel = group * plan.seqlen_q * head_dim * 4 <= CONVERT_IN_KERNEL_MAX_BYTES

    def launch(q_s, k_s, v_s, grad_out_s, lse2_s, delta_s, dq_s, dk_s, dv_s, zeroed, key_bounds, first_batch=0,
               first_head=0, sites=None):
        # (first_batch, first_head: the slice's first batch entry and query head in the call, by whose numbers the
        # dropout keep-mask is drawn)
        dkv_strides = (*dk.stride()[:3], *dv.stride()[:3]) if parts == 1 else 2 * _partial_strides(k_s)
        scalars = (*dkv_strides, *dq.stride()[:3], k_s.shape[1], group, plan.seqlen_q,
                   plan.seqlen_k, num_n_blocks, scores_scale2(run, plan), run.sm_scale, run.diag_offset,
                   run.window_left, run.threshold, run.dropout_scale, first_batch * plan.heads_q + first_head,
                   plan.heads_q, run.softcap_in2, int(convert_in_kernel), parts)
        args = backward_arguments(q_s, k_s, v_s, grad_out_s, lse2_s, delta_s, dq_s, dk_s, dv_s, zeroed,
                                  key_bounds, run.seed if plan.has_dropout else None, parts > 1) + scalars
        grid = (k_s.shape[0] * k_s.shape[1] * parts * num_n_blocks,)
        site = None
        if sites is None:
            mapped = args[:BACKWARD_MAPS]
            launcher.launch(grid, (*backward_maps(*mapped, head_dim, query_rows), *args[BACKWARD_MAPS:]), constexprs,
                            device_index)
        else:
            # One launch per call over the signature's tensors: the site prepared by its first call (the maps'
            # geometry: the signature's and the gradient's strides).
            key = ("hopper_backward", grad_out_s.stride(), deterministic, spans is not None, parts)
            site = sites.get(key)
            if site is None or site.launcher is not launcher or site.constexprs is not constexprs:
                mapped = args[:BACKWARD_MAPS]
                site = sites[key] = launcher.prepare_maps(grid, (*backward_maps(*mapped, head_dim, query_rows),
                                                                 *args[BACKWARD_MAPS:]), constexprs, device_index)
            site.launch(args)
        finish(args, dq_s, dk_s, dv_s, convert_in_kernel, parts > 1)
        return None if site is None else BackwardSite(site, scalars, convert_in_kernel, parts > 1)

    if batches == plan.batch and heads == plan.heads_kv:  # one launch over the whole tensors: no slicing views
        signature = getattr(run, "signature", None)
        return launch(q, k, v, grad_out, lse2, delta, dq, dk, dv, sums, run.key_bounds if spans is None else spans,
                      sites=None if signature is None else signature.sites)
    accumulator = torch.empty(_sums_words(plan, batches, heads, deterministic, device_index), dtype=torch.float32,
                              device=q.device)
    for b0 in range(0, plan.batch, batches):
        for h0 in range(0, plan.heads_kv, heads):
            b, h = slice(b0, b0 + batches), slice(h0, h0 + heads)
            hq = slice(h0 * group, (h0 + heads) * group)
            q_s, k_s = q[b, hq], k[b, h]
            zeroed = accumulator[:_sums_words(plan, k_s.shape[0], k_s.shape[1], deterministic, device_index)].zero_()
            launch(q_s, k_s, v[b, h], grad_out[b, hq], lse2[b, hq], delta[b, hq], dq[b, hq], dk[b, h], dv[b, h],
                   zeroed, _slice_bounds(run.key_bounds, spans, b), b0, h0 * group)
    return None


def _slice_bounds(key_bounds, spans, b: slice):
    """A batch slice's KeyBounds: its key counts, or with spans (bounds then first keys, 2B) its counts then its first
    keys (2 x the slice's entries); None without either."""
    if spans is None:
        return None if key_bounds is None else key_bounds[b]
    batch = spans.shape[0] // 2
    return torch.cat((spans[:batch][b], spans[batch:][b]))


BACKWARD_MAPS = 9  # the backward kernel's first arguments, read through host tensor maps (backward_maps)
DK_DV_ARGUMENTS = BACKWARD_MAPS  # dK and dV as pointers (or their float32 partial sums) among backward_arguments
SUMS_ARGUMENT = BACKWARD_MAPS + 3  # the float32 dQ sums among backward_arguments (after dk, dv and dq)


def backward_arguments(q, k, v, grad_out, lse2, delta, dq, dk, dv, zeroed, key_bounds=None, seed=None,
                       partial: bool = False) -> tuple:
    """The backward kernel's tensor arguments, in its order: the BACKWARD_MAPS mapped ones (q, k, v, grad_out, lse2,
    delta, the float32 dQ sums, dk, dv), then dk and dv (partial: the float32 partial sums of dK and dV, k's shape),
    dq, the dQ sums, the per-(batch, key/value head) counters, the per-batch key counts (key_bounds), the dropout seed
    words (seed) and the turn counters of a deterministic build (the counters stand in for each of the last three
    where the plan has none). ``zeroed``: the launch's zeroed float32 words, the dQ sums (q's shape), the counters,
    with partial the dK then the dV sums from the next 16-byte boundary, then any turn counters."""
    sums_words = q.numel()
    counters_end = sums_words + k.shape[0] * k.shape[1]
    dq_acc = zeroed[:sums_words].view(q.shape)
    counters = zeroed[sums_words:counters_end].view(torch.int32)
    dk_arg, dv_arg, partial_end = dk, dv, counters_end
    if partial:
        partial_start = _partial_start(counters_end)
        partial_end = partial_start + 2 * k.numel()
        dk_arg, dv_arg = zeroed[partial_start:partial_end].view((2, *k.shape)).unbind(0)
    turns = zeroed[partial_end:].view(torch.int32) if zeroed.numel() > partial_end else counters
    return (q, k, v, grad_out, lse2, delta, dq_acc, dk, dv, dk_arg, dv_arg, dq, dq_acc, counters,
            counters if key_bounds is None else key_bounds, counters if seed is None else seed, turns)


def _partial_strides(k) -> tuple:
    """(batch, head, row) strides of the float32 partial dK or dV sums of a launch over ``k`` (k's shape,
    contiguous)."""
    return k.shape[1] * k.shape[2] * k.shape[3], k.shape[2] * k.shape[3], k.shape[3]


def finish(args, dq, dk, dv, convert_in_kernel: bool, partial: bool) -> None:
    """After a backward launch over ``args`` (backward_arguments): dQ from its float32 sums unless the kernel converted
    them, dK and dV from their partial sums (partial)."""
    if not convert_in_kernel:
        dq.copy_(args[SUMS_ARGUMENT])
    if partial:
        dk.copy_(args[DK_DV_ARGUMENTS])
        dv.copy_(args[DK_DV_ARGUMENTS + 1])


class BackwardSite(NamedTuple):
    """A one-launch Hopper backward as a call signature's first call launched it: the prepared site (its maps'
    geometry), the arguments after the tensors, and whether the kernel converts dQ itself. :meth:`launch` runs it
    again over a repeated call's tensors."""
    site: object                 # launcher.PreparedMapLaunch
    scalars: tuple
    convert_in_kernel: bool
    partial: bool                # dK and dV from float32 partial sums (backward_group_parts)

    def launch(self, q, k, v, grad_out, lse2, delta, dq, dk, dv, sums, key_bounds=None) -> None:
        """key_bounds: a key-padded call's bounds (or spans), as the site's first launch had them."""
        args = backward_arguments(q, k, v, grad_out, lse2, delta, dq, dk, dv, sums, key_bounds, None, self.partial)
        self.site.launch(args + self.scalars)
        finish(args, dq, dk, dv, self.convert_in_kernel, self.partial)


# The last program to add to a (batch, key/value head)'s dQ converts that head's float32 sums into dQ when they take at
# most this many bytes (NOTES version 15: +1-3% at 1k keys; at 16k, where one program converting 8 MB is the tail of
# the kernel, 0-3% slower than the separate pass, which is kept there).
CONVERT_IN_KERNEL_MAX_BYTES = 1 << 20
# The float32 dQ buffer: one launch when the whole buffer takes at most SINGLE_LAUNCH_BYTES (the protocol's shapes
# up to 16k keys; slicing them cost up to 5% on the H100); above, slices whose buffers stay under ACCUMULATOR_BYTES,
# unless a slice would then hold fewer than MIN_WAVES waves of programs (each launch's last wave leaves SMs idle).
SINGLE_LAUNCH_BYTES = 128 << 20
ACCUMULATOR_BYTES = 64 << 20
MIN_WAVES = 8


def backward_slices(batch: int, heads_kv: int, bytes_per_head: int, programs_per_head: int, sm_count: int):
    """(batches, key/value heads) per backward launch: whole batch entries when a slice holds at least one,
    else heads of one batch entry; slices of near-equal size."""
    if batch * heads_kv * bytes_per_head <= SINGLE_LAUNCH_BYTES:
        return batch, heads_kv
    per_launch = max(1, ACCUMULATOR_BYTES // max(bytes_per_head, 1),
                     -(-MIN_WAVES * sm_count // max(programs_per_head, 1)))
    if per_launch >= heads_kv:
        batches = min(batch, per_launch // heads_kv)
        return -(-batch // -(-batch // batches)), heads_kv
    return 1, -(-heads_kv // -(-heads_kv // per_launch))
