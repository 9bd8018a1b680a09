"""The FlashAttention-2 forward kernel.

One program owns one block of BLOCK_M query rows of one (batch, query head) and streams the key/value
blocks of its key/value head through an online softmax:

    m2  = running row max of the base-2 scores s2
    l   = running sum of exp2(s2 - m2)           (before dropout: the softmax denominator)
    acc = running sum of exp2(s2 - m2) @ V        (unnormalised, after dropout)

Each new block rescales l and acc by exp2(m2_old - m2_new); acc is divided by l once at the end.
Only the log-sum-exp lse = ln 2 * (m2 + log2 l) is stored for the backward pass.

The key range is split in three (see :func:`scores.query_major_ranges`): the band's edges and the ragged
end run the masked inner loop, the blocks in between run the same loop with masking compiled out.
Grid: 1-D, (B * Hq * cdiv(Nq, BLOCK_M),), query blocks fastest so that neighbouring programs share
their key/value head in L2; under a causal mask the longest query blocks of each head start first.

On sm_90 two compile-time switches give the Hopper path (configs.KernelConfig): TMA loads K and V
through tensor descriptors made in the kernel for this (batch, head), so the copy engine moves whole
tiles into swizzled shared memory and zero-fills rows past the sequence end and columns past the head
dim; WARP_SPECIALIZE lets Triton split each inner loop into a producer warp that issues the copies and
consumer warps that compute.
"""

import triton
import triton.language as tl

from mhattn.backends.triton.rng import column_hashes, head_key, keep_tile, row_keys
from mhattn.backends.triton.scores import LN2, attention_scores, query_major_ranges


@triton.jit
def head_offset(batch, head, stride_batch, stride_head):
    """Elements from the start of a (B, H, ...) tensor to one (batch, head)'s rows, in 64 bits: a large tensor's
    offsets pass 2^31 elements."""
    return batch.to(tl.int64) * stride_batch + head.to(tl.int64) * stride_head


