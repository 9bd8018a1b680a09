"""The Hopper (sm_90) backward kernel, written in Gluon: dK, dV and dQ in one pass (FlashAttention-3's backward).

With P = exp2(S * qk_scale2 - lse2) recomputed from the saved log-sum-exp (base 2, from the preprocess kernel in
backward.py) and delta = rowsum(dO * O) - grad_lse:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)        dK = scale * dS^T Q        dQ = scale * dS K

One program owns BLOCK_N keys of one (batch, key/value head) and walks every query block of every query head
that shares that key/value head, in a fixed order; under GQA the query heads may instead be split over several
programs of the key block (PARTIAL_DK_DV), each adding its partial dK and dV into float32 sums. It runs three
partitions:

- a load warp: K and V of the block once, then each step's Q and dO tiles through the copy engine (TMA), with
  those rows' lse2 and delta beside them, into a ring of NUM_STAGES slots; ready/empty barriers are kept apart
  for Q and dO (S^T can start before dO lands);
- the compute partition (the kernel's 8 warps, two warpgroups). At head dims 64 and 128 each warpgroup owns 64
  of the 128 keys, and a step is BLOCK_M query rows (128 at d = 64, 64 at d = 128): per step S^T = K Q^T and
  dP^T = V dO^T as asynchronous wgmma products, P^T and dS^T in registers, dV += P^T dO and dK += dS^T Q with
  P^T / dS^T as register operands, then dS^T through shared memory into dQ_share = dS K (the two warpgroups
  split its columns), stored to shared memory for the writer. At head dim 256 (64 keys per program) the
  warpgroups split every product by columns and share P^T and dS^T through shared memory
  (wide_compute_partition);
- a dQ writer warp: adds each step's share (in chunks of at most 128 columns) into a float32 dQ buffer with the
  copy engine's bulk reduce-add, so the compute warps never wait on global atomics (two chunk buffers, each handed
  back once read).

At the end the compute warps write dK and dV: at head dims 128 and 256 through K's and V's shared tiles by the copy
engine (hopper_launch.BACKWARD_STAGED_DK_DV), at 64 from registers; with PARTIAL_DK_DV they add them from registers
into the float32 sums with paired float32 atomics, which the host converts after the launch. Splitting the group
gives a causal grid more, shorter programs (one walking all four query heads of a key block near the diagonal's start
is four times the longest program of the split grid), so the programs launched last leave fewer SMs idle at the end;
hopper_launch.backward_group_parts says where.

Where a (batch, key/value head)'s float32 dQ is small (hopper_launch.CONVERT_IN_KERNEL_MAX_BYTES), the program whose
additions to it come last (a counter per head) converts it into dQ after its partitions have finished, while other
programs still compute, instead of a pass over the whole buffer after the kernel.

The key-major layout keeps dK and dV in registers for the whole walk; dQ needs no second kernel and no second
computation of S and dP (5 products per tile instead of 7), at the price of an order of float32 additions that
varies between runs. A deterministic backward (DETERMINISTIC) fixes that order: each query block's shares are added by
its key blocks in their order, each waiting for its turn on a counter (dq_turn), as FlashAttention-3's deterministic
backward does.

Coverage (hopper_launch.why_not_backward routes the rest to backward.py): fp16 and bf16; head dims 64, 128 and 256, and
96 and 192 in the 128- and 256-wide tiles (HEAD_COLS; K and V the same); no mask, or causal of either alignment
(diag_offset); a sliding window's left bound (WINDOW), with the causal diagonal or no right bound; a right-padding key
mask as key counts (KEY_LENGTHS), and a left-padding one as first keys too (KEY_STARTS); dropout with the shared RNG
(DROPOUT); a softcap (SOFTCAP); GQA by head index; any Nq, Nk >= 1; 16-byte aligned rows; a fixed order of dQ's
additions on request (DETERMINISTIC).
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mhattn.backends.triton.hopper_forward import (LOAD_REGS, output_parts, scores_product, stage_columns,
                                                   thread_barrier, tile_layout, tma_load, tma_store, wgmma_layout)
# The dropout RNG's Triton functions, compiled as Gluon (hopper_forward.py says why that holds).
from mhattn.backends.triton.rng import column_hashes, head_key, keep_tile_transposed, row_keys
from mhattn.backends.triton.scores import softcap_tanh


def _tma_reduce_add_builtin():
    """The copy engine's bulk reduce-add of a shared-memory tile into global memory. Triton 3.9 names it
    tma.async_atomic_add; Triton 3.6 has the operation (what tl's descriptor.atomic_add lowers to) but no Gluon
    name for it, so it is made here from the same builder call."""
    if hasattr(tma, "async_atomic_add"):
        return tma.async_atomic_add
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def async_atomic_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

    return async_atomic_add


tma_reduce_add = _tma_reduce_add_builtin()

WRITER_REGS = gl.constexpr(24)  # the dQ writer warp only issues copies, like the load warp
COMPUTE_WARPS = gl.constexpr(8)


@gluon.jit
def visible_query_blocks(start_n, seqlen_q, diag_offset, window_left, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """(first_m, blocks): the first query block start that sees a key of [start_n, start_n + BLOCK_N) and how many
    blocks follow that see one."""
    first_m = 0
    if CAUSAL:  # query i sees key j when j <= i + diag_offset
        first_m = (gl.maximum(start_n - diag_offset, 0) // BLOCK_M) * BLOCK_M
    end_m = seqlen_q
    if WINDOW:  # ... and when j >= i + diag_offset - window_left: no query after the block's last key + window_left
        end_m = gl.minimum(seqlen_q, gl.maximum(start_n + BLOCK_N - diag_offset + window_left, 0))
    return first_m, gl.cdiv(gl.maximum(end_m - first_m, 0), BLOCK_M)


@gluon.jit
def step_place(step, walk, BLOCK_M: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """(query head after the program's first, first query row) of step ``step``. walk: (first_m, m_blocks, heads),
    the program's first visible query block, how many it sees, the query heads it walks. Each head's blocks in order,
    head after head; DETERMINISTIC: block-major in reverse, the heads of a block together, so that every program of a
    (batch, key/value head) adds to a query block of a head at the same step (a causal program starts at the last
    query block whatever its first; dq_turn's order then waits little)."""
    first_m, m_blocks, heads = walk
    if DETERMINISTIC:
        return step % heads, first_m + (m_blocks - 1 - step // heads) * BLOCK_M
    return step // m_blocks, first_m + (step % m_blocks) * BLOCK_M


@gluon.jit
def load_partition(k_desc, v_desc, q_desc, do_desc, lse2_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
                   lse2_smem, delta_smem, kv_ready, q_ready, q_empty, do_ready, do_empty, batch, head_kv, first_head,
                   start_n, walk, steps, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """The load warp: K and V once, then Q with its rows' lse2 and dO with their delta of step s (step_place) into
    slot s % NUM_STAGES once the compute partition has released that slot's previous tiles."""
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [batch, head_kv, start_n, 0], kv_ready, k_smem)
    tma_load(v_desc, [batch, head_kv, start_n, 0], kv_ready, v_smem)
    for step in range(steps):
        slot = step % NUM_STAGES
        head_step, start_m = step_place(step, walk, BLOCK_M, DETERMINISTIC)
        head = first_head + head_step
        # A fresh barrier counts as having completed the phase before its first: round 0 waits for nothing.
        free_phase = ((step // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(q_empty.index(slot), free_phase)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + lse2_desc.block_type.nbytes)
        tma_load(q_desc, [batch, head, start_m, 0], q_ready.index(slot), q_smem.index(slot))
        tma_load(lse2_desc, [batch, head, start_m], q_ready.index(slot), lse2_smem.index(slot))
        mbarrier.wait(do_empty.index(slot), free_phase)
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma_load(do_desc, [batch, head, start_m, 0], do_ready.index(slot), do_smem.index(slot))
        tma_load(delta_desc, [batch, head, start_m], do_ready.index(slot), delta_smem.index(slot))


@gluon.jit
def row_values(tile, BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
    """A (1, 1, BLOCK_M) float32 tile of per-query values (unswizzled) as a vector along S^T's columns."""
    return tile.reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))


@gluon.jit
def masked_scores_t(s2_t, keys, start_m, seqlen_k, diag_offset, window_left, BLOCK_M: gl.constexpr,
                    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, s_layout: gl.constexpr, key_start=0,
                    KEY_STARTS: gl.constexpr = False):
    """Base-2 scores, keys by rows and queries start_m.. by columns, with invisible pairs (a key past the sequence
    end, with KEY_STARTS before its first key key_start, after the query's diagonal, or with WINDOW more than
    window_left before it) at -inf. (The query indices are made here, only for the blocks that need them: at 128
    queries a step they take 32 registers a thread.)"""
    ok = gl.expand_dims(keys < seqlen_k, 1)
    if KEY_STARTS:
        ok = ok & gl.expand_dims(keys >= key_start, 1)
    if CAUSAL or WINDOW:
        columns = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout)), 0)
        if CAUSAL:
            ok = ok & (gl.expand_dims(keys - (start_m + diag_offset), 1) <= columns)
        if WINDOW:  # query start_m + c sees key j when j - start_m - diag_offset + window_left >= c
            ok = ok & (gl.expand_dims(keys - (start_m + diag_offset) + window_left, 1) >= columns)
    return gl.where(ok, s2_t, float("-inf"))


@gluon.jit
def dq_writer_partition(dq_desc, dq_smem, dq_ready, dq_empty, dq_added, batch, first_head, walk, steps, turns,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DQ_COLS: gl.constexpr, DQ_CHUNKS: gl.constexpr,
                        WINDOW: gl.constexpr, DETERMINISTIC: gl.constexpr, KEY_STARTS: gl.constexpr):
    """The dQ writer warp: each step's dQ share (DQ_CHUNKS column chunks of DQ_COLS), once the compute warps have
    put a chunk in shared memory, added into the float32 buffer by the copy engine's bulk reduce-add (rows past Nq
    are clipped); chunk i goes through buffer i % 2, handed back as soon as the copy engine has read it. At the
    end, once every addition has reached global memory, it arrives on dq_added. DETERMINISTIC: a step's share is
    added in its key block's turn on its query block (dq_turn, turns), and the turn is passed on once the additions
    have reached global memory."""
    for index in range(steps * DQ_CHUNKS):
        step = index // DQ_CHUNKS
        buf = index % 2
        head_step, start_m = step_place(step, walk, BLOCK_M, DETERMINISTIC)
        mbarrier.wait(dq_ready.index(buf), (index // 2) & 1)
        if DETERMINISTIC:
            turn = dq_turn(turns, head_step, start_m, BLOCK_M, BLOCK_N, WINDOW, KEY_STARTS)
            if index % DQ_CHUNKS == 0:
                wait_for_turn(turn[0], turn[1])
        tma_reduce_add(dq_desc, [batch, first_head + head_step, start_m, (index % DQ_CHUNKS) * DQ_COLS],
                       dq_smem.index(buf))
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(buf), count=1)
        if DETERMINISTIC:
            if index % DQ_CHUNKS == DQ_CHUNKS - 1:
                bulk_writes_done()
                gl.atomic_add(turn[0], 1, sem="release", scope="gpu")
    bulk_writes_done()
    mbarrier.arrive(dq_added, count=1)


@gluon.jit
def dq_turn(turns, head_step, start_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr,
            KEY_STARTS: gl.constexpr):
    """(counter, turn) of this key block's addition to query block start_m of the step's query head: the key blocks
    that see a query block are a run of consecutive ones (causal or not, with or without a window's left bound, and
    with per-sequence key counts the trailing ones see none), and they add in their order, so this block's turn is
    its number less that of the run's first block (0 but where a window's left bound, or with KEY_STARTS the block of
    the sequence's first key, moves the run's start: the blocks before walk no query block). turns: (the program's
    first query head's counters, query blocks per head, this key block's number, diag_offset - window_left, the block
    of the sequence's first key); head_step: the step's query head after the program's first."""
    counters, m_per_head, key_block, window_start, first_key_block = turns
    first_block = 0
    if WINDOW:  # the first key block whose last key reaches the window of the query block's first row
        first_block = gl.maximum(start_m + window_start, 0) // BLOCK_N
    if KEY_STARTS:
        first_block = gl.maximum(first_block, first_key_block)
    return counters + head_step * m_per_head + start_m // BLOCK_M, key_block - first_block


@gluon.jit
def wait_for_turn(counter, turn):
    """Spins until the int32 counter reads ``turn`` (an acquire of the additions of the key blocks before), then
    orders the copy engine's next operations after that read (the proxy fence)."""
    seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen != turn:
        seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def bulk_writes_done():
    """Waits until this thread's bulk copies have completed in global memory (tma.store_wait only waits until the
    copy engine has read shared memory), then orders them, made by the async proxy, before this thread's later
    ordinary memory operations (the proxy fence), so a release after it publishes them."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r",
                              [], dtype=gl.int32, is_pure=False, pack=1)


@triton.constexpr_function
def rows_layout(head_dim, warps):
    """A blocked layout for (rows, head_dim) tiles read and written row by row, four columns a thread."""
    col_threads = min(32, head_dim // 4)
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // col_threads, col_threads],
                            warps_per_cta=[warps, 1], order=[1, 0])


@gluon.jit
def convert_dq(dq_acc, dq_base, stride_dqh, stride_dqn, heads, seqlen_q, HEAD_DIM: gl.constexpr,
               HEAD_COLS: gl.constexpr):
    """dQ's float32 rows of ``heads`` query heads (Nq rows of HEAD_COLS each, contiguous from dq_acc) into dq_base
    (the first of those heads in dQ, with its head and row strides) in dQ's dtype, HEAD_DIM columns (the tile width)
    at a time. Read past L1: other programs' copies summed the rows in L2."""
    ROWS: gl.constexpr = 64
    layout: gl.constexpr = rows_layout(HEAD_DIM, COMPUTE_WARPS)
    cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout)), 0)
    for head in range(heads):
        source = dq_acc + head.to(gl.int64) * seqlen_q * HEAD_COLS
        target = dq_base + head.to(gl.int64) * stride_dqh
        for first in range(0, seqlen_q, ROWS):
            row = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            keep = gl.expand_dims(row < seqlen_q, 1)
            if HEAD_COLS < HEAD_DIM:
                keep = keep & (cols < HEAD_COLS)
            values = gl.load(source + gl.expand_dims(row * HEAD_COLS, 1) + cols, mask=keep, cache_modifier=".cg")
            gl.store(target + gl.expand_dims(row.to(gl.int64) * stride_dqn, 1) + cols,
                     values.to(target.dtype.element_ty), mask=keep)


