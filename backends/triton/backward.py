"""The FlashAttention-2 backward kernels: preprocess, dK/dV over key blocks, dQ over query blocks.

With P = exp(S - lse) recomputed from the saved log-sum-exp, and Pd = P * keep / (1 - p) its dropped
version:

    dV = Pd^T dO        dP = (dO V^T) * keep / (1 - p)        dS = P * (dP - delta)
    dK = scale * dS'^T Q            dQ = scale * dS' K          (dS' = dS * (1 - tanh^2) under softcap)

where delta = rowsum(dO * O) - grad_lse. Three launches:

1. ``backward_preprocess_kernel``: delta per query row, and lse converted to base 2 (lse2), with +inf
   for rows that saw no key so that exp2(s2 - lse2) = 0 there instead of NaN.
2. ``backward_dkdv_kernel``: one program per key block of one (batch, key/value head); it walks every
   query block of every query head that shares this key/value head (GQA without atomics) and
   accumulates dK and dV in registers.
3. ``backward_dq_kernel``: one program per query block of one (batch, query head); it walks the key
   blocks and accumulates dQ in registers (and writes dS for the mask gradient).

Every output element is written by exactly one program with a fixed summation order, so the
gradients are bitwise reproducible.

A short problem, whose keys all fit one block (configs.short_backward_tile), takes one launch instead:
``backward_short_kernel``, one program per (batch, key/value head) running the dK/dV loop over every
query block, each step forming its rows' lse2 and delta itself and storing its rows' dQ outright (the
head's only key block gives all of it). No preprocess, no dQ kernel, no scratch: on a short call the
host's launches and allocations are most of its time (backends/triton/NOTES.md, "The short backward").

The faster mode (configs.DQ_MODES "atomic" / "tma") drops the third kernel: each step of the dK/dV
kernel also forms its query block's share of dQ, scale * dS K, and adds it into a float32 buffer,
element by element with atomics or as one tile with the copy engine's bulk reduce-add (sm_90). That
saves recomputing S and dP (5 matrix products per tile instead of 7) at the price of an order of
additions that varies between runs; the deterministic mode keeps the dQ kernel. With TMA, the query-side
tiles (Q, dO) of each step are loaded through tensor descriptors as in the forward.
"""

import triton
import triton.language as tl

from mhattn.backends.triton.forward import head_descriptor, head_offset, load_block, load_rows, sequence_bounds
from mhattn.backends.triton.rng import column_hashes, head_key, keep_tile, keep_tile_transposed, row_keys
from mhattn.backends.triton.scores import LOG2E, attention_scores, key_major_ranges, query_major_ranges


