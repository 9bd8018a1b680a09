"""Split-KV decoding kernels: attention of a few query rows over many keys, contiguous or paged.

With one query row per head, one program per (batch, head) leaves most of the GPU idle and reads each
key/value head once per query head. Here:

- the query rows of all query heads sharing one key/value head are packed into the rows of one tile
  (row r = group_index * Nq + i), so K and V are read once per group;
- the keys of one (batch, key/value head) are split over ``num_splits`` programs; each runs the online
  softmax of the forward kernel over its share and writes a normalised partial output and its
  log-sum-exp; :func:`combine_splits_kernel` then merges the splits by their LSE:

      lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * out_s

- a paged cache is read through the block table (page = table[j // PAGE_SIZE], row j % PAGE_SIZE), one entry per
  key, so any block size works; where the keys are split and the pages hold whole key blocks (PAGE_SIZE a multiple of
  BLOCK_N; a program's blocks start at multiples of BLOCK_N), one entry per block (BLOCK_IN_PAGE). On the H100 that
  took short split steps from 1.18-1.21x to 1.01-1.09x of the contiguous cache's time, but unsplit steps (B = 64)
  from 1.01x to 1.13-1.15x, so those keep the entry per key (NOTES); a contiguous cache is the same code with the
  batch as page.

A decoding step through mhattn.attention_with_kvcache that appends new keys and values has the split kernel write
them into the cache itself (APPEND, the backend's forward_kvcache_appending): each program writes the new rows of its
share before reading it, so the step launches nothing for its append. :func:`append_kv_kernel` writes them (and the
key counts after it) in a launch of its own, for the backend's append_kvcache.

Grid of :func:`split_kv_kernel`: (B * Hkv, num_splits, row blocks). With one split the kernel writes the
final output and LSE itself and no combine runs.

On sm_90 the combine is a programmatic dependent launch (decode_launch.DEPENDENT_LAUNCH): the split kernel lets it
launch as soon as all of its programs have started (RELEASE_DEPENDENTS), and the combine's programs wait at their
start for the split kernel to finish and its writes to be visible (WAIT_PRIMARY), so the combine's launch overlaps
the splits instead of following them.
"""

import triton
import triton.language as tl

try:  # programmatic dependent launch (Triton 3.3 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: decode_launch never sets the flags that reach these
    gdc_launch_dependents = gdc_wait = None

from mhattn.backends.triton.forward import head_offset
from mhattn.backends.triton.scores import LN2, LOG2E, attention_scores, with_key_mask