@gluon.jit
def step_tiles(q_smem, do_smem, step, walk, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
               DETERMINISTIC: gl.constexpr):
    """Step ``step``'s ring slot, its barriers' phase, its query head after the program's first and first query row
    (step_place), and its Q and dO tiles."""
    slot = step % NUM_STAGES
    head_step, start_m = step_place(step, walk, BLOCK_M, DETERMINISTIC)
    return (slot, (step // NUM_STAGES) & 1, head_step, start_m, q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM]),
            do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM]))


@gluon.jit
def step_probabilities(k_smem, v_smem, q_tile, do_tile, q_ready, do_ready, lse2_smem, slot, phase, start_n, start_m,
                       keys, s_zero, seqlen_k, diag_offset, window_left, qk_scale2, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, s_layout: gl.constexpr,
                       softcap_in2, SOFTCAP: gl.constexpr, SPLIT: gl.constexpr, key_start=0,
                       KEY_STARTS: gl.constexpr = False):
    """One step's P^T (float32, keys by rows), its dP^T = V dO^T still on the tensor cores, and the scores' slope:
    S^T = K Q^T and dP^T are issued as soon as their tiles land, and the exponentials run while dP^T is computed.
    SOFTCAP: the scores are softcap * tanh(scale * S / softcap) (qk_scale2 is softcap * log2(e), softcap_in2 =
    2 * log2(e) * scale / softcap), and the slope 1 - tanh^2 is the factor the chain rule puts on dS (1.0 without).
    SPLIT: both products over the head dim's two parts only (hopper_forward.scores_product), not the zero fill.
    KEY_STARTS: keys before key_start (the sequence's first) are invisible too."""
    mbarrier.wait(q_ready.index(slot), phase)
    s_t = scores_product(k_smem, q_tile, s_zero, SPLIT)
    mbarrier.wait(do_ready.index(slot), phase)
    dp_t = scores_product(v_smem, do_tile, s_zero, SPLIT)
    # The step's lse2 and delta came with Q and dO (rows past Nq read 0: their Q and dO rows are 0 too, so
    # P^T dO, dS^T and dS K vanish there).
    lse2 = row_values(lse2_smem.index(slot), BLOCK_M, s_layout)
    s_t = warpgroup_mma_wait(output_parts(SPLIT), deps=(s_t, ))  # S^T done; dP^T may still run
    slope = 1.0
    if SOFTCAP:
        tanh_t = softcap_tanh(s_t * softcap_in2, True)  # (16-bit inputs only)
        s2_t = tanh_t * qk_scale2
        slope = 1.0 - tanh_t * tanh_t
    else:
        s2_t = s_t * qk_scale2
    # A step needs the mask where a key is past the end, a row's diagonal comes before the block's last key, or (WINDOW)
    # a row's window starts after the block's first key.
    needs_mask = (start_n + BLOCK_N > seqlen_k) or (CAUSAL and start_m + diag_offset < start_n + BLOCK_N - 1)
    if WINDOW:
        needs_mask = needs_mask or (start_m + BLOCK_M - 1 + diag_offset - window_left > start_n)
    if KEY_STARTS:
        needs_mask = needs_mask or (start_n < key_start)
    if needs_mask:
        s2_t = masked_scores_t(s2_t, keys, start_m, seqlen_k, diag_offset, window_left, BLOCK_M, CAUSAL, WINDOW,
                               s_layout, key_start, KEY_STARTS)
    return gl.exp2(s2_t - gl.expand_dims(lse2, 0)), dp_t, slope