@triton.jit(do_not_specialize=["seqlen_q", "num_m_blocks", "stride_rows", "zero_words", "zero_chunk"])
def backward_preprocess_kernel(
    Out, dOut, Lse, GradLse, Delta, Lse2, Zero,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_gb, stride_gh, stride_gm,
    heads_q, seqlen_q, num_m_blocks, stride_rows, zero_words, zero_chunk,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    """Delta and Lse2 (B, Hq, Nq) fp32, rows of one (batch, head) stride_rows apart (>= Nq; padded so the copy
    engine can read them), from Out, dOut (B, Hq, Nq, Dv) and Lse, GradLse (B, Hq, Nq), all by their strides.
    ZERO_BLOCK > 0: also zero the zero_words 32-bit words at Zero (the Hopper backward's dQ sums and counters, so
    that they need no launch of their own), zero_chunk of them per program (a multiple of ZERO_BLOCK).
    Grid: (B * Hq * cdiv(Nq, BLOCK_M),)."""
    pid = tl.program_id(0)
    if ZERO_BLOCK > 0:
        zero_words_of_program(Zero, pid, zero_words, zero_chunk, ZERO_BLOCK)
    batch_head = pid // num_m_blocks
    start_m = (pid % num_m_blocks) * BLOCK_M
    batch = (batch_head // heads_q).to(tl.int64)
    head = (batch_head % heads_q).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows_ok = offs_m < seqlen_q

    rows = offs_m[:, None].to(tl.int64)
    o_ptrs = Out + batch * stride_ob + head * stride_oh + rows * stride_om + offs_dv[None, :]
    do_ptrs = dOut + batch * stride_dob + head * stride_doh + rows * stride_dom + offs_dv[None, :]
    o = load_rows(o_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True).to(tl.float32)
    do = load_rows(do_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True).to(tl.float32)
    delta = tl.sum(o * do, 1)

    lse = tl.load(Lse + batch * stride_lb + head * stride_lh + offs_m * stride_lm, mask=rows_ok, other=0.0)
    empty = lse == float("-inf")
    if HAS_GRAD_LSE:
        grad_lse = tl.load(GradLse + batch * stride_gb + head * stride_gh + offs_m * stride_gm, mask=rows_ok,
                           other=0.0)
        delta = delta - tl.where(empty, 0.0, grad_lse)
    lse2 = tl.where(empty, float("inf"), lse * LOG2E)

    out_offsets = batch_head.to(tl.int64) * stride_rows + offs_m
    tl.store(Delta + out_offsets, delta, mask=rows_ok)
    tl.store(Lse2 + out_offsets, lse2, mask=rows_ok)


@triton.jit
def zero_words_of_program(Zero, pid, zero_words, zero_chunk, ZERO_BLOCK: tl.constexpr):
    """Program ``pid``'s chunk of the zero_words float32 words at Zero: [pid * zero_chunk, (pid + 1) * zero_chunk)."""
    first = pid.to(tl.int64) * zero_chunk
    end = tl.minimum(first + zero_chunk, zero_words)
    zeros = tl.zeros([ZERO_BLOCK], tl.float32)
    for start in range(first, end, ZERO_BLOCK):
        offs = start + tl.arange(0, ZERO_BLOCK)
        tl.store(Zero + offs, zeros, mask=offs < end)


@triton.jit
def add_dq_share(dq_acc, dq_desc, ds_t, k, start_m, offs_m, offs_d, seqlen_q, sm_scale, stride_dqm,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DQ_MODE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Add this step's share of dQ, scale * dS K ((BLOCK_M, BLOCK_D) fp32), into the float32 buffer:
    DQ_MODE 1 with one atomic per element (rows past Nq and padding columns skipped), 2 with one bulk
    reduce-add of the tile through the descriptor (the copy engine clips what lies outside); DQ_MODE 3 stores it
    as dQ itself (in dq_acc's dtype): the share of a head's only key block is all of it."""
    dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * sm_scale
    if DQ_MODE == 2:
        dq_desc.atomic_add([start_m, 0], dq)
    else:
        ptrs = dq_acc + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :]
        inside = offs_m[:, None] < seqlen_q
        if BLOCK_D != HEAD_DIM:
            inside = inside & (offs_d[None, :] < HEAD_DIM)
        if DQ_MODE == 3:
            tl.store(ptrs, dq.to(dq_acc.dtype.element_ty), mask=inside)
        else:
            tl.atomic_add(ptrs, dq, mask=inside, sem="relaxed")


@triton.jit
def inline_lse2(lse_base, offs_m, seqlen_q):
    """The preprocess's lse2 of rows offs_m, from the forward's natural-log lse (contiguous rows): base 2, and +inf
    for rows that saw no key, so that exp2(s2 - lse2) is 0 there instead of NaN."""
    lse = tl.load(lse_base + offs_m, mask=offs_m < seqlen_q, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def dkdv_query_range(dk, dv, k, v, q_base, do_base, q_desc, do_desc, dq_acc, dq_desc, lse2_base, delta_base,
                     stride_qm, stride_dom, stride_dqm, stride_om,
                     start, end, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k,
                     qk_scale2, softcap_in2, softcap_out2, dropout_scale,
                     diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
                     rng_head_key, rng_cols, seed1, threshold,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                     MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                     DQ_MODE: tl.constexpr, sm_scale, ROWS_INLINE: tl.constexpr = False):
    """The dK/dV inner loop over query blocks [start, end) of one query head, in key-major tiles
    (BLOCK_N keys x BLOCK_M queries). dk (BLOCK_N, BLOCK_D), dv (BLOCK_N, BLOCK_DV) fp32, updated and
    returned; k, v the key block's tiles in the input dtype. DQ_MODE 0: dQ is left to the dQ kernel;
    1 / 2: each step adds its share into dq_acc (see :func:`add_dq_share`); 3: the key block is the head's only
    one, so its share is the whole of dQ, stored into dq_acc (dQ itself, rows stride_dqm apart).
    ROWS_INLINE (the short backward, no preprocess): lse2_base points at the forward's natural-log lse and delta_base
    at the output O (rows stride_om apart), and each step forms its rows' lse2 and delta itself."""
    offs_local = tl.arange(0, BLOCK_M)
    # Only the unmasked middle range is long enough for warp specialisation to pay.
    for start_m in tl.range(start, end, BLOCK_M, warp_specialize=WARP_SPECIALIZE and not MASKED):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_local
        q = load_block(q_desc, q_base, start_m, offs_local, stride_qm, offs_d, seqlen_q, HEAD_DIM, BLOCK_D,
                       MASKED, TMA)
        if ROWS_INLINE:
            lse2 = inline_lse2(lse2_base, offs_m, seqlen_q)
        elif MASKED:
            lse2 = tl.load(lse2_base + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
        else:
            lse2 = tl.load(lse2_base + offs_m)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        s2_t, tanh_t = attention_scores(qk_t, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k,
                                        qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left,
                                        window_right, mask_base, stride_mq, stride_mk,
                                        MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, MASK_KIND, k.dtype != tl.float32)
        p_t = tl.exp2(s2_t - lse2[None, :])
        do = load_block(do_desc, do_base, start_m, offs_local, stride_dom, offs_dv, seqlen_q, HEAD_DIM_V,
                        BLOCK_DV, MASKED, TMA)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep_t = keep_tile_transposed(row_keys(rng_head_key, offs_m, seed1), rng_cols, threshold)
            dv = tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(do.dtype), do, dv,
                        input_precision=DOT_PRECISION)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if ROWS_INLINE:
            o = load_block(do_desc, delta_base, start_m, offs_local, stride_om, offs_dv, seqlen_q, HEAD_DIM_V,
                           BLOCK_DV, True, False)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        elif MASKED:
            delta = tl.load(delta_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
        else:
            delta = tl.load(delta_base + offs_m)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        if DQ_MODE != 0:
            add_dq_share(dq_acc, dq_desc, ds_t, k, start_m, offs_m, offs_d, seqlen_q, sm_scale, stride_dqm,
                         HEAD_DIM, BLOCK_D, DQ_MODE, DOT_PRECISION)
    return dk, dv


@triton.jit
def load_key_block(K, V, batch, head_kv, key_rows, offs_n, offs_d, offs_dv, seqlen_k, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(k, v): the key block's rows key_rows of one (batch, key/value head), keys past seqlen_k read as 0."""
    k_ptrs = K + head_offset(batch, head_kv, stride_kb, stride_kh) + key_rows * stride_kn + offs_d[None, :]
    v_ptrs = V + head_offset(batch, head_kv, stride_vb, stride_vh) + key_rows * stride_vn + offs_dv[None, :]
    k = load_rows(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_rows(v_ptrs, offs_n, seqlen_k, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    return k, v


@triton.jit
def dropout_seeds(Seed, threshold, HAS_DROPOUT: tl.constexpr):
    """(seed0, seed1): the int64 seed tensor's low words (see the forward kernel); with no dropout, int32 scalars of
    the same type that nothing reads."""
    seed0 = threshold
    seed1 = threshold
    if HAS_DROPOUT:
        seed0 = tl.load(Seed)
        seed1 = tl.load(Seed + 2)
    return seed0, seed1


@triton.jit
def store_key_block_grads(dK, dV, dk, dv, sm_scale, batch, head_kv, key_rows, offs_n, offs_d, offs_dv, stored_keys,
                          stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_DV: tl.constexpr):
    """dK = scale * dk and dV = dv (fp32 sums) of the key block's rows key_rows, in dK's and dV's dtype; rows from
    stored_keys on (another batch entry's) and padding columns are not written."""
    dk = dk * sm_scale
    rows_ok = offs_n[:, None] < stored_keys
    dk_ptrs = (dK + head_offset(batch, head_kv, stride_dkb, stride_dkh)
               + key_rows * stride_dkn + offs_d[None, :])
    dv_ptrs = (dV + head_offset(batch, head_kv, stride_dvb, stride_dvh)
               + key_rows * stride_dvn + offs_dv[None, :])
    if BLOCK_D != HEAD_DIM:
        tl.store(dk_ptrs, dk.to(dK.dtype.element_ty), mask=rows_ok & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(dk_ptrs, dk.to(dK.dtype.element_ty), mask=rows_ok)
    if BLOCK_DV != HEAD_DIM_V:
        tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=rows_ok & (offs_dv[None, :] < HEAD_DIM_V))
    else:
        tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=rows_ok)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_n_blocks", "diag_offset", "window_left",
                               "window_right", "threshold", "stride_lb", "stride_lh"])
def backward_dkdv_kernel(
    Q, K, V, dOut, Lse2, Delta, dK, dV, dQacc, Mask, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_lb, stride_lh,
    heads_q, heads_kv, kv_group, seqlen_q, seqlen_k, num_n_blocks,
    qk_scale2, softcap_in2, softcap_out2, dropout_scale, sm_scale,
    diag_offset, window_left, window_right,
    Seed, threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False, DQ_MODE: tl.constexpr = 0,
    VARLEN: tl.constexpr = False, KEY_LENGTHS: tl.constexpr = False,
):
    """dK (B, Hkv, Nk, D) and dV (B, Hkv, Nk, Dv) in the input dtype. Lse2 and Delta (B, Hq, Nq) fp32 from
    the preprocess, by (stride_lb, stride_lh), rows contiguous. With DQ_MODE 1 or 2, dQacc (B, Hq, Nq, D)
    fp32 contiguous, zeroed, receives scale * dS K. Grid: (B * Hkv * cdiv(Nk, BLOCK_N),).
    VARLEN: packed sequences, as in the forward kernel (a key block past its sequence's end exits; DQ_MODE 0).
    KEY_LENGTHS: keys past the batch entry's bound get dK = dV = 0 without visiting any query."""
    pid = tl.program_id(0)
    batch_head_kv = pid // num_n_blocks
    start_n = (pid % num_n_blocks) * BLOCK_N
    batch = batch_head_kv // heads_kv
    head_kv = batch_head_kv % heads_kv
    stored_keys = seqlen_k  # the rows of dK / dV this batch entry owns, whatever the key bound
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, VARLEN,
                                                           KEY_LENGTHS)
    if VARLEN:
        stored_keys = seqlen_k
        if start_n >= seqlen_k:
            return

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    key_rows = (k_start + offs_n)[:, None].to(tl.int64)
    k, v = load_key_block(K, V, batch, head_kv, key_rows, offs_n, offs_d, offs_dv, seqlen_k, stride_kb, stride_kh,
                          stride_kn, stride_vb, stride_vh, stride_vn, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    rng_cols = column_hashes(offs_n)
    seed0, seed1 = dropout_seeds(Seed, threshold, HAS_DROPOUT)

    lo, full_lo, full_hi, hi = key_major_ranges(start_n, seqlen_q, seqlen_k, diag_offset, window_left,
                                                window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if KEY_LENGTHS:  # a key block wholly past the bound: no query sees it
        past = start_n >= seqlen_k
        hi = tl.where(past, lo, hi)
        full_lo = tl.where(past, lo, full_lo)
        full_hi = tl.where(past, lo, full_hi)
    # The query heads sharing this key/value head, one after the other in a fixed order (deterministic).
    for group_index in range(0, kv_group):
        head = head_kv * kv_group + group_index
        batch_head = batch * heads_q + head
        q_base = Q + head_offset(batch, head, stride_qb, stride_qh) + q_start.to(tl.int64) * stride_qm
        do_base = (dOut + head_offset(batch, head, stride_dob, stride_doh)
                   + q_start.to(tl.int64) * stride_dom)
        row_base = head_offset(batch, head, stride_lb, stride_lh) + q_start
        lse2_base = Lse2 + row_base
        delta_base = Delta + row_base
        mask_base = Mask + head_offset(batch, head, stride_mb, stride_mh)
        rng_head_key = head_key(batch_head, seed0)
        q_desc = head_descriptor(q_base, seqlen_q, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        do_desc = head_descriptor(do_base, seqlen_q, stride_dom, HEAD_DIM_V, BLOCK_M, BLOCK_DV, TMA)
        dq_base = dQacc + batch_head.to(tl.int64) * seqlen_q * HEAD_DIM
        dq_desc = head_descriptor(dq_base, seqlen_q, HEAD_DIM, HEAD_DIM, BLOCK_M, BLOCK_D, DQ_MODE == 2)
        # Query blocks above the causal diagonal / before the window's right edge: masked.
        if HAS_RIGHT:
            dk, dv = dkdv_query_range(
                dk, dv, k, v, q_base, do_base, q_desc, do_desc, dq_base, dq_desc, lse2_base, delta_base,
                stride_qm, stride_dom, HEAD_DIM, 0, lo, full_lo,
                offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2,
                dropout_scale, diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
                rng_head_key, rng_cols, seed1, threshold,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, HAS_LEFT, HAS_RIGHT,
                HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, DOT_PRECISION, TMA, WARP_SPECIALIZE, DQ_MODE, sm_scale)
        dk, dv = dkdv_query_range(
            dk, dv, k, v, q_base, do_base, q_desc, do_desc, dq_base, dq_desc, lse2_base, delta_base,
                stride_qm, stride_dom, HEAD_DIM, 0, full_lo, full_hi,
            offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2,
            dropout_scale, diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
            rng_head_key, rng_cols, seed1, threshold,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, False, HAS_LEFT, HAS_RIGHT,
            HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, DOT_PRECISION, TMA, WARP_SPECIALIZE, DQ_MODE, sm_scale)
        # The window's left edge, the ragged query end, the ragged key block: masked.
        dk, dv = dkdv_query_range(
            dk, dv, k, v, q_base, do_base, q_desc, do_desc, dq_base, dq_desc, lse2_base, delta_base,
                stride_qm, stride_dom, HEAD_DIM, 0, full_hi, hi,
            offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2,
            dropout_scale, diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
            rng_head_key, rng_cols, seed1, threshold,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, HAS_LEFT, HAS_RIGHT,
            HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, DOT_PRECISION, TMA, WARP_SPECIALIZE, DQ_MODE, sm_scale)

    store_key_block_grads(dK, dV, dk, dv, sm_scale, batch, head_kv, key_rows, offs_n, offs_d, offs_dv, stored_keys,
                          stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "diag_offset", "window_left", "window_right", "threshold"])
def backward_short_kernel(
    Q, K, V, Out, dOut, Lse, dQ, dK, dV, Mask, KeyBounds,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_lb, stride_lh,
    heads_q, heads_kv, kv_group, seqlen_q, seqlen_k,
    qk_scale2, softcap_in2, softcap_out2, dropout_scale, sm_scale,
    diag_offset, window_left, window_right,
    Seed, threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, KEY_LENGTHS: tl.constexpr = False,
):
    """The whole backward of a short problem, all its keys in one block (Nk <= BLOCK_N), in one launch: dQ (B, Hq,
    Nq, D), dK (B, Hkv, Nk, D) and dV (B, Hkv, Nk, Dv) in the input dtype, by their strides, from Q, K, V, the
    output O, its gradient dO and the forward's natural-log Lse (B, Hq, Nq; rows contiguous, by (stride_lb,
    stride_lh)). One program per (batch, key/value head) walks every query block of every query head of its group, as
    the dK/dV kernel's program of a key block does, with two differences that the single key block allows: each step
    forms its rows' lse2 and delta = rowsum(dO * O) itself (no preprocess launch, no scratch), and stores its rows'
    dQ = scale * dS K outright (nothing else adds to them: no dQ kernel, no float32 buffer to zero and convert).
    Every query block is visited and masked throughout, so rows that see no key get dQ = 0. Each gradient element
    is written by one program in a fixed order: bitwise reproducible. Grid: (B * Hkv,)."""
    batch_head_kv = tl.program_id(0)
    batch = batch_head_kv // heads_kv
    head_kv = batch_head_kv % heads_kv
    stored_keys = seqlen_k  # the rows of dK / dV this batch entry owns, whatever the key bound
    _, _, seqlen_q, seqlen_k = sequence_bounds(KeyBounds, KeyBounds, batch, seqlen_q, seqlen_k, False, KEY_LENGTHS)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_rows = offs_n[:, None].to(tl.int64)
    k, v = load_key_block(K, V, batch, head_kv, key_rows, offs_n, offs_d, offs_dv, seqlen_k, stride_kb, stride_kh,
                          stride_kn, stride_vb, stride_vh, stride_vn, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    rng_cols = column_hashes(offs_n)
    seed0, seed1 = dropout_seeds(Seed, threshold, HAS_DROPOUT)
    for group_index in range(0, kv_group):
        head = head_kv * kv_group + group_index
        batch_head = batch * heads_q + head
        q_base = Q + head_offset(batch, head, stride_qb, stride_qh)
        do_base = dOut + head_offset(batch, head, stride_dob, stride_doh)
        o_base = Out + head_offset(batch, head, stride_ob, stride_oh)
        dq_base = dQ + head_offset(batch, head, stride_dqb, stride_dqh)
        lse_base = Lse + head_offset(batch, head, stride_lb, stride_lh)
        mask_base = Mask + head_offset(batch, head, stride_mb, stride_mh)
        dk, dv = dkdv_query_range(
            dk, dv, k, v, q_base, do_base, q_base, do_base, dq_base, dq_base, lse_base, o_base,
            stride_qm, stride_dom, stride_dqm, stride_om, 0, seqlen_q,
            offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2,
            dropout_scale, diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
            head_key(batch_head, seed0), rng_cols, seed1, threshold,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, HAS_LEFT, HAS_RIGHT,
            HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, DOT_PRECISION, False, False, 3, sm_scale, True)

    store_key_block_grads(dK, dV, dk, dv, sm_scale, batch, head_kv, key_rows, offs_n, offs_d, offs_dv, stored_keys,
                          stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)


@triton.jit
def dq_key_range(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                 start, end, offs_m, offs_d, offs_dv, seqlen_q, seqlen_k,
                 qk_scale2, softcap_in2, softcap_out2, dropout_scale,
                 diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
                 dmask_base, stride_dmq, rng_rows, threshold,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 MASK_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The dQ inner loop over key blocks [start, end): dq (BLOCK_M, BLOCK_D) fp32 updated and returned.
    With MASK_GRAD, writes dS (before the softcap chain) of each tile into the fp32 dmask buffer."""
    offs_local = tl.arange(0, BLOCK_N)
    k_offsets = offs_local[:, None] * stride_kn + offs_d[None, :]
    v_offsets = offs_local[:, None] * stride_vn + offs_dv[None, :]
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_local
        k = load_rows(k_base + start_n.to(tl.int64) * stride_kn + k_offsets, offs_n, seqlen_k, offs_d,
                      HEAD_DIM, BLOCK_D, MASKED)
        v = load_rows(v_base + start_n.to(tl.int64) * stride_vn + v_offsets, offs_n, seqlen_k, offs_dv,
                      HEAD_DIM_V, BLOCK_DV, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s2, tanh = attention_scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k,
                                    qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left, window_right,
                                    mask_base, stride_mq, stride_mk,
                                    MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, MASK_KIND, k.dtype != tl.float32)
        p = tl.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = keep_tile(rng_rows, column_hashes(offs_n), threshold)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if MASK_GRAD:
            inside = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
            tl.store(dmask_base + offs_m[:, None].to(tl.int64) * stride_dmq + offs_n[None, :], ds, mask=inside)
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_m_blocks", "diag_offset", "window_left",
                               "window_right", "threshold", "stride_lb", "stride_lh"])
def backward_dq_kernel(
    Q, K, V, dOut, Lse2, Delta, dQ, Mask, dMask, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_lb, stride_lh,
    heads_q, kv_group, seqlen_q, seqlen_k, num_m_blocks,
    qk_scale2, softcap_in2, softcap_out2, dropout_scale, sm_scale,
    diag_offset, window_left, window_right,
    Seed, threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr, HEAVY_FIRST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr = False, KEY_LENGTHS: tl.constexpr = False,
):
    """dQ (B, Hq, Nq, D) in the input dtype; dMask (B, Hq, Nq, Nk) fp32 contiguous when MASK_GRAD.
    Lse2/Delta as in the dK/dV kernel. Grid: (B * Hq * cdiv(Nq, BLOCK_M),). VARLEN: packed sequences."""
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
        if start_m >= seqlen_q:
            return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows_ok = offs_m < seqlen_q

    query_rows = (q_start + offs_m)[:, None].to(tl.int64)
    q_ptrs = Q + head_offset(batch, head, stride_qb, stride_qh) + query_rows * stride_qm + offs_d[None, :]
    do_ptrs = (dOut + head_offset(batch, head, stride_dob, stride_doh)
               + query_rows * stride_dom + offs_dv[None, :])
    q = load_rows(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_rows(do_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    row_offsets = head_offset(batch, head, stride_lb, stride_lh) + q_start + offs_m
    lse2 = tl.load(Lse2 + row_offsets, mask=rows_ok, other=float("inf"))
    delta = tl.load(Delta + row_offsets, mask=rows_ok, other=0.0)

    k_base = K + head_offset(batch, head_kv, stride_kb, stride_kh) + k_start.to(tl.int64) * stride_kn
    v_base = V + head_offset(batch, head_kv, stride_vb, stride_vh) + k_start.to(tl.int64) * stride_vn
    mask_base = Mask + head_offset(batch, head, stride_mb, stride_mh)
    dmask_base = dMask + batch_head.to(tl.int64) * seqlen_q * seqlen_k
    rng_rows = offs_m.to(tl.uint32)
    if HAS_DROPOUT:
        rng_rows = row_keys(head_key(batch_head, tl.load(Seed)), offs_m, tl.load(Seed + 2))
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = query_major_ranges(start_m, seqlen_q, seqlen_k, diag_offset, window_left,
                                                  window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_LEFT:
        dq = dq_key_range(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, lo, full_lo,
                          offs_m, offs_d, offs_dv, seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2,
                          dropout_scale, diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
                          dmask_base, seqlen_k, rng_rows, threshold,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                          HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, MASK_GRAD, DOT_PRECISION)
    dq = dq_key_range(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, full_lo, full_hi,
                      offs_m, offs_d, offs_dv, seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2,
                      dropout_scale, diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
                      dmask_base, seqlen_k, rng_rows, threshold,
                      HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                      HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, MASK_GRAD, DOT_PRECISION)
    dq = dq_key_range(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, full_hi, hi,
                      offs_m, offs_d, offs_dv, seqlen_q, seqlen_k, qk_scale2, softcap_in2, softcap_out2,
                      dropout_scale, diag_offset, window_left, window_right, mask_base, stride_mq, stride_mk,
                      dmask_base, seqlen_k, rng_rows, threshold,
                      HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                      HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, MASK_GRAD, DOT_PRECISION)

    dq = dq * sm_scale
    dq_ptrs = (dQ + head_offset(batch, head, stride_dqb, stride_dqh)
               + query_rows * stride_dqm + offs_d[None, :])
    if BLOCK_D != HEAD_DIM:
        tl.store(dq_ptrs, dq.to(dQ.dtype.element_ty), mask=rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(dq_ptrs, dq.to(dQ.dtype.element_ty), mask=rows_ok[:, None])