@triton.jit
def load_rows(ptrs, offs_rows, limit, offs_cols, COLS: tl.constexpr, BLOCK_COLS: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """Load a (rows, BLOCK_COLS) tile; masks rows >= limit when CHECK_ROWS and the head-dim padding
    columns >= COLS when the head dim is not a power of two. Masked elements read as 0."""
    if CHECK_ROWS:
        if BLOCK_COLS != COLS:
            return tl.load(ptrs, mask=(offs_rows[:, None] < limit) & (offs_cols[None, :] < COLS), other=0.0)
        else:
            return tl.load(ptrs, mask=offs_rows[:, None] < limit, other=0.0)
    else:
        if BLOCK_COLS != COLS:
            return tl.load(ptrs, mask=offs_cols[None, :] < COLS, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def sequence_bounds(CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, VARLEN: tl.constexpr,
                    KEY_LENGTHS: tl.constexpr = False):
    """(q_start, k_start, seqlen_q, seqlen_k) of batch entry ``batch``: with VARLEN the packed sequence's first
    rows and lengths from the cu_seqlens prefix sums (int32, B + 1); otherwise (0, 0) and the given lengths.
    KEY_LENGTHS (a key padding mask): CuSeqlensK (B,) int32 holds, per batch entry, one past the last key the
    mask lets any query see; keys from there on are skipped (seqlen_k becomes the smaller of the two)."""
    if VARLEN:
        q_start = tl.load(CuSeqlensQ + batch)
        k_start = tl.load(CuSeqlensK + batch)
        seqlen_q = tl.load(CuSeqlensQ + batch + 1) - q_start
        seqlen_k = tl.load(CuSeqlensK + batch + 1) - k_start
    else:
        q_start = batch * 0
        k_start = batch * 0
        if KEY_LENGTHS:
            seqlen_k = tl.minimum(seqlen_k, tl.load(CuSeqlensK + batch))
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def load_block(desc, base, start, offs_local, stride, offs_cols, limit, COLS: tl.constexpr,
               BLOCK_COLS: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + len(offs_local)) of one head's (rows, COLS) matrix: through the tensor
    descriptor ``desc`` (TMA; out-of-range rows and columns read as 0) or by pointers from ``base``."""
    if TMA:
        return desc.load([start, 0])
    else:
        ptrs = base + start.to(tl.int64) * stride + offs_local[:, None] * stride + offs_cols[None, :]
        return load_rows(ptrs, start + offs_local, limit, offs_cols, COLS, BLOCK_COLS, CHECK_ROWS)


@triton.jit
def head_descriptor(base, rows, stride, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                    TMA: tl.constexpr):
    """A tensor descriptor over one head's (rows, COLS) matrix with row stride ``stride``, loading
    (BLOCK_ROWS, BLOCK_COLS) tiles; without TMA, the base pointer itself (loads go by pointers)."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[rows, COLS], strides=[stride, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_COLS])
    else:
        return base


@triton.jit
def forward_key_range(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn,
                      start, end, offs_m, offs_d, offs_dv, seqlen_q, seqlen_k,
                      qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left, window_right,
                      mask_base, stride_mq, stride_mk, rng_rows, threshold,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """The inner loop over key blocks [start, end): updates (acc, l_i, m_i) and returns them.

    acc (BLOCK_M, BLOCK_DV) fp32, l_i and m_i (BLOCK_M,) fp32, q (BLOCK_M, BLOCK_D) in the input dtype.
    MASKED: the blocks may hold invisible keys (band edges, the ragged end): bounds-checked loads and
    the visibility mask; unmasked blocks are fully visible and load without checks.
    """
    offs_local = tl.arange(0, BLOCK_N)
    # Only the unmasked middle range is long enough for warp specialisation to pay.
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE and not MASKED):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_local
        k = load_block(k_desc, k_base, start_n, offs_local, stride_kn, offs_d, seqlen_k, HEAD_DIM, BLOCK_D,
                       MASKED, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s2, _ = attention_scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k,
                                 qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left, window_right,
                                 mask_base, stride_mq, stride_mk,
                                 MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, MASK_KIND, k.dtype != tl.float32)
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        # A row that has seen no visible key yet keeps m = -inf; shifting by 0 instead keeps
        # exp2(-inf - shift) = 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s2 - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = keep_tile(rng_rows, column_hashes(offs_n), threshold)
            p = tl.where(keep, p, 0.0)
        v = load_block(v_desc, v_base, start_n, offs_local, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_DV,
                       MASKED, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_m_blocks", "diag_offset", "window_left",
                               "window_right", "threshold", "stride_lb", "stride_lh"])
def attention_forward_kernel(
    Q, K, V, Out, Lse, Mask, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_lb, stride_lh,
    heads_q, kv_group, seqlen_q, seqlen_k, num_m_blocks,
    qk_scale2, softcap_in2, softcap_out2, dropout_scale,
    diag_offset, window_left, window_right,
    Seed, threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HEAVY_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
    VARLEN: tl.constexpr = False, KEY_LENGTHS: tl.constexpr = False,
):
    """Q (B, Hq, Nq, D), K (B, Hkv, Nk, D), V (B, Hkv, Nk, Dv), Out (B, Hq, Nq, Dv): any strides, last
    dim contiguous. Lse (B, Hq, Nq) fp32 by (stride_lb, stride_lh), rows contiguous, natural log. Mask
    (B, Hq, Nq, Nk) by its strides (0 where broadcast). Query head h reads key/value head h // kv_group.
    qk_scale2 = scale * log2(e); dropout_scale = 1 / (1 - p); Seed: the seed words as int32 (the int64 seed
    tensor's words: seed0 at Seed[0], seed1 at Seed[2]), read only with HAS_DROPOUT; threshold an int32 bit
    pattern (see rng.py).

    VARLEN: packed sequences (see :func:`sequence_bounds`): batch b is sequence b, whose rows start at
    CuSeqlensQ[b] / CuSeqlensK[b] (the batch strides are 0, the row strides step over tokens); seqlen_q /
    seqlen_k / num_m_blocks are the longest sequence's, and a program past its sequence's end exits.
    KEY_LENGTHS: per-batch key bounds of a key padding mask (see :func:`sequence_bounds`)."""
    pid = tl.program_id(0)
    batch_head = pid // num_m_blocks
    m_block = pid % num_m_blocks
    if HEAVY_FIRST:
        m_block = num_m_blocks - 1 - m_block
    batch = batch_head // heads_q
    head = batch_head % heads_q
    head_kv = head // kv_group
    start_m = m_block * BLOCK_M
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, VARLEN,
                                                           KEY_LENGTHS)
    if VARLEN:
        if start_m >= seqlen_q:  # this sequence is shorter: no work here
            return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    # Batch/head base offsets in int64: tensors may exceed 2**31 elements.
    q_base = Q + head_offset(batch, head, stride_qb, stride_qh) + q_start.to(tl.int64) * stride_qm
    k_base = K + head_offset(batch, head_kv, stride_kb, stride_kh) + k_start.to(tl.int64) * stride_kn
    v_base = V + head_offset(batch, head_kv, stride_vb, stride_vh) + k_start.to(tl.int64) * stride_vn
    mask_base = Mask + head_offset(batch, head, stride_mb, stride_mh)

    q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    q = load_rows(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    k_desc = head_descriptor(k_base, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_desc = head_descriptor(v_base, seqlen_k, stride_vn, HEAD_DIM_V, BLOCK_N, BLOCK_DV, TMA)

    rng_rows = offs_m.to(tl.uint32)
    if HAS_DROPOUT:
        rng_rows = row_keys(head_key(batch_head, tl.load(Seed)), offs_m, tl.load(Seed + 2))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = query_major_ranges(start_m, seqlen_q, seqlen_k, diag_offset, window_left,
                                                  window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # Left edge of a sliding window: masked.
    if HAS_LEFT:
        acc, l_i, m_i = forward_key_range(
            acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn, lo, full_lo,
            offs_m, offs_d, offs_dv,
            seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left, window_right,
            mask_base, stride_mq, stride_mk, rng_rows, threshold,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            MASK_KIND, HAS_DROPOUT, DOT_PRECISION, TMA, WARP_SPECIALIZE)
    # Fully visible blocks: no masking.
    acc, l_i, m_i = forward_key_range(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn, full_lo, full_hi,
        offs_m, offs_d, offs_dv,
        seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left, window_right,
        mask_base, stride_mq, stride_mk, rng_rows, threshold,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        MASK_KIND, HAS_DROPOUT, DOT_PRECISION, TMA, WARP_SPECIALIZE)
    # The causal diagonal / right edge of the window, and the ragged last key block: masked.
    acc, l_i, m_i = forward_key_range(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_vn, full_hi, hi,
        offs_m, offs_d, offs_dv,
        seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left, window_right,
        mask_base, stride_mq, stride_mk, rng_rows, threshold,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        MASK_KIND, HAS_DROPOUT, DOT_PRECISION, TMA, WARP_SPECIALIZE)

    # Rows that saw no visible key have l = 0: output 0, lse -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (dropout_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)

    o_ptrs = (Out + head_offset(batch, head, stride_ob, stride_oh)
              + (q_start + offs_m)[:, None].to(tl.int64) * stride_om + offs_dv[None, :])
    if BLOCK_DV != HEAD_DIM_V:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=(offs_m[:, None] < seqlen_q) & (offs_dv[None, :] < HEAD_DIM_V))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < seqlen_q)
    lse_base = Lse + head_offset(batch, head, stride_lb, stride_lh) + q_start
    tl.store(lse_base + offs_m, lse, mask=offs_m < seqlen_q)