@triton.jit
def load_key_tile(base, page_base, stride_table_block, start_n, offs_n, ok_n, offs_d, stride_page, stride_row,
                  DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_IN_PAGE: tl.constexpr):
    """Rows offs_n = start_n + [0, BLOCK_N) of one sequence's keys (or values) as a (BLOCK_N, BLOCK) tile; rows where
    ok_n is False and head-dim padding read as 0. ``base`` already points at the (sequence or pool, head) start;
    ``page_base`` at the sequence's block-table row when PAGED (its entries ``stride_table_block`` apart).
    BLOCK_IN_PAGE (PAGE_SIZE a multiple of BLOCK_N, and start_n a multiple of BLOCK_N): the block lies in one page, so
    one table entry gives its rows, in a run."""
    if PAGED:
        if BLOCK_IN_PAGE:
            page = tl.load(page_base + (start_n // PAGE_SIZE) * stride_table_block).to(tl.int64)
            in_page = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
            rows = page * stride_page + in_page.to(tl.int64) * stride_row
        else:
            page = tl.load(page_base + (offs_n // PAGE_SIZE) * stride_table_block, mask=ok_n, other=0).to(tl.int64)
            rows = page * stride_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_row
    else:
        rows = offs_n.to(tl.int64) * stride_row
    mask = ok_n[:, None]
    if BLOCK != DIM:
        mask = mask & (offs_d[None, :] < DIM)
    return tl.load(base + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def key_mask_row(mask_base, offs_n, end, stride_mk):
    """A key mask's values for keys offs_n; keys from ``end`` on read as 0 (the band masks them anyway), so a split
    reads no key past its share, nor any where its share is empty."""
    return tl.load(mask_base + offs_n.to(tl.int64) * stride_mk, mask=offs_n < end, other=0)


@triton.jit
def write_new_rows(NewK, NewV, stride_nk, stride_nv, k_head, v_head, page_base, stride_table_block, slot, rows,
                   positions, ok, capacity, num_blocks, stride_kslot, stride_kn, stride_vslot, stride_vn,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Copy new rows ``rows`` of one (batch, key/value head) -- NewK / NewV rows ``stride_nk`` / ``stride_nv`` apart
    from that head's first -- into the cache at ``positions``, where ``ok``. ``k_head`` / ``v_head`` point at the
    cache's head; a contiguous cache's sequence is slot ``slot`` (its batch index), a paged one's rows go through
    the block-table row at ``page_base`` (entries ``stride_table_block`` apart). A row whose position lies past the
    cache's ``capacity``, or whose table entry lies outside the pool's ``num_blocks``, is not written: the host checks
    both first, but not while a CUDA graph is captured."""
    ok = ok & (positions >= 0) & (positions < capacity)
    if PAGED:
        slot = tl.load(page_base + (positions // PAGE_SIZE) * stride_table_block, mask=ok, other=0)
        ok = ok & (slot >= 0) & (slot < num_blocks)
        in_slot = positions % PAGE_SIZE
    else:
        in_slot = positions
    slot = slot.to(tl.int64)
    in_slot = in_slot.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    v_mask = ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    new_k = tl.load(NewK + rows.to(tl.int64)[:, None] * stride_nk + offs_d[None, :], mask=k_mask)
    new_v = tl.load(NewV + rows.to(tl.int64)[:, None] * stride_nv + offs_dv[None, :], mask=v_mask)
    tl.store(k_head + (slot * stride_kslot + in_slot * stride_kn)[:, None] + offs_d[None, :], new_k, mask=k_mask)
    tl.store(v_head + (slot * stride_vslot + in_slot * stride_vn)[:, None] + offs_dv[None, :], new_v, mask=v_mask)


# The cache's capacity and the pool's size only bound the append's writes: not specialised, so a cache of one
# sequence or one block compiles no variant of its own.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "diag_offset", "window_left", "window_right", "capacity",
                               "num_blocks"])
def split_kv_kernel(
    Q, K, V, Out, Lse, OutSplit, LseSplit, Seqlens, BlockTable, NewK, NewV, Mask,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_table, stride_table_block, stride_seqlens,
    stride_nkb, stride_nkh, stride_nkn, stride_nvb, stride_nvh, stride_nvn, capacity, num_blocks,
    stride_mb, stride_mh, stride_mq, stride_mk,
    heads_q, heads_kv, kv_group, seqlen_q, seqlen_k, num_splits,
    qk_scale2, softcap_in2, softcap_out2,
    diag_offset, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, RELEASE_DEPENDENTS: tl.constexpr = False,
    APPEND: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
):
    """Q (B, Hq, Nq, D) and Out (B, Hq, Nq, Dv) by strides, last dim contiguous; Lse (B, Hq, Nq) fp32
    contiguous. K/V: contiguous (B, Hkv, Nk, D) (stride_kb per sequence), or with PAGED a pool
    (num_blocks, Hkv, PAGE_SIZE, D) (stride_kb per block) and BlockTable (B, max_blocks) int32 (strides
    stride_table, stride_table_block).
    HAS_SEQLENS: sequence b attends over its first Seqlens[b] keys (Seqlens by stride_seqlens) with its diagonal at
    Seqlens[b] - Nq; else over seqlen_k keys with the diagonal at diag_offset.
    APPEND (with HAS_SEQLENS): Seqlens[b] counts the keys before this step's Nq new ones, NewK (B, Hkv, Nq, D) and
    NewV (B, Hkv, Nq, Dv), which the kernel writes into the cache at positions Seqlens[b] .. Seqlens[b] + Nq - 1 (of
    ``capacity`` a sequence; a paged pool has ``num_blocks`` blocks) before attending over Seqlens[b] + Nq keys: the
    step's append without a launch of its own (append_kv_kernel). Each program first writes the new rows that fall in
    its share of the keys (and the first split's first row block every new row, so the cache gets each row even where
    no program attends to it), then waits at a barrier of its threads: the rows it reads it wrote itself, so no
    program waits for another. Two programs may write one row; they write the same bytes.
    SPLIT: write OutSplit (B*Hq*Nq, num_splits, Dv) and LseSplit (B*Hq*Nq, num_splits) fp32 for
    :func:`combine_splits_kernel` instead of Out/Lse.
    MASK_KIND (0: none): an attn_mask, boolean (scores.MASK_BOOL) or additive (MASK_FLOAT), each key block reading its
    rows' entries (attention_scores), each row from its own query head's (a per-head bias such as ALiBi's); or a
    key-padding mask or bias (MASK_KEYS, MASK_KEYS_FLOAT), the same for every head and query row (a decoding step's
    padding mask (B, 1, 1, Nk)), each key block's row of it read one block ahead (key_mask_row). Batch entry b's entry
    for query head h, query position i and key j is at Mask + b * stride_mb + h * stride_mh + i * stride_mq + j *
    stride_mk (stride_mh not read with the key masks). Without it Mask is not read.
    RELEASE_DEPENDENTS (sm_90): the next kernel, launched as a programmatic dependent, may start now (it waits for
    this one's writes itself)."""
    if RELEASE_DEPENDENTS:
        gdc_launch_dependents()
    batch_head_kv = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    batch = batch_head_kv // heads_kv
    head_kv = batch_head_kv % heads_kv

    if HAS_SEQLENS:
        seqlen_k = tl.load(Seqlens + batch * stride_seqlens)
        if APPEND:
            seqlen_k += seqlen_q
        diag_offset = seqlen_k - seqlen_q

    # Packed rows: row r is query position r % Nq of query head head_kv * kv_group + r // Nq.
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    num_rows = kv_group * seqlen_q
    row_ok = rows < num_rows
    q_pos = rows % seqlen_q
    head = head_kv * kv_group + rows // seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = head_offset(batch, head, stride_qb, stride_qh) + q_pos.to(tl.int64) * stride_qm
    q_mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=q_mask, other=0.0)

    # The keys any row of this block may see: [lo, hi) from the band of its first and last query positions.
    first_row = row_block * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, num_rows) - 1
    one_head = first_row // seqlen_q == last_row // seqlen_q
    pos_min = tl.where(one_head, first_row % seqlen_q, 0)
    pos_max = tl.where(one_head, last_row % seqlen_q, seqlen_q - 1)
    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        # Down to a whole key block (load_key_tile reads blocks from multiples of BLOCK_N); the keys before the
        # window's left end are masked like any other.
        lo = tl.maximum(pos_min + diag_offset - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(pos_max + diag_offset + window_right + 1, 0))
    hi = tl.maximum(hi, lo)
    # This program's share: a whole number of key blocks.
    per_split = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    start = tl.minimum(lo + split * per_split, hi)
    end = tl.minimum(start + per_split, hi)

    k_base = K + head_kv.to(tl.int64) * stride_kh
    v_base = V + head_kv.to(tl.int64) * stride_vh
    page_base = BlockTable + batch.to(tl.int64) * stride_table
    if not PAGED:
        k_base += batch.to(tl.int64) * stride_kb
        v_base += batch.to(tl.int64) * stride_vb

    if APPEND:
        # The first split's first row block writes every new row (a mask of the rows' shape: Triton's interpreter
        # gives an int32 mask where a scalar is OR-ed into one).
        writes_all = tl.zeros([BLOCK_N], dtype=tl.int32) + split + row_block == 0
        new_k = NewK + head_offset(batch, head_kv, stride_nkb, stride_nkh)
        new_v = NewV + head_offset(batch, head_kv, stride_nvb, stride_nvh)
        for first_new in range(0, seqlen_q, BLOCK_N):
            new_rows = first_new + tl.arange(0, BLOCK_N)
            positions = diag_offset + new_rows
            mine = ((positions >= start) & (positions < end)) | writes_all
            write_new_rows(new_k, new_v, stride_nkn, stride_nvn, K + head_kv.to(tl.int64) * stride_kh,
                           V + head_kv.to(tl.int64) * stride_vh, page_base, stride_table_block, batch, new_rows,
                           positions, (new_rows < seqlen_q) & mine, capacity, num_blocks, stride_kb, stride_kn,
                           stride_vb, stride_vn, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, PAGED, PAGE_SIZE)
        tl.debug_barrier()  # this program's rows are in the cache before its threads read them

    # One block-table entry a key block where the keys are split (see the module docstring for the measurements).
    BLOCK_IN_PAGE: tl.constexpr = PAGED and SPLIT and PAGE_SIZE % BLOCK_N == 0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    offs_local = tl.arange(0, BLOCK_N)
    mask_base = Mask + batch.to(tl.int64) * stride_mb  # (read with MASK_KIND only)
    KEY_MASK: tl.constexpr = MASK_KIND == 3 or MASK_KIND == 4
    row_mask_base = mask_base  # a key mask: one row for all; else each row's query head's entries
    if MASK_KIND == 1 or MASK_KIND == 2:
        row_mask_base = mask_base + (head.to(tl.int64) * stride_mh)[:, None]
    if KEY_MASK:
        # A key block's row of a key mask is loaded one block ahead (key_mask_row), under the block before's softmax
        # and P V: loaded after its scores' product, its latency stood in every step. (A mask of the rows' own entries
        # is read where its scores are; its d = 64 build spills 24 bytes a thread so, and prefetched as well.)
        key_mask = key_mask_row(mask_base, start + offs_local, end, stride_mk)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_local
        ok_n = offs_n < end
        k = load_key_tile(k_base, page_base, stride_table_block, start_n, offs_n, ok_n, offs_d, stride_kb, stride_kn,
                          HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE, BLOCK_IN_PAGE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        # seqlen_k = end: keys past this split's share are masked like keys past the sequence.
        s2, _ = attention_scores(qk, q_pos[:, None], offs_n[None, :], seqlen_q, end,
                                 qk_scale2, softcap_in2, softcap_out2, diag_offset, window_left, window_right,
                                 row_mask_base, stride_mq, stride_mk, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                 0 if KEY_MASK else MASK_KIND, k.dtype != tl.float32)
        if KEY_MASK:
            s2 = with_key_mask(s2, key_mask[None, :], MASK_KIND)
            key_mask = key_mask_row(mask_base, offs_n + BLOCK_N, end, stride_mk)
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet stays at 0
        p = tl.exp2(s2 - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_key_tile(v_base, page_base, stride_table_block, start_n, offs_n, ok_n, offs_dv, stride_vb, stride_vn,
                          HEAD_DIM_V, BLOCK_DV, BLOCK_N, PAGED, PAGE_SIZE, BLOCK_IN_PAGE)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    out_row = (batch * heads_q + head).to(tl.int64) * seqlen_q + q_pos  # row of (B*Hq*Nq)
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    if SPLIT:
        part = out_row * num_splits + split
        tl.store(OutSplit + part[:, None] * HEAD_DIM_V + offs_dv[None, :], out, mask=row_ok[:, None] & dv_ok)
        tl.store(LseSplit + part, lse, mask=row_ok)
    else:
        o_rows = head_offset(batch, head, stride_ob, stride_oh) + q_pos.to(tl.int64) * stride_om
        o_ptrs = Out + o_rows[:, None] + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        tl.store(Lse + out_row, lse, mask=row_ok)


@triton.jit
def combine_splits_kernel(
    Out, Lse, OutSplit, LseSplit,
    stride_ob, stride_oh, stride_om,
    heads_q, seqlen_q, num_splits,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, WAIT_PRIMARY: tl.constexpr = False,
):
    """Merge the splits of one query row (one program per row of B*Hq*Nq): out = sum_s w_s out_s with
    w_s = exp(lse_s - lse), lse = log sum_s exp(lse_s). A row no split saw gives 0 and lse -inf.
    WAIT_PRIMARY (sm_90, launched as a programmatic dependent of the split kernel): wait for the split kernel to
    finish and its writes to be visible before reading them."""
    if WAIT_PRIMARY:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < num_splits
    lse_s = tl.load(LseSplit + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((lse_s - m_shift) * LOG2E)
    total = tl.sum(w, 0)
    parts = tl.load(OutSplit + (row * num_splits + offs_s)[:, None] * HEAD_DIM_V + offs_dv[None, :],
                    mask=s_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    empty = total == 0.0
    out = tl.sum(parts * w[:, None], 0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), m_shift + tl.log(tl.where(empty, 1.0, total)))

    batch_head = row // seqlen_q
    q_pos = row % seqlen_q
    batch = batch_head // heads_q
    head = batch_head % heads_q
    o_ptrs = Out + batch * stride_ob + head * stride_oh + q_pos * stride_om + offs_dv
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    tl.store(Lse + row, lse)


@triton.jit(do_not_specialize=["capacity", "num_blocks"])
def append_kv_kernel(
    K, V, KCache, VCache, CacheSeqlens, Seqlens, BlockTable,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_kcb, stride_kch, stride_kcn, stride_vcb, stride_vch, stride_vcn,
    stride_seqlens, stride_table, stride_table_block, heads_kv, seqlen_q, capacity, num_blocks,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """A decoding step's append in one launch: K (B, Hkv, Nq, D) and V (B, Hkv, Nq, Dv) written into the cache at
    positions CacheSeqlens[b] + i of each sequence b, and Seqlens[b] = CacheSeqlens[b] + Nq (int32, B): the key
    counts the step then attends over. KCache/VCache: contiguous (B, Hkv, Nmax, D) (stride_kcb per sequence), or with
    PAGED a pool (num_blocks, Hkv, PAGE_SIZE, D) (stride_kcb per block) read through BlockTable (B, max_blocks) int32
    (strides stride_table, stride_table_block). CacheSeqlens by stride_seqlens. The heads' last dims contiguous.
    Grid (B * Hkv, cdiv(Nq, BLOCK_M)): a program writes BLOCK_M rows of one (batch, head). (The split kernel's
    APPEND does the same inside the step's attention, one launch fewer.)"""
    batch_head = tl.program_id(0)
    row_block = tl.program_id(1)
    batch = batch_head // heads_kv
    head = batch_head % heads_kv
    start = tl.load(CacheSeqlens + batch * stride_seqlens)
    tl.store(Seqlens + batch, start + seqlen_q, mask=(head == 0) & (row_block == 0))

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    write_new_rows(K + head_offset(batch, head, stride_kb, stride_kh),
                   V + head_offset(batch, head, stride_vb, stride_vh), stride_kn, stride_vn,
                   KCache + head.to(tl.int64) * stride_kch, VCache + head.to(tl.int64) * stride_vch,
                   BlockTable + batch.to(tl.int64) * stride_table, stride_table_block, batch, rows, start + rows,
                   rows < seqlen_q, capacity, num_blocks, stride_kcb, stride_kcn, stride_vcb, stride_vcn,
                   HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, PAGED, PAGE_SIZE)