@gluon.jit
def softcap_chain(p_dv, p_t, slope, dtype: gl.constexpr, SOFTCAP: gl.constexpr):
    """(dV's operand, what dS takes as P^T): with SOFTCAP, dV's operand in the input dtype already and P^T times the
    scores' slope, so that dS = P (dP - delta) needs no change and the slope's registers die here (P^T's float32 copy
    is dS's alone after this); without it (p_dv, p_t) unchanged."""
    operand = p_dv
    p_ds = p_t
    if SOFTCAP:
        operand = p_dv.to(dtype)
        p_ds = p_t * slope
    return operand, p_ds


@gluon.jit
def step_keep(rng, key_hashes, head_step, start_m, BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
    """DROPOUT: a step's keep decisions, keys by rows and its queries by columns (query head first_head + head_step;
    rng as the kernel makes it, key_hashes the block's column_hashes)."""
    seed0, seed1, threshold, _, first_batch_head = rng
    queries = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    rows = row_keys(head_key(first_batch_head + head_step, seed0), queries, seed1)
    return keep_tile_transposed(rows, key_hashes, threshold)


@gluon.jit
def narrow_compute_partition(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_ready, dq_empty,
                             kv_ready, q_ready, q_empty, do_ready, do_empty,
                             lse2_smem, delta_smem, dkv_out,
                             start_n, walk, steps, key_counts, diag_offset, window_left, rng, qk_scale2,
                             sm_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                             DROPOUT: gl.constexpr, DKDV_STORE: gl.constexpr, softcap_in2, SOFTCAP: gl.constexpr,
                             DETERMINISTIC: gl.constexpr, SPLIT: gl.constexpr, KEY_STARTS: gl.constexpr):
    """Head dims 64 and 128, each warpgroup owning 64 of the keys: every step of the key block, then dK and dV.
    Per step: S^T, dP^T; P^T, dS^T; dV, dK; dQ's share. SPLIT (d = 96 in the 128-wide tile): S^T and dP^T over the
    head dim's 64 + 32 columns only (step_probabilities); dV, dK and dQ keep the tile's width."""
    s_layout: gl.constexpr = wgmma_layout(COMPUTE_WARPS, 1, BLOCK_M)         # S^T, dP^T: (BLOCK_N, BLOCK_M)
    kv_layout: gl.constexpr = wgmma_layout(COMPUTE_WARPS, 1, HEAD_DIM)       # dK, dV: (BLOCK_N, HEAD_DIM)
    dq_layout: gl.constexpr = wgmma_layout(COMPUTE_WARPS // 2, 2, HEAD_DIM // 2)  # dQ share: (BLOCK_M, HEAD_DIM)
    operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    key_end, seqlen_k, key_start = key_counts  # the keys queries see (from key_start), the keys dK and dV have
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(kv_ready, 0)

    for step in range(steps):
        slot, phase, head_step, start_m, q_tile, do_tile = step_tiles(q_smem, do_smem, step, walk, BLOCK_M, HEAD_DIM,
                                                                      NUM_STAGES, DETERMINISTIC)
        p_t, dp_t, slope = step_probabilities(k_smem, v_smem, q_tile, do_tile, q_ready, do_ready, lse2_smem, slot,
                                              phase, start_n, start_m, keys, s_zero, key_end, diag_offset, window_left,
                                              qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, s_layout, softcap_in2,
                                              SOFTCAP, SPLIT, key_start, KEY_STARTS)
        p_dv = p_t  # what dV's product takes: P^T, dropped (and scaled at the end) with DROPOUT
        if DROPOUT:
            keep_t = step_keep(rng, column_hashes(keys), head_step, start_m, BLOCK_M, s_layout)
            p_dv = gl.where(keep_t, p_t, 0.0)
        p_dv, p_t = softcap_chain(p_dv, p_t, slope, dtype, SOFTCAP)
        # At 64 queries a step dV's product starts while dP^T is still on the tensor cores. At 128, P^T and dP^T in
        # float32, P^T's 16-bit copy and dK, dV (64 + 64 + 32 + 64 registers a thread) leave no room for dS^T: there
        # dV waits for dP^T, and P^T's float32 registers die before dS^T's copy is made.
        EARLY_DV: gl.constexpr = BLOCK_M == 64
        if EARLY_DV:
            dv = warpgroup_mma(gl.convert_layout(p_dv.to(dtype), operand_layout), do_tile, dv, is_async=True)
        delta = row_values(delta_smem.index(slot), BLOCK_M, s_layout)
        dp_t = warpgroup_mma_wait(1 if EARLY_DV else 0, deps=(dp_t, ))
        if DROPOUT:
            dp_t = gl.where(keep_t, dp_t * rng[3], 0.0)
        ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
        if not EARLY_DV:
            dv = warpgroup_mma(gl.convert_layout(p_dv.to(dtype), operand_layout), do_tile, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t, operand_layout), q_tile, dk, is_async=True)

        # dS^T to shared memory (two buffers: step s + 1 writes the other while step s's dQ product may still
        # read this one); after the barrier every warp has also finished step s - 1, whose slot is released.
        ds_tile = ds_smem.index(step % 2)
        ds_tile.store(ds_t)
        fence_async_shared()
        thread_barrier()
        if step > 0:
            mbarrier.arrive(q_empty.index((step - 1) % NUM_STAGES), count=1)
            mbarrier.arrive(do_empty.index((step - 1) % NUM_STAGES), count=1)
        dq = warpgroup_mma(ds_tile.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
        dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
        hand_dq_chunk(dq * sm_scale, dq_smem, dq_ready, dq_empty, step, BLOCK_M, HEAD_DIM)

    if DROPOUT:
        dv = dv * rng[3]
    store_dk_dv((dk, ), (dv, ), k_smem, v_smem, dkv_out, start_n, seqlen_k, sm_scale, BLOCK_N, HEAD_DIM, kv_layout,
                DKDV_STORE, False)


@gluon.jit
def compute_partition(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_ready, dq_empty,
                      kv_ready, q_ready, q_empty, do_ready, do_empty,
                      lse2_smem, delta_smem, dkv_out,
                      start_n, walk, steps, key_counts, diag_offset, window_left, rng, qk_scale2, sm_scale,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DROPOUT: gl.constexpr,
                      DQ_COLS: gl.constexpr, DKDV_STORE: gl.constexpr, softcap_in2, SOFTCAP: gl.constexpr,
                      DETERMINISTIC: gl.constexpr, SPLIT_PRODUCTS: gl.constexpr, KEY_STARTS: gl.constexpr):
    """The kernel's 8 warps: the narrow schedule (warpgroups split the keys) up to head dim 128, the wide one
    (warpgroups split the columns) above; SPLIT_PRODUCTS: products over the head dim's columns only (each schedule
    says which)."""
    if HEAD_DIM > 128:
        wide_compute_partition(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_ready, dq_empty, kv_ready,
                               q_ready, q_empty, do_ready, do_empty, lse2_smem, delta_smem, dkv_out, start_n,
                               walk, steps, key_counts, diag_offset, window_left, rng, qk_scale2, sm_scale,
                               HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, WINDOW, DROPOUT, DQ_COLS, DKDV_STORE,
                               softcap_in2, SOFTCAP, DETERMINISTIC, SPLIT_PRODUCTS, KEY_STARTS)
    else:
        narrow_compute_partition(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_ready, dq_empty, kv_ready,
                                 q_ready, q_empty, do_ready, do_empty, lse2_smem, delta_smem, dkv_out, start_n,
                                 walk, steps, key_counts, diag_offset, window_left, rng, qk_scale2,
                                 sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, WINDOW, DROPOUT,
                                 DKDV_STORE, softcap_in2, SOFTCAP, DETERMINISTIC, SPLIT_PRODUCTS, KEY_STARTS)


@gluon.jit
def wide_compute_partition(k_smem, v_smem, q_smem, do_smem, pds_smem, dq_smem, dq_ready, dq_empty,
                           kv_ready, q_ready, q_empty, do_ready, do_empty,
                           lse2_smem, delta_smem, dkv_out,
                           start_n, walk, steps, key_counts, diag_offset, window_left, rng, qk_scale2,
                           sm_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                           DROPOUT: gl.constexpr, DQ_COLS: gl.constexpr, DKDV_STORE: gl.constexpr, softcap_in2,
                           SOFTCAP: gl.constexpr, DETERMINISTIC: gl.constexpr, SPLIT: gl.constexpr,
                           KEY_STARTS: gl.constexpr):
    """The compute partition at head dim 256. dK and dV of 64 keys by 256 columns take all of both warpgroups'
    accumulator registers, so BLOCK_N is 64 and the warpgroups split every product by columns instead of keys:
    S^T and dP^T by query (BLOCK_M / 2 each), dV and dK by head-dim column (HEAD_DIM / 2 each), and dQ = dS K in
    two chunks of DQ_COLS columns (the float32 share of a whole step would not fit shared memory). P^T and dS^T go
    through shared memory, since each warpgroup's dV and dK columns need every query's. The Q and dO slot is
    released as soon as dV and dK have read it (one stage: the loads overlap the dQ products). SPLIT (a head dim of 3/4
    of the tile: 192 of 256): no product multiplies the zero fill past the head dim; S^T and dP^T add a product over
    the next quarter onto one over the first half (hopper_forward.scores_product), dK and dV are each two accumulators
    of HEAD_DIM / 2 and HEAD_DIM / 4 columns (zero_columns, column_products), and dQ's second chunk is DQ_COLS / 2
    wide."""
    s_layout: gl.constexpr = wgmma_layout(COMPUTE_WARPS // 2, 2, BLOCK_M // 2)      # S^T, dP^T: (BLOCK_N, BLOCK_M)
    dq_layout: gl.constexpr = wgmma_layout(COMPUTE_WARPS // 2, 2, DQ_COLS // 2)     # dQ chunk: (BLOCK_M, DQ_COLS)
    DQ_HIGH_COLS: gl.constexpr = DQ_COLS // 2 if SPLIT else DQ_COLS                   # dQ's second chunk
    dq_high_layout: gl.constexpr = wgmma_layout(COMPUTE_WARPS // 2, 2, DQ_HIGH_COLS // 2)
    dtype: gl.constexpr = k_smem.dtype

    dk = zero_columns(BLOCK_N, HEAD_DIM, SPLIT)  # dK, dV: (BLOCK_N, HEAD_DIM) in column parts
    dv = zero_columns(BLOCK_N, HEAD_DIM, SPLIT)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
    if SPLIT:
        dq_high_zero = gl.zeros([BLOCK_M, DQ_HIGH_COLS], gl.float32, layout=dq_high_layout)
    else:
        dq_high_zero = dq_zero
    key_end, seqlen_k, key_start = key_counts  # the keys queries see (from key_start), the keys dK and dV have
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    p_tile = pds_smem.index(0)
    ds_tile = pds_smem.index(1)
    mbarrier.wait(kv_ready, 0)

    for step in range(steps):
        slot, phase, head_step, start_m, q_tile, do_tile = step_tiles(q_smem, do_smem, step, walk, BLOCK_M, HEAD_DIM,
                                                                      NUM_STAGES, DETERMINISTIC)
        p_t, dp_t, slope = step_probabilities(k_smem, v_smem, q_tile, do_tile, q_ready, do_ready, lse2_smem, slot,
                                              phase, start_n, start_m, keys, s_zero, key_end, diag_offset, window_left,
                                              qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, s_layout, softcap_in2,
                                              SOFTCAP, SPLIT, key_start, KEY_STARTS)
        delta = row_values(delta_smem.index(slot), BLOCK_M, s_layout)
        dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
        p_dv = p_t  # what dV's product takes: P^T, dropped (and scaled at the end) with DROPOUT
        if DROPOUT:
            keep_t = step_keep(rng, column_hashes(keys), head_step, start_m, BLOCK_M, s_layout)
            p_dv = gl.where(keep_t, p_t, 0.0)
            dp_t = gl.where(keep_t, dp_t * rng[3], 0.0)
        p_dv, p_t = softcap_chain(p_dv, p_t, slope, dtype, SOFTCAP)
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        # Every warp finished the previous step's products before its last hand-over barrier: the tiles are free.
        p_tile.store(p_dv.to(dtype))
        ds_tile.store(ds_t.to(dtype))
        fence_async_shared()
        thread_barrier()
        dv = column_products(p_tile, do_tile, dv, SPLIT)
        dk = column_products(ds_tile, q_tile, dk, SPLIT)
        dq_low = warpgroup_mma(ds_tile.permute((1, 0)), k_smem.slice(0, DQ_COLS, dim=1), dq_zero, use_acc=False,
                               is_async=True)
        dq_high = warpgroup_mma(ds_tile.permute((1, 0)), k_smem.slice(DQ_COLS, DQ_HIGH_COLS, dim=1), dq_high_zero,
                                use_acc=False, is_async=True)
        dv, dk = wait_columns(dv, dk, SPLIT)  # (the two dQ products may still run)
        thread_barrier()
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        dq_low, dq_high = warpgroup_mma_wait(0, deps=(dq_low, dq_high))
        hand_dq_chunk(dq_low * sm_scale, dq_smem, dq_ready, dq_empty, 2 * step, BLOCK_M, DQ_COLS)
        hand_dq_chunk(dq_high * sm_scale, dq_smem, dq_ready, dq_empty, 2 * step + 1, BLOCK_M, DQ_COLS)

    if DROPOUT:
        dv = scale_columns(dv, rng[3], SPLIT)
    kv_layout: gl.constexpr = wgmma_layout(COMPUTE_WARPS // 2, 2, HEAD_DIM // 2)  # (zero_columns' one part)
    store_dk_dv(dk, dv, k_smem, v_smem, dkv_out, start_n, seqlen_k, sm_scale, BLOCK_N, HEAD_DIM, kv_layout,
                DKDV_STORE, SPLIT)


@gluon.jit
def zero_columns(ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    """The wide schedule's dK or dV accumulators at zero, split by column over its two warpgroups: a tuple of one
    (ROWS, HEAD_DIM) tensor, or with SPLIT of a (ROWS, HEAD_DIM / 2) and a (ROWS, HEAD_DIM / 4) one."""
    if SPLIT:
        return (gl.zeros([ROWS, HEAD_DIM // 2], gl.float32, layout=wgmma_layout(COMPUTE_WARPS // 2, 2, HEAD_DIM // 4)),
                gl.zeros([ROWS, HEAD_DIM // 4], gl.float32, layout=wgmma_layout(COMPUTE_WARPS // 2, 2, HEAD_DIM // 8)))
    else:
        return (gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=wgmma_layout(COMPUTE_WARPS // 2, 2, HEAD_DIM // 2)), )


@gluon.jit
def column_products(a_tile, b_tile, acc, SPLIT: gl.constexpr):
    """acc += A B, issued asynchronously, A (keys, queries) and B (queries, tile width) from shared memory, into the
    column parts of zero_columns (SPLIT: B's first half and the quarter after it). One wgmma group per part."""
    if SPLIT:
        half: gl.constexpr = b_tile.shape[1] // 2
        first = warpgroup_mma(a_tile, b_tile.slice(0, half, dim=1), acc[0], is_async=True)
        second = warpgroup_mma(a_tile, b_tile.slice(half, half // 2, dim=1), acc[1], is_async=True)
        return (first, second)
    else:
        return (warpgroup_mma(a_tile, b_tile, acc[0], is_async=True), )


@gluon.jit
def wait_columns(dv, dk, SPLIT: gl.constexpr):
    """dV's and dK's column parts once their products (column_products, issued before the step's two dQ products)
    have finished; the dQ products may still run."""
    if SPLIT:
        dv_first, dv_second, dk_first, dk_second = warpgroup_mma_wait(2, deps=(dv[0], dv[1], dk[0], dk[1]))
        return (dv_first, dv_second), (dk_first, dk_second)
    else:
        dv_done, dk_done = warpgroup_mma_wait(2, deps=(dv[0], dk[0]))
        return (dv_done, ), (dk_done, )


@gluon.jit
def scale_columns(acc, factor, SPLIT: gl.constexpr):
    """Every column part times a scalar."""
    if SPLIT:
        return (acc[0] * factor, acc[1] * factor)
    else:
        return (acc[0] * factor, )


@gluon.jit
def hand_dq_chunk(share, dq_smem, dq_ready, dq_empty, index, BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr):
    """Chunk ``index`` of the dQ shares to the writer warp through shared buffer index % 2, once the writer has
    handed that buffer back. A share narrower than DQ_COLS (a split chunk past the head dim's first DQ_COLS columns)
    fills the buffer's first columns; the copy engine's reduce-add clips the rest (the tensor map ends at the head
    dim)."""
    buf = index % 2
    mbarrier.wait(dq_empty.index(buf), ((index // 2) & 1) ^ 1)
    chunk = dq_smem.index(buf).reshape([BLOCK_M, DQ_COLS])
    if share.shape[1] < DQ_COLS:
        chunk = chunk.slice(0, share.shape[1], dim=1)
    chunk.store(share)
    fence_async_shared()
    thread_barrier()
    mbarrier.arrive(dq_ready.index(buf), count=1)


# How the compute warps write a program's dK and dV (store_dk_dv): from registers, through K's and V's shared tiles by
# the copy engine, or (PARTIAL_DK_DV: the program walked part of its key/value head's query heads) added from registers
# into float32 sums that the other parts' programs add to as well.
STORE_FROM_REGISTERS = gl.constexpr(0)
STORE_STAGED = gl.constexpr(1)
ADD_PARTIAL = gl.constexpr(2)


@gluon.jit
def store_dk_dv(dk, dv, k_smem, v_smem, dkv_out, start_n, seqlen_k, sm_scale, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, kv_layout: gl.constexpr, STORE: gl.constexpr, SPLIT: gl.constexpr):
    """The key block's dK (scaled) and dV rows up to the last key; dk, dv: column parts (zero_columns; one part unless
    SPLIT). dkv_out: (dk_desc, dv_desc, batch, head_kv, dk_base, dv_base, stride_dkn, stride_dvn). STORE:
    STORE_STAGED: in the input dtype, in K's and V's tiles, written by the copy engine (which clips rows past Nk): two
    bulk copies instead of a thread's 32-128 scattered 4-byte stores. Those tiles are free: every warp waited for its
    last products before the last dQ hand-over's barrier. STORE_FROM_REGISTERS: in the input dtype, through dk_base and
    dv_base (one part only). ADD_PARTIAL: float32 atomic additions through dk_base and dv_base, which point into the
    zeroed float32 sums of the call (one part only)."""
    dk_desc, dv_desc, batch, head_kv, dk_base, dv_base, stride_dkn, stride_dvn = dkv_out
    dtype: gl.constexpr = k_smem.dtype
    gl.static_assert(STORE == STORE_STAGED or not SPLIT, "split dK and dV are stored through K's and V's tiles")
    if STORE == STORE_STAGED:
        stage_columns(k_smem, scale_columns(dk, sm_scale, SPLIT), SPLIT)
        stage_columns(v_smem, dv, SPLIT)
        fence_async_shared()
        thread_barrier()
        coord = [batch, head_kv, start_n, 0]
        tma_store(dk_desc, coord, k_smem.reshape([1, 1, BLOCK_N, HEAD_DIM]))
        tma_store(dv_desc, coord, v_smem.reshape([1, 1, BLOCK_N, HEAD_DIM]))
        tma.store_wait(0)
    else:
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        keep = gl.expand_dims(keys < seqlen_k, 1)
        rows = gl.expand_dims(keys.to(gl.int64), 1)
        dk_at = dk_base + rows * stride_dkn + gl.expand_dims(cols, 0)
        dv_at = dv_base + rows * stride_dvn + gl.expand_dims(cols, 0)
        if STORE == ADD_PARTIAL:
            gl.atomic_add(dk_at, dk[0] * sm_scale, mask=keep, sem="relaxed")
            gl.atomic_add(dv_at, dv[0], mask=keep, sem="relaxed")
        else:
            gl.store(dk_at, (dk[0] * sm_scale).to(dtype), mask=keep)
            gl.store(dv_at, dv[0].to(dtype), mask=keep)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_n_blocks", "diag_offset", "window_left", "threshold",
                              "call_batch_head0", "call_heads_q"])
def hopper_backward_kernel(
    q_desc, k_desc, v_desc, do_desc, lse2_desc, delta_desc, dq_desc, dk_desc, dv_desc, dK, dV, dQ, dQacc, DqCounters,
    KeyBounds, Seed, DqTurns,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    heads_kv, kv_group, seqlen_q, seqlen_k, num_n_blocks, qk_scale2, sm_scale, diag_offset, window_left,
    threshold, dropout_scale, call_batch_head0, call_heads_q, softcap_in2, convert_in_kernel, group_parts,
    HEAD_DIM: gl.constexpr, HEAD_COLS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, STAGED_DK_DV: gl.constexpr, WINDOW: gl.constexpr = False,
    KEY_LENGTHS: gl.constexpr = False, DROPOUT: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
    DETERMINISTIC: gl.constexpr = False, SPLIT_PRODUCTS: gl.constexpr = False, KEY_STARTS: gl.constexpr = False,
    PARTIAL_DK_DV: gl.constexpr = False,
):
    """Host tensor maps (hopper_launch.tensor_map): q_desc, do_desc of Q, dOut (B, Hq, Nq, D) in blocks of
    (1, 1, BLOCK_M, HEAD_DIM); k_desc, v_desc of K, V (B, Hkv, Nk, D) in blocks of (1, 1, BLOCK_N, HEAD_DIM);
    lse2_desc, delta_desc of backward.py's preprocess outputs (B, Hq, Nq) fp32 in blocks of (1, 1, BLOCK_M); dq_desc
    of the zeroed float32 dQ buffer (B, Hq, Nq, D) in blocks of (1, 1, BLOCK_M, min(HEAD_DIM, 128)), which receives
    scale * dS K; dk_desc, dv_desc of dK, dV (B, Hkv, Nk, D) in the input dtype, in K's blocks, written through them
    with STAGED_DK_DV, else through the pointers dK, dV and their strides. dQacc is the float32 buffer (contiguous)
    and DqCounters B * Hkv zeroed int32 counters; dQ (B, Hq, Nq, D) in the input dtype, last dim contiguous. With
    convert_in_kernel (1) the program that adds last to a (batch, key/value head)'s dQ rows converts them into dQ
    (convert_dq); with 0 the caller converts the buffer. Query head h reads key/value head h // kv_group; causal:
    query row i sees keys j <= i + diag_offset; WINDOW: no key j < i + diag_offset - window_left. KEY_LENGTHS: batch
    entry b's keys from KeyBounds[b] (int32) on are padding no query sees: a key block past it walks no query block
    and writes zero dK and dV. KEY_STARTS (with KEY_LENGTHS): KeyBounds holds 2B int32 (B the
    launch's batch entries), and batch entry b's keys before KeyBounds[B + b] are padding too (a left-padding key mask):
    a key block before it walks no query block and writes zero dK and dV, and the block it falls in masks the keys
    before it (step_probabilities). DROPOUT: P was dropped with the shared RNG (rng.py: Seed's int32 words 0 and 2,
    threshold the uint32 threshold's bit pattern) and scaled by dropout_scale = 1 / (1 - p):
    dV = (P * keep)^T dO * dropout_scale and dS = P * (dP * keep * dropout_scale - delta); the keep-mask is drawn by
    the call's (batch, query head) numbers, which for this launch's batch entry b and query head h are
    call_batch_head0 + b * call_heads_q + h (a launch over a slice of the call's batch or heads: hopper_launch.backward;
    0 and Hq for a launch over the whole call). Without it Seed, threshold, dropout_scale, call_batch_head0 and
    call_heads_q are not read. SOFTCAP: the scores were softcap * tanh(scale * S / softcap), with
    qk_scale2 = softcap * log2(e) and softcap_in2 = 2 * log2(e) * scale / softcap, and dS takes the slope
    1 - tanh^2 (step_probabilities); without it softcap_in2 is not read.
    D = HEAD_COLS, the head dim; HEAD_DIM is the tiles' width, a power of two >= D (hopper_launch.TILE_WIDTH): the
    copy engine zero-fills the columns past D and clips them from its stores, so a narrower D needs STAGED_DK_DV.
    DETERMINISTIC: dQ's shares are added in a fixed order, each query block's by its key blocks in their order, so
    that dQ is the same bit for bit at every run: DqTurns holds B * Hq * cdiv(Nq, BLOCK_M) zeroed int32 counters, a
    query block's counting the key blocks that have added to it (dq_turn), and a program waits for its turn before
    each addition (the programs of a (batch, key/value head) start in key block order, so the one waited for has
    started); without it DqTurns is not read. SPLIT_PRODUCTS (a head dim of 3/4 of the tile: 96 of 128, 192 of 256):
    S^T and dP^T, and at 192 every product, skip the zero fill past the head dim (narrow_compute_partition,
    wide_compute_partition).
    PARTIAL_DK_DV (GQA): the kv_group query heads of a key/value head are walked by group_parts programs per key
    block, kv_group / group_parts heads each, instead of one (more, shorter programs); each adds its partial dK and dV
    into float32 sums (B, Hkv, Nk, D), contiguous, that dK and dV point to (and stride_dk*, stride_dv* describe), which the caller zeroes and converts. Without it
    group_parts is 1. Not with DETERMINISTIC (the additions' order varies) or head dims past 128.
    Grid (B * Hkv * group_parts * num_n_blocks,), num_n_blocks = cdiv(Nk, BLOCK_N); launched with 8 warps."""
    gl.static_assert(STAGED_DK_DV or HEAD_COLS == HEAD_DIM, "dK and dV stored from registers write every tile column")
    gl.static_assert(not PARTIAL_DK_DV or (HEAD_COLS == HEAD_DIM and HEAD_DIM <= 128 and not DETERMINISTIC),
                     "partial dK and dV sums: head dims 64 and 128, not deterministic")
    if not PARTIAL_DK_DV:
        group_parts = 1  # (a constant: the builds without partial sums keep their integer arithmetic)
    pid = gl.program_id(0)
    # Head-major: the key blocks of one head (or of one part of a key/value head's query heads) run side by side and
    # share its Q and dO in L2 (a longest-first order across heads for causal calls measured slower). Within a head,
    # causal key blocks with the most queries first.
    batch_head_part = pid // num_n_blocks
    start_n = (pid % num_n_blocks) * BLOCK_N
    batch_head_kv = batch_head_part // group_parts
    batch = batch_head_kv // heads_kv
    head_kv = batch_head_kv % heads_kv
    part_heads = kv_group // group_parts  # the query heads this program walks
    first_head = head_kv * kv_group + (batch_head_part % group_parts) * part_heads
    dtype: gl.constexpr = q_desc.dtype
    # dQ's float32 shares go out in chunks of at most 128 columns (head dim 256: two per step).
    DQ_COLS: gl.constexpr = dq_desc.block_shape[3]

    # Shared tiles as the copy engine writes them (unit leading dims), and as the products read them.
    k_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_smem = k_tile.reshape([BLOCK_N, HEAD_DIM])
    v_smem = v_tile.reshape([BLOCK_N, HEAD_DIM])
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    ds_tile: gl.constexpr = tile_layout(BLOCK_N, BLOCK_M, dtype.primitive_bitwidth)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_tile)  # head dim 256: P^T and dS^T
    lse2_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], lse2_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], delta_desc.layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, DQ_COLS], dq_desc.layout)
    dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for slot in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(slot), count=1)
        mbarrier.init(q_empty.index(slot), count=1)
        mbarrier.init(do_ready.index(slot), count=1)
        mbarrier.init(do_empty.index(slot), count=1)
    dq_added = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for buf in gl.static_range(2):
        mbarrier.init(dq_ready.index(buf), count=1)
        mbarrier.init(dq_empty.index(buf), count=1)
    mbarrier.init(dq_added, count=1)

    first_m, m_blocks = visible_query_blocks(start_n, seqlen_q, diag_offset, window_left, BLOCK_M, BLOCK_N, CAUSAL,
                                             WINDOW)
    key_end = seqlen_k  # the keys queries see (the mask's bound); dK and dV rows are written up to seqlen_k
    key_start = 0  # the first key queries see
    if KEY_LENGTHS:
        key_end = gl.load(KeyBounds + batch)
        m_blocks = gl.where(start_n < key_end, m_blocks, 0)
        if KEY_STARTS:
            key_start = gl.load(KeyBounds + gl.num_programs(0) // (heads_kv * group_parts * num_n_blocks) + batch)
            m_blocks = gl.where(start_n + BLOCK_N > key_start, m_blocks, 0)  # (key_start: B entries in)
    steps = part_heads * m_blocks
    if DROPOUT:  # the seeds, the threshold, 1 / (1 - p) and the first query head's (batch * Hq + head) in the call
        rng = (gl.load(Seed), gl.load(Seed + 2), threshold, dropout_scale,
               call_batch_head0 + batch * call_heads_q + first_head)
    else:
        rng = (0, 0, 0, 1.0, 0)
    dkv_out = (dk_desc, dv_desc, batch, head_kv,
               dK + batch.to(gl.int64) * stride_dkb + head_kv.to(gl.int64) * stride_dkh,
               dV + batch.to(gl.int64) * stride_dvb + head_kv.to(gl.int64) * stride_dvh, stride_dkn, stride_dvn)
    if DETERMINISTIC:
        m_per_head = gl.cdiv(seqlen_q, BLOCK_M)
        turns = (DqTurns + (batch * heads_kv * kv_group + first_head).to(gl.int64) * m_per_head, m_per_head,
                 pid % num_n_blocks, diag_offset - window_left, key_start // BLOCK_N)
    else:
        turns = (DqTurns, 0, 0, 0, 0)
    walk = (first_m, m_blocks, part_heads)  # the program's query blocks and heads (step_place)
    DKDV_STORE: gl.constexpr = (ADD_PARTIAL if PARTIAL_DK_DV else
                                STORE_STAGED if STAGED_DK_DV else STORE_FROM_REGISTERS)
    gl.warp_specialize([
        (compute_partition, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_ready, dq_empty, kv_ready, q_ready,
                             q_empty, do_ready, do_empty, lse2_smem, delta_smem, dkv_out, start_n, walk, steps,
                             (key_end, seqlen_k, key_start), diag_offset, window_left, rng, qk_scale2, sm_scale,
                             HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, WINDOW, DROPOUT, DQ_COLS, DKDV_STORE,
                             softcap_in2, SOFTCAP, DETERMINISTIC, SPLIT_PRODUCTS, KEY_STARTS)),
        (load_partition, (k_desc, v_desc, q_desc, do_desc, lse2_desc, delta_desc, k_tile, v_tile, q_smem, do_smem,
                          lse2_smem, delta_smem, kv_ready, q_ready, q_empty, do_ready, do_empty, batch, head_kv,
                          first_head, start_n, walk, steps, BLOCK_M, NUM_STAGES, DETERMINISTIC)),
        (dq_writer_partition, (dq_desc, dq_smem, dq_ready, dq_empty, dq_added, batch, first_head, walk, steps, turns,
                               BLOCK_M, BLOCK_N, DQ_COLS, HEAD_DIM // DQ_COLS, WINDOW, DETERMINISTIC, KEY_STARTS)),
    ], [1, 1], [LOAD_REGS, WRITER_REGS])

    # The (batch, key/value head)'s dQ is complete once each of its num_n_blocks * group_parts programs has added its
    # share: the program that counts last converts it (all kv_group query heads, whichever part it walked), while other
    # programs still compute (no pass over the buffer after the kernel). The count is a release of this program's
    # additions and an acquire of the others'.
    if convert_in_kernel:
        mbarrier.wait(dq_added, 0)
        added_before = gl.atomic_add(DqCounters + batch_head_kv, 1, sem="acq_rel", scope="gpu")
        if added_before == num_n_blocks * group_parts - 1:
            group_first_head = head_kv * kv_group
            convert_dq(dQacc + batch_head_kv.to(gl.int64) * kv_group * seqlen_q * HEAD_COLS,
                       dQ + batch.to(gl.int64) * stride_dqb + group_first_head.to(gl.int64) * stride_dqh, stride_dqh,
                       stride_dqn, kv_group, seqlen_q, HEAD_DIM, HEAD_COLS)
