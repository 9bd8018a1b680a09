"""The Hopper (sm_90) forward kernel, written in Gluon: FlashAttention-3's schedule.

What the FlashAttention-2 kernel (forward.py) leaves to Triton's pipeliner is spelled out here:

- one program owns 2 * BLOCK_M query rows of one (batch, query head) and runs three partitions:
  a load warp and two softmax warpgroups (consumers) of BLOCK_M rows each;
- the load warp moves Q once, then every key block's K and V, through the copy engine (TMA) into a ring
  of NUM_STAGES shared-memory slots; each slot has a "ready" barrier (the copy engine signals it when the
  bytes have landed) and an "empty" barrier (each consumer signals it when its products no longer read
  the slot), separate for K and V so that QK^T can start before V has landed;
- each consumer computes S = Q K^T and O += P V with asynchronous warpgroup MMAs (wgmma) straight from
  shared memory (P from registers), with the online softmax between them. The product S_{j+1} = Q K_{j+1}^T
  is issued before P_j V_j, and the softmax of block j+1 runs while P_j V_j is still on the tensor cores
  (FlashAttention-3's intra-warpgroup overlap); the two consumers also interleave on the SM's schedulers;
- where SPLIT_MASKED is set (hopper_launch.FORWARD_SPLIT_MASKED), a tile's key blocks run as two loops, those every
  row sees whole without any mask code and then the one or two that need the mask (attend_blocks);
- where HALF_DIAGONAL is set (hopper_launch.FORWARD_HALF_DIAGONAL_MAX_KEYS), the lower consumer's causal diagonal
  block, of which its rows see only the first half when the diagonal starts at the block's first key, runs at half
  width (attend_block on half its keys);
- where LAZY_RESCALE is set (hopper_launch.FORWARD_LAZY_RESCALE), a row's running maximum moves only when a block's
  top score passes it by more than RESCALE_LOG2, and a consumer whose rows' maxima all stayed skips the rescaling
  of its output accumulators (softmax_step, attend_block);
- the registers move to the consumers: the load warp keeps LOAD_REGS per thread, and each consumer warpgroup
  gets up to CONSUMER_REGS (``setmaxnreg``, through warp_specialize's register budgets);
- where shared memory has room (d = 64, 128), Q has two buffers, so the next tile's Q lands while this tile runs,
  and each consumer stages its output in its Q slot for the copy engine to write (consume_tile); at d = 256, where
  only three consumer tiles fit beside the ring, the two consumers may take three Q slots in turn (Q_ROTATING,
  q_slot), so that the lower consumer's next Q lands while this tile runs; the online softmax takes each row's
  maximum of the unscaled scores, so an exponent's argument is one fused multiply-add.

The tensor maps are made on the host (hopper_launch.tensor_map), 4-D over (batch, head, row, column), so the
copy engine zero-fills rows past each head's sequence end; making them in the kernel (a map written to global
memory and fenced in every program) took about 15% of a program at 1k keys (NOTES, version 8).

Coverage (the backend routes the rest to forward.py): fp16 and bf16; head dims 64, 128, 256, and 96 and 192 in the 128-
and 256-wide tiles (HEAD_COLS; K and V the same; at 192 the products skip the zero fill: SPLIT_PRODUCTS); no mask, or a
causal mask of either alignment (diag_offset); a sliding window's left bound (WINDOW: a tile moves only the key blocks
its rows' windows reach, and masks the first ones), with the causal diagonal or no right bound; a right-padding key mask
as per-batch key counts (KEY_LENGTHS: a tile walks only its batch entry's keys), and a left-padding one as per-batch
first keys too (KEY_STARTS: a tile counts its keys from its entry's first, tile_at); GQA by head index; any Nq, Nk >= 1;
a positive scale; 16-byte aligned rows; dropout with the shared RNG (DROPOUT); a softcap (SOFTCAP: each score through a
tanh before the mask, softmax_step). Output (B, Hq, Nq, D) and the log-sum-exp (B, Hq, Nq) like forward.py's.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

# The dropout RNG's Triton functions, compiled here as Gluon (only operators on the tensors they are given, whose
# layouts they keep): the same keep-mask bit for bit as every other kernel's.
from mhattn.backends.triton.rng import column_hashes, head_key, keep_tile, row_keys
from mhattn.backends.triton.scores import softcap_tanh

# The copy-engine load into shared memory: Triton 3.6 names it async_copy_global_to_shared, later ones async_load
# (same arguments: descriptor, coordinates, barrier, destination).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# The copy-engine store of a shared-memory tile: async_copy_shared_to_global in Triton 3.6, async_store later.
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier over the partition's warps: Triton 3.6 names it thread_barrier, later ones barrier.
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

LN2 = gl.constexpr(0.6931471805599453)
# LAZY_RESCALE: how far (log2 units) a block's top score may pass a row's maximum before the maximum moves
RESCALE_LOG2 = gl.constexpr(8.0)
# Per-thread register budgets of the partitions (setmaxnreg): the load warp needs few.
LOAD_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)
# Which key blocks of a loop softmax_step masks (masked_scores): none, every one, or those from a block number on.
MASK_NONE = gl.constexpr(0)
MASK_ALL = gl.constexpr(1)
MASK_FROM = gl.constexpr(2)


@triton.constexpr_function
def tile_layout(rows, cols, bitwidth, rank=2):
    """The swizzled shared-memory layout the copy engine writes and wgmma reads for a (rows, cols) tile; rank 3 for
    a (1, rows, cols) tile copied through a (heads, rows, cols) tensor map."""
    width = cols * bitwidth // 8
    swizzle = 128 if width % 128 == 0 else (64 if width % 64 == 0 else 32)
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bitwidth, rank=rank)


@triton.constexpr_function
def wgmma_layout(warps_m, warps_n, cols):
    """Accumulator layout of a wgmma result over warps_m x warps_n warps, each warp's tile cols wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, cols, 16])


@triton.constexpr_function
def mma_layout(cols):
    """Accumulator layout of one warpgroup's (64k, cols) wgmma result."""
    return wgmma_layout(4, 1, cols)


@gluon.jit
def q_slot(rounds, HALF: gl.constexpr, Q_BUFFERS: gl.constexpr, Q_ROTATING: gl.constexpr):
    """(slot, barrier, phase) of consumer HALF's Q tile in the program's ``rounds``-th tile: its slot of Q's shared
    memory, the ready/empty barrier pair it goes by, and that pair's phase for this use. Q_BUFFERS buffers of two slots
    (one per consumer; a barrier pair per buffer, both consumers release it), or Q_ROTATING: three slots taken in
    turn, use 2 * rounds + HALF in slot use % 3, each with a barrier pair of its own. The upper consumer's slot is then
    next taken by the lower consumer two tiles on, the lower consumer's by the upper consumer on the next tile."""
    if Q_ROTATING:
        use = 2 * rounds + HALF
        return use % 3, use % 3, (use // 3) & 1
    else:
        buf = rounds % Q_BUFFERS
        return 2 * buf + HALF, buf, (rounds // Q_BUFFERS) & 1


@gluon.jit
def load_rotating_q(q_desc, q_smem, q_ready, q_empty, batch, head, start_m, rounds, HALF: gl.constexpr,
                    BLOCK_M: gl.constexpr):
    """Q_ROTATING: consumer HALF's Q tile of the program's ``rounds``-th tile into its slot (q_slot), once the
    consumer that used the slot before has released it."""
    slot, _, phase = q_slot(rounds, HALF, 1, True)
    # A fresh barrier counts as having completed the phase before its first: a slot's first use waits for nothing.
    mbarrier.wait(q_empty.index(slot), phase ^ 1)
    mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
    tma_load(q_desc, [batch, head, start_m + HALF * BLOCK_M, 0], q_ready.index(slot), q_smem.index(slot))


@gluon.jit
def visible_key_blocks(start_m, seqlen_k, diag_offset, window_left, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                       CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """(first, end, full_first, full_end): rows [start_m, start_m + ROWS) see key blocks first .. end - 1 (none
    where end <= first), and every row sees blocks full_first .. full_end - 1 whole (those need no mask). WINDOW: row
    r sees no key before r + diag_offset - window_left."""
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + ROWS + diag_offset, 0), seqlen_k)
        full_end = gl.minimum(gl.maximum(start_m + diag_offset + 1, 0), seqlen_k) // BLOCK_N
    else:
        hi = seqlen_k
        full_end = seqlen_k // BLOCK_N
    first = 0
    full_first = 0
    if WINDOW:
        first = gl.minimum(gl.maximum(start_m + diag_offset - window_left, 0), hi) // BLOCK_N
        full_first = gl.cdiv(gl.maximum(start_m + ROWS - 1 + diag_offset - window_left, 0), BLOCK_N)
    return first, gl.cdiv(hi, BLOCK_N), full_first, full_end


@gluon.jit
def tile_rows(tile, num_tiles, num_m_blocks, group_heads, heads_q, BLOCK_M: gl.constexpr, HEAVY_FIRST: gl.constexpr):
    """(batch, head, start_m) of tile ``tile``: 2 * BLOCK_M query rows of one (batch, head). Without a causal mask,
    head-major (a head's query blocks in a row, so programs running side by side share its K/V in L2). Causal
    (HEAVY_FIRST): groups of group_heads heads, and within a group the query blocks that see the most keys first,
    across the group's heads, so the last programs to start are short ones and a group's K/V stay in L2 while it
    runs (FlashAttention-3's longest-first order); group_heads = 1 is each head's blocks, heaviest first."""
    if HEAVY_FIRST:
        group_tiles = group_heads * num_m_blocks
        group = tile // group_tiles
        within = tile % group_tiles
        heads_here = gl.minimum(group_heads, num_tiles // num_m_blocks - group * group_heads)
        m_block = num_m_blocks - 1 - within // heads_here
        batch_head = group * group_heads + within % heads_here
    else:
        batch_head = tile // num_m_blocks
        m_block = tile % num_m_blocks
    return batch_head // heads_q, batch_head % heads_q, m_block * 2 * BLOCK_M


@gluon.jit
def tile_at(tile, num_tiles, num_m_blocks, group_heads, heads_q, seqlen_k, KeyBounds, diag_offset, window_left,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
            KEY_LENGTHS: gl.constexpr, KEY_STARTS: gl.constexpr):
    """(batch, head, start_m, cta_first, cta_end, keys, key_start, diag_offset) of tile number ``tile``, as every
    partition walks it: its rows (tile_rows), the key blocks cta_first .. cta_end - 1 the program moves for it (from the
    lower consumer's first: its rows see the earliest keys, to the upper consumer's last: its rows see the latest),
    and how many keys its batch entry has (KEY_LENGTHS: KeyBounds[batch], the rest padding no row sees; else
    seqlen_k).

    KEY_STARTS: the batch entry's keys begin at key_start = KeyBounds[B + batch] (the keys before it are padding no
    row sees: left padding). The tile then counts keys from there: key block j holds keys key_start + j * BLOCK_N on
    (the load warp's copies start there), ``keys`` is the entry's key count from there and the diagonal offset is
    moved by -key_start, so that the rest of the kernel walks, masks and sizes the tile as that of a sequence whose
    keys start at 0. Without it key_start is 0 and diag_offset the launch's."""
    batch, head, start_m = tile_rows(tile, num_tiles, num_m_blocks, group_heads, heads_q, BLOCK_M, CAUSAL)
    key_start = 0
    if KEY_LENGTHS:
        seqlen_k = gl.load(KeyBounds + batch)
        if KEY_STARTS:
            key_start = gl.load(KeyBounds + num_tiles // (num_m_blocks * heads_q) + batch)  # (B entries in)
            seqlen_k -= key_start
            diag_offset -= key_start
    _, cta_end, _, _ = visible_key_blocks(start_m + BLOCK_M, seqlen_k, diag_offset, window_left, BLOCK_M, BLOCK_N,
                                          CAUSAL, WINDOW)
    if WINDOW:
        cta_first, _, _, _ = visible_key_blocks(start_m, seqlen_k, diag_offset, window_left, BLOCK_M, BLOCK_N, CAUSAL,
                                                WINDOW)
        cta_end = gl.maximum(cta_end, cta_first)
    else:
        cta_first = 0
    return batch, head, start_m, cta_first, cta_end, seqlen_k, key_start, diag_offset


@gluon.jit
def next_counted_tile(TileCounter, num_tiles):
    """TILE_COUNTER: the next tile no program has taken yet. The counter is 0 at the launch and each program's
    first tile is its own number, so the tiles taken are G, G + 1, ... in the order the programs ask (whichever is
    free first takes the next, heaviest first as tile_rows orders them).

    A launch adds exactly num_tiles to the counter: num_tiles - G adds hand out tiles, and each of the G programs
    makes one more, past the last tile, that ends it. The add that reads num_tiles - 1 is therefore the launch's last
    (every program has made its final one), and it sets the counter back to 0: the next launch on the stream finds
    it zeroed, so the host keeps one counter per stream instead of zeroing one per launch."""
    taken = gl.atomic_add(TileCounter, 1)
    if taken == num_tiles - 1:
        gl.atomic_xchg(TileCounter, 0)
    return taken + gl.num_programs(0)


@gluon.jit
def hand_tile(tile_slots, tile_full, tile_empty, n, tile, layout: gl.constexpr):
    """The load warp hands its n-th tile number to both consumers through shared-memory slot n % 2 (num_tiles:
    the program has no more)."""
    slot = n % 2
    mbarrier.wait(tile_empty.index(slot), ((n // 2) & 1) ^ 1)
    tile_slots.index(slot).store(gl.full([1], tile, gl.int32, layout))
    thread_barrier()
    mbarrier.arrive(tile_full.index(slot), count=1)


@gluon.jit
def take_tile(tile_slots, tile_full, tile_empty, n, layout: gl.constexpr):
    """A consumer's n-th tile number from the load warp (hand_tile); the slot goes back once every thread has read
    it."""
    slot = n % 2
    mbarrier.wait(tile_full.index(slot), (n // 2) & 1)
    tile = gl.max(tile_slots.index(slot).load(layout), 0)
    thread_barrier()
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return tile


@gluon.jit
def load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              batch, head, start_m, cta_first, cta_end, key_start, kv_group, step, rounds, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, Q_ROTATING: gl.constexpr):
    """The load warp on the program's ``rounds``-th tile: both consumers' Q tiles into Q buffer rounds % Q_BUFFERS once
    both consumers have released it (see consume_tile), then K_j and V_j for j in cta_first .. cta_end - 1 into ring
    slots from ``step`` on, each as soon as both consumers have released the slot's previous block (the blocks
    either consumer's rows see: tile_at; block j from key key_start + j * BLOCK_N). Q_ROTATING: the lower consumer's
    Q first (its slot was freed a tile ago), the upper consumer's after the first K and V (its slot frees when the
    lower consumer has finished the previous tile's S products), so the lower consumer's first product need not wait
    for it."""
    head_kv = head // kv_group
    if Q_ROTATING:
        load_rotating_q(q_desc, q_smem, q_ready, q_empty, batch, head, start_m, rounds, 0, BLOCK_M)
    else:
        # A fresh barrier counts as having completed the phase before its first: round 0 waits for nothing.
        buf = rounds % Q_BUFFERS
        mbarrier.wait(q_empty.index(buf), ((rounds // Q_BUFFERS) & 1) ^ 1)
        mbarrier.expect(q_ready.index(buf), 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [batch, head, start_m, 0], q_ready.index(buf), q_smem.index(2 * buf))
        tma_load(q_desc, [batch, head, start_m + BLOCK_M, 0], q_ready.index(buf), q_smem.index(2 * buf + 1))
    base = step - cta_first  # block j's ring step is base + j
    for j in range(cta_first, cta_end):
        slot = (base + j) % NUM_STAGES
        free_phase = (((base + j) // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free_phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [batch, head_kv, key_start + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free_phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [batch, head_kv, key_start + j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))
        if Q_ROTATING:
            if j == cta_first:
                load_rotating_q(q_desc, q_smem, q_ready, q_empty, batch, head, start_m, rounds, 1, BLOCK_M)
    if Q_ROTATING:
        if cta_end == cta_first:
            load_rotating_q(q_desc, q_smem, q_ready, q_empty, batch, head, start_m, rounds, 1, BLOCK_M)


@gluon.jit
def load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                   v_empty, tile_slots, tile_full, tile_empty, TileCounter, KeyBounds, num_tiles, num_m_blocks,
                   group_heads, heads_q, kv_group, seqlen_k, diag_offset, window_left, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr,
                   TILE_COUNTER: gl.constexpr, Q_ROTATING: gl.constexpr, WINDOW: gl.constexpr,
                   KEY_LENGTHS: gl.constexpr, KEY_STARTS: gl.constexpr):
    """The load warp: load_tile for each of the program's tiles (tiles p, p + G, p + 2G, ... of a grid of G programs;
    with TILE_COUNTER, p and then whichever next_counted_tile gives, each handed to the consumers by hand_tile).
    ``step`` counts the blocks the program has moved, across its tiles, so ring slots and barrier phases run on from
    one tile to the next."""
    step = 0
    rounds = 0
    slot_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile = gl.program_id(0)
    while tile < num_tiles:
        if TILE_COUNTER:
            hand_tile(tile_slots, tile_full, tile_empty, rounds, tile, slot_layout)
        batch, head, start_m, cta_first, cta_end, _, key_start, _ = tile_at(
            tile, num_tiles, num_m_blocks, group_heads, heads_q, seqlen_k, KeyBounds, diag_offset, window_left,
            BLOCK_M, BLOCK_N, CAUSAL, WINDOW, KEY_LENGTHS, KEY_STARTS)
        load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  batch, head, start_m, cta_first, cta_end, key_start, kv_group, step, rounds, BLOCK_M, BLOCK_N,
                  NUM_STAGES, Q_BUFFERS, Q_ROTATING)
        step += cta_end - cta_first
        rounds += 1
        if TILE_COUNTER:
            tile = next_counted_tile(TileCounter, num_tiles)
        else:
            tile += gl.num_programs(0)
    if TILE_COUNTER:
        hand_tile(tile_slots, tile_full, tile_empty, rounds, num_tiles, slot_layout)


@gluon.jit
def block_tile(slots, slot):
    """Slot ``slot`` of a ring of (1, 1, rows, D) tiles as the (rows, D) tile the products read."""
    return slots.index(slot).reshape([slots.shape[3], slots.shape[4]])


@triton.constexpr_function
def output_parts(split):
    """How many accumulators one consumer's output takes: one over the tile's width, or with SPLIT_PRODUCTS two, over
    its first half and the quarter after it (a head dim of 3/4 of the tile: 192 in the 256-wide tile; the backward's
    S^T and dP^T also 96 in the 128-wide one), so that no product multiplies the columns past the head dim that the
    copy engine zero-fills (Gluon's register tensors, and so each wgmma's width, are a power of two)."""
    return 2 if split else 1


@gluon.jit
def zero_output(BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    """A consumer's output accumulators at zero: a tuple of one (BLOCK_M, HEAD_DIM) tensor, or with SPLIT of a
    (BLOCK_M, HEAD_DIM / 2) and a (BLOCK_M, HEAD_DIM / 4) one (output_parts)."""
    if SPLIT:
        return (gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, layout=mma_layout(HEAD_DIM // 2)),
                gl.zeros([BLOCK_M, HEAD_DIM // 4], gl.float32, layout=mma_layout(HEAD_DIM // 4)))
    else:
        return (gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=mma_layout(HEAD_DIM)), )


@gluon.jit
def scores_product(q_smem, k_tile, s_zero, SPLIT: gl.constexpr):
    """S = Q K^T of one key tile (k_tile: (keys, tile width)), issued asynchronously: over the whole width, or with
    SPLIT over the head dim's two parts (output_parts), the second adding onto the first. Each part is one wgmma
    group (the caller's warpgroup_mma_wait counts them)."""
    if SPLIT:
        half: gl.constexpr = q_smem.shape[1] // 2
        qk = warpgroup_mma(q_smem.slice(0, half, dim=1), k_tile.slice(0, half, dim=1).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        qk = warpgroup_mma(q_smem.slice(half, half // 2, dim=1), k_tile.slice(half, half // 2, dim=1).permute((1, 0)),
                           qk, is_async=True)
    else:
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return qk


@gluon.jit
def value_product(p, v_tile, acc, SPLIT: gl.constexpr):
    """acc += P V for one key tile (p: its probabilities in the input dtype, v_tile: (keys, tile width)), issued
    asynchronously, one wgmma group per accumulator (zero_output). Returns the accumulators' tokens (wait_output)."""
    if SPLIT:
        half: gl.constexpr = v_tile.shape[1] // 2
        p_first = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=mma_layout(half), k_width=2))
        p_second = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=mma_layout(half // 2), k_width=2))
        first = warpgroup_mma(p_first, v_tile.slice(0, half, dim=1), acc[0], is_async=True)
        second = warpgroup_mma(p_second, v_tile.slice(half, half // 2, dim=1), acc[1], is_async=True)
        return (first, second)
    else:
        width: gl.constexpr = v_tile.shape[1]
        p_operand = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=mma_layout(width), k_width=2))
        return (warpgroup_mma(p_operand, v_tile, acc[0], is_async=True), )


@gluon.jit
def wait_output(acc, SPLIT: gl.constexpr):
    """The output accumulators once every wgmma group issued so far has finished."""
    if SPLIT:
        return warpgroup_mma_wait(0, deps=acc)
    else:
        return (warpgroup_mma_wait(0, deps=acc), )


@gluon.jit
def scale_output(acc, row_factor, SPLIT: gl.constexpr):
    """Each accumulator's rows times row_factor (BLOCK_M floats in any row layout)."""
    first = acc[0] * gl.expand_dims(gl.convert_layout(row_factor, gl.SliceLayout(1, acc[0].type.layout)), 1)
    if SPLIT:
        second = acc[1] * gl.expand_dims(gl.convert_layout(row_factor, gl.SliceLayout(1, acc[1].type.layout)), 1)
        return (first, second)
    else:
        return (first, )


@gluon.jit
def masked_scores(qk, start_m, start_n, seqlen_k, diag_offset, window_left, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, layout: gl.constexpr):
    """Scores with invisible keys (past the sequence end, after the row's diagonal, or with WINDOW more than
    window_left before it) at -inf."""
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ok = gl.expand_dims(cols < seqlen_k, 0)
    if CAUSAL:
        ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + diag_offset, 1))
    if WINDOW:
        ok = ok & (gl.expand_dims(cols, 0) >= gl.expand_dims(rows + (diag_offset - window_left), 1))
    return gl.where(ok, qk, float("-inf"))


@gluon.jit
def softmax_step(qk, m_i, l_i, j, unmasked, start_m, seqlen_k, diag_offset, window_left, dropout, qk_scale2,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                 DROPOUT: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr, LAZY_RESCALE: gl.constexpr,
                 softcap_in2, SOFTCAP: gl.constexpr):
    """The online softmax of key block j, masked (masked_scores) as MASK says (MASK_FROM: unless j is in
    unmasked[0] .. unmasked[1] - 1, the blocks every row sees whole; without WINDOW unmasked[0] is 0):
    returns (p, alpha, m_new, l_new), p unnormalised in fp32, m in base-2 units of the scaled scores. The row
    maximum is taken of the unscaled scores and scaled once per row (qk_scale2 > 0: hopper_launch.why_not), so each
    exponent's argument, qk * qk_scale2 - m, is one fused multiply-add instead of a multiply over the whole block
    and then a subtraction. LAZY_RESCALE: m moves only where the block's top passes it by more than RESCALE_LOG2,
    and alpha is exactly 1 where it stays; the exponentials then stay below 2^RESCALE_LOG2 (within float32 and the
    16-bit P), and O / l and the lse are exact whichever reference a row used. SOFTCAP: qk becomes
    tanh(scale * qk / softcap) (softcap_in2 = 2 * log2(e) * scale / softcap) and qk_scale2 is softcap * log2(e), so
    the rest reads it as it reads plain scores; the tanh comes before the mask, which keeps masked scores at -inf."""
    if SOFTCAP:
        qk = softcap_tanh(qk * softcap_in2, True)  # (16-bit inputs only)
    if MASK == MASK_ALL:
        qk = masked_scores(qk, start_m, j * BLOCK_N, seqlen_k, diag_offset, window_left, BLOCK_M, BLOCK_N, CAUSAL,
                           WINDOW, s_layout)
    elif MASK == MASK_FROM:
        outside = j >= unmasked[1]
        if WINDOW:
            outside = outside | (j < unmasked[0])
        if outside:
            qk = masked_scores(qk, start_m, j * BLOCK_N, seqlen_k, diag_offset, window_left, BLOCK_M, BLOCK_N, CAUSAL,
                               WINDOW, s_layout)
    top = gl.max(qk, 1) * qk_scale2
    if LAZY_RESCALE:
        m_new = gl.where(top > m_i + RESCALE_LOG2, top, m_i)
    else:
        m_new = gl.maximum(m_i, top)
    # A row that has seen no visible key keeps m = -inf; shifting by 0 keeps exp2(-inf) = 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale2 - gl.expand_dims(m_shift, 1))
    if LAZY_RESCALE:
        alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_shift))
    else:
        alpha = gl.exp2(m_i - m_shift)
    l_new = l_i * alpha + gl.sum(p, 1)
    if DROPOUT:
        # Dropped after the row sum (l is the undropped softmax's): the P V product sees P * keep; consume_tile scales
        # the output by 1 / (1 - p).
        rows = gl.convert_layout(dropout[0], gl.SliceLayout(1, s_layout))
        # dropout[3]: the tile's first key (KEY_STARTS: tile_at), so each key hashes at its index in the sequence.
        cols = column_hashes(dropout[3] + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)))
        p = gl.where(keep_tile(rows, cols, dropout[1]), p, 0.0)
    return p, alpha, m_new, l_new


@gluon.jit
def attend_block(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s_zero, p, m_i, l_i, acc, j, unmasked,
                 step, start_m, seqlen_k, diag_offset, window_left, dropout, qk_scale2, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, KEYS: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 WINDOW: gl.constexpr, DROPOUT: gl.constexpr, MASK: gl.constexpr, LAZY_RESCALE: gl.constexpr,
                 softcap_in2, SOFTCAP: gl.constexpr, SPLIT: gl.constexpr):
    """Key block j (ring step step + j) after block j - 1's softmax (p): S_j goes to the tensor cores first, then
    P_{j-1} V_{j-1} behind it; while they run nothing waits, and the softmax of block j (masked as MASK says,
    softmax_step) starts once S_j alone has finished. KEYS < BLOCK_N: only the block's first KEYS keys are read (for
    rows that see no more of it: the lower consumer's causal diagonal, consume_tile); S, its softmax and the p
    returned are then KEYS wide. s_zero: S's (BLOCK_M, KEYS) initial value, made once by a caller that loops.
    LAZY_RESCALE: the output is rescaled only where some row's maximum moved (softmax_step). acc: the output
    accumulators (zero_output; SPLIT: two, over the head dim's parts, as S's products are).
    Returns (p, alpha, m, l, acc) after block j's softmax (its P V is the next step's or the caller's), m and l in the
    full-width block's row layout."""
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    k_layout: gl.constexpr = mma_layout(KEYS)
    o_layout: gl.constexpr = acc[0].type.layout
    slot = (step + j) % NUM_STAGES
    prev = (step + j - 1) % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), ((step + j) // NUM_STAGES) & 1)
    if KEYS == BLOCK_N:
        qk = scores_product(q_smem, block_tile(k_smem, slot), s_zero, SPLIT)
    else:
        qk = scores_product(q_smem, block_tile(k_smem, slot).slice(0, KEYS), s_zero, SPLIT)
        m_i = gl.convert_layout(m_i, gl.SliceLayout(1, k_layout))
        l_i = gl.convert_layout(l_i, gl.SliceLayout(1, k_layout))
    mbarrier.wait(v_ready.index(prev), ((step + j - 1) // NUM_STAGES) & 1)
    acc = value_product(p.to(q_smem.dtype), block_tile(v_smem, prev), acc, SPLIT)
    qk = warpgroup_mma_wait(output_parts(SPLIT), deps=(qk, ))  # S_j done; P_{j-1} V_{j-1} may still run
    mbarrier.arrive(k_empty.index(slot), count=1)
    # Block j of BLOCK_N keys is block j * BLOCK_N / KEYS of KEYS keys (softmax_step masks from j times its width;
    # a narrow block is masked throughout, MASK_ALL).
    block = j
    if KEYS != BLOCK_N:
        block = j * (BLOCK_N // KEYS)
    p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, block, unmasked, start_m, seqlen_k, diag_offset, window_left,
                                      dropout, qk_scale2, BLOCK_M, KEYS, CAUSAL, WINDOW, DROPOUT, MASK, k_layout,
                                      LAZY_RESCALE, softcap_in2, SOFTCAP)
    acc = wait_output(acc, SPLIT)
    mbarrier.arrive(v_empty.index(prev), count=1)
    alpha_rows = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    if LAZY_RESCALE:
        if gl.max(gl.where(alpha_rows != 1.0, 1, 0), 0) > 0:  # some row of the warpgroup moved its maximum
            acc = scale_output(acc, alpha_rows, SPLIT)
    else:
        acc = scale_output(acc, alpha_rows, SPLIT)
    if KEYS != BLOCK_N:
        m_i = gl.convert_layout(m_i, gl.SliceLayout(1, s_layout))
        l_i = gl.convert_layout(l_i, gl.SliceLayout(1, s_layout))
    return p, alpha, m_i, l_i, acc


@gluon.jit
def attend_blocks(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i, l_i, acc, first, end,
                  unmasked, step, start_m, seqlen_k, diag_offset, window_left, dropout, qk_scale2,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, DROPOUT: gl.constexpr, MASK: gl.constexpr, LAZY_RESCALE: gl.constexpr,
                  softcap_in2, SOFTCAP: gl.constexpr, SPLIT: gl.constexpr):
    """Key blocks first .. end - 1 of a tile whose ring steps start at ``step``, after block first - 1's softmax (p,
    alpha), each by attend_block. Returns (p, alpha, m, l, acc) after block end - 1's softmax (its P V is the
    caller's)."""
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout(BLOCK_N))
    for j in range(first, end):
        p, alpha, m_i, l_i, acc = attend_block(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s_zero, p,
                                               m_i, l_i, acc, j, unmasked, step, start_m, seqlen_k, diag_offset,
                                               window_left, dropout, qk_scale2, BLOCK_M, BLOCK_N, BLOCK_N, NUM_STAGES,
                                               CAUSAL, WINDOW, DROPOUT, MASK, LAZY_RESCALE, softcap_in2, SOFTCAP,
                                               SPLIT)
    return p, alpha, m_i, l_i, acc


@gluon.jit
def stage_columns(tile, parts, SPLIT: gl.constexpr):
    """Accumulators split by column (zero_output; the backward's dK and dV) in the input dtype into their columns of a
    (rows, tile width) shared tile, for the copy engine's store. With SPLIT the tile's last quarter, past the head dim,
    keeps what it held (the copy engine's store clips it)."""
    if SPLIT:
        half: gl.constexpr = tile.shape[1] // 2
        tile.slice(0, half, dim=1).store(parts[0].to(tile.dtype))
        tile.slice(half, half // 2, dim=1).store(parts[1].to(tile.dtype))
    else:
        tile.store(parts[0].to(tile.dtype))


@gluon.jit
def store_output_columns(part, out_base, stride_om, start_m, seqlen_q, FIRST_COL: gl.constexpr,
                         HEAD_COLS: gl.constexpr):
    """One normalised output accumulator (BLOCK_M rows from start_m; columns FIRST_COL on) stored by the threads,
    rows past Nq and columns past the head dim (the tile's zero fill) left out."""
    layout: gl.constexpr = part.type.layout
    rows = start_m + gl.arange(0, part.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, part.shape[1], layout=gl.SliceLayout(0, layout))
    if FIRST_COL > 0:
        cols = cols + FIRST_COL
    o_ptrs = out_base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    keep = gl.expand_dims(rows < seqlen_q, 1)
    if FIRST_COL + part.shape[1] > HEAD_COLS:
        keep = keep & gl.expand_dims(cols < HEAD_COLS, 0)
    gl.store(o_ptrs, part.to(out_base.dtype.element_ty), mask=keep)


@gluon.jit
def release_unused_blocks(k_ready, k_empty, v_ready, v_empty, step, first, end, NUM_STAGES: gl.constexpr):
    """Blocks [first, end) of a tile (block j at ring step step + j) that the other consumer needs and this one does
    not (a causal tile's upper rows see later keys, a window's lower rows earlier ones): wait until each has landed,
    then release it, so slot phases stay in step."""
    for j in range(first, end):
        slot = (step + j) % NUM_STAGES
        phase = ((step + j) // NUM_STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot), count=1)
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot), count=1)


@gluon.jit
def release_previous_q_slot(q_empty, rounds, HALF: gl.constexpr, Q_BUFFERS: gl.constexpr, Q_ROTATING: gl.constexpr):
    """Hand this consumer's Q slot of the previous tile (if this is not the program's first tile) back to the load
    warp once the copy engine has read the output staged in it (every thread waits at the barrier for the one that
    issued the store)."""
    if rounds > 0:
        tma.store_wait(0)
        thread_barrier()
        _, barrier, _ = q_slot(rounds - 1, HALF, Q_BUFFERS, Q_ROTATING)
        mbarrier.arrive(q_empty.index(barrier), count=1)


@gluon.jit
def consume_tile(q_slots, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, rounds, step,
                 o_desc, out_base, stride_om, lse_base, batch, head, start_m, cta_first, cta_end, seqlen_q, seqlen_k,
                 diag_offset, window_left, dropout, qk_scale2, HALF: gl.constexpr, HEAD_DIM: gl.constexpr,
                 HEAD_COLS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                 Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DROPOUT: gl.constexpr,
                 SPLIT_MASKED: gl.constexpr, HALF_DIAGONAL: gl.constexpr, LAZY_RESCALE: gl.constexpr,
                 Q_ROTATING: gl.constexpr, softcap_in2, SOFTCAP: gl.constexpr, SPLIT_PRODUCTS: gl.constexpr):
    """One softmax warpgroup on one tile (the program's ``rounds``-th): BLOCK_M query rows from start_m in its Q slot
    (q_slot), every key block they see (of the tile's blocks cta_first .. cta_end - 1, ring slots from ``step`` on),
    then the output.

    With two Q buffers, the output is staged in this tile's Q slot (its S products are done by then) and written by
    the copy engine, and the slot goes back to the load warp once the next tile's first product has run, so the
    store's read of shared memory is long over. With one (d = 256: no room for a second), Q's slot is handed back as
    soon as the tile's last S product has finished, so the next tile's Q loads under this tile's last P V product,
    and the output is stored from registers. With three rotating slots (Q_ROTATING), the upper consumer stages its
    output as with two buffers (its slot is next needed two tiles on) and the lower one hands its slot back after its
    last S product (the upper consumer's next tile takes it) and stores from registers."""
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    dtype: gl.constexpr = q_slots.dtype
    slot_index, q_barrier, q_phase = q_slot(rounds, HALF, Q_BUFFERS, Q_ROTATING)
    own_slot = q_slots.index(slot_index)
    q_smem = own_slot.reshape([BLOCK_M, HEAD_DIM])
    staged: gl.constexpr = Q_BUFFERS == 2 or (Q_ROTATING and HALF == 1)

    first, num_blocks, full_first, full = visible_key_blocks(start_m, seqlen_k, diag_offset, window_left, BLOCK_M,
                                                             BLOCK_N, CAUSAL, WINDOW)
    if not WINDOW:  # (constants again, so that the compiler sees the loops' first bounds as before WINDOW existed)
        first = 0
        full_first = 0
    unmasked = (full_first, full)
    # Block j is at ring step base + j.
    base = step - cta_first
    sees_keys = num_blocks > first
    if WINDOW:
        # The tile's blocks before this consumer's first (a window's upper rows start later than the lower ones) go
        # back at once; where it sees none, all of them.
        first = gl.where(sees_keys, first, cta_end)
        num_blocks = gl.where(sees_keys, num_blocks, cta_end)
        release_unused_blocks(k_ready, k_empty, v_ready, v_empty, base, cta_first, first, NUM_STAGES)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = zero_output(BLOCK_M, HEAD_DIM, SPLIT_PRODUCTS)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_ready.index(q_barrier), q_phase)

    if sees_keys:
        slot = (base + first) % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), ((base + first) // NUM_STAGES) & 1)
        qk = scores_product(q_smem, block_tile(k_smem, slot), s_zero, SPLIT_PRODUCTS)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        if staged:
            release_previous_q_slot(q_empty, rounds, HALF, Q_BUFFERS, Q_ROTATING)
        # The lower consumer on a causal diagonal that starts at a key block's first key sees only that block's
        # first half (BLOCK_N = 2 * BLOCK_M): the loops stop before it, attend_block takes half of it.
        if HALF_DIAGONAL and HALF == 0 and CAUSAL and BLOCK_N == 2 * BLOCK_M and not WINDOW:
            diagonal = start_m + diag_offset
            half_diagonal = (diagonal >= BLOCK_N) & (diagonal % BLOCK_N == 0) & (diagonal == (num_blocks - 1) * BLOCK_N)
            end = num_blocks - half_diagonal.to(gl.int32)
        else:
            half_diagonal = False
            end = num_blocks
        if SPLIT_MASKED:
            # The blocks every row sees whole, then those with invisible keys (the causal diagonal, the sequence's
            # end; a window's first blocks before them): loops apart, so that the unmasked one carries none of the
            # mask's work or registers.
            if (first >= full_first) & (first < full):
                p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, first, unmasked, start_m, seqlen_k, diag_offset,
                                                  window_left, dropout, qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                                                  DROPOUT, MASK_NONE, s_layout, LAZY_RESCALE, softcap_in2, SOFTCAP)
            else:
                p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, first, unmasked, start_m, seqlen_k, diag_offset,
                                                  window_left, dropout, qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                                                  DROPOUT, MASK_ALL, s_layout, LAZY_RESCALE, softcap_in2, SOFTCAP)
            unmasked_first = first + 1
            if WINDOW:
                unmasked_first = gl.minimum(gl.maximum(full_first, first + 1), end)
                p, alpha, m_i, l_i, acc = attend_blocks(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                                        p, alpha, m_i, l_i, acc, first + 1, unmasked_first, unmasked,
                                                        base, start_m, seqlen_k, diag_offset, window_left, dropout,
                                                        qk_scale2, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, WINDOW,
                                                        DROPOUT, MASK_ALL, LAZY_RESCALE, softcap_in2, SOFTCAP,
                                                        SPLIT_PRODUCTS)
            unmasked_end = gl.maximum(full, unmasked_first)  # <= end: a half diagonal block is the one past full
            if WINDOW:
                unmasked_end = gl.minimum(unmasked_end, end)
            p, alpha, m_i, l_i, acc = attend_blocks(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p,
                                                    alpha, m_i, l_i, acc, unmasked_first, unmasked_end, unmasked, base,
                                                    start_m, seqlen_k, diag_offset, window_left, dropout, qk_scale2,
                                                    BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, WINDOW, DROPOUT, MASK_NONE,
                                                    LAZY_RESCALE, softcap_in2, SOFTCAP, SPLIT_PRODUCTS)
            p, alpha, m_i, l_i, acc = attend_blocks(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p,
                                                    alpha, m_i, l_i, acc, unmasked_end, end, unmasked, base,
                                                    start_m, seqlen_k, diag_offset, window_left, dropout, qk_scale2,
                                                    BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, WINDOW, DROPOUT, MASK_ALL,
                                                    LAZY_RESCALE, softcap_in2, SOFTCAP, SPLIT_PRODUCTS)
        else:
            p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, first, unmasked, start_m, seqlen_k, diag_offset,
                                              window_left, dropout, qk_scale2, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                                              DROPOUT, MASK_FROM, s_layout, LAZY_RESCALE, softcap_in2, SOFTCAP)
            p, alpha, m_i, l_i, acc = attend_blocks(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p,
                                                    alpha, m_i, l_i, acc, first + 1, end, unmasked, base, start_m,
                                                    seqlen_k, diag_offset, window_left, dropout, qk_scale2, BLOCK_M,
                                                    BLOCK_N, NUM_STAGES, CAUSAL, WINDOW, DROPOUT, MASK_FROM,
                                                    LAZY_RESCALE, softcap_in2, SOFTCAP, SPLIT_PRODUCTS)
        last = (base + num_blocks - 1) % NUM_STAGES
        if half_diagonal:
            half_zero = gl.zeros([BLOCK_M, BLOCK_N // 2], gl.float32, layout=mma_layout(BLOCK_N // 2))
            p_half, _, m_i, l_i, acc = attend_block(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                                    half_zero, p, m_i, l_i, acc, num_blocks - 1, (0, 0), base,
                                                    start_m, seqlen_k, diag_offset, window_left, dropout, qk_scale2,
                                                    BLOCK_M, BLOCK_N, BLOCK_N // 2, NUM_STAGES, CAUSAL, WINDOW,
                                                    DROPOUT, MASK_ALL, LAZY_RESCALE, softcap_in2, SOFTCAP,
                                                    SPLIT_PRODUCTS)
            if not staged:
                # Every S product of this tile has finished: Q's slot may take the next tile's rows.
                mbarrier.arrive(q_empty.index(q_barrier), count=1)
            mbarrier.wait(v_ready.index(last), ((base + num_blocks - 1) // NUM_STAGES) & 1)
            acc = value_product(p_half.to(dtype), block_tile(v_smem, last).slice(0, BLOCK_N // 2), acc,
                                SPLIT_PRODUCTS)
            acc = wait_output(acc, SPLIT_PRODUCTS)
        else:
            if not staged:
                mbarrier.arrive(q_empty.index(q_barrier), count=1)
            mbarrier.wait(v_ready.index(last), ((base + num_blocks - 1) // NUM_STAGES) & 1)
            acc = value_product(p.to(dtype), block_tile(v_smem, last), acc, SPLIT_PRODUCTS)
            acc = wait_output(acc, SPLIT_PRODUCTS)
        mbarrier.arrive(v_empty.index(last), count=1)
    else:
        if staged:
            release_previous_q_slot(q_empty, rounds, HALF, Q_BUFFERS, Q_ROTATING)
        else:
            mbarrier.arrive(q_empty.index(q_barrier), count=1)
    release_unused_blocks(k_ready, k_empty, v_ready, v_empty, base, num_blocks, cta_end, NUM_STAGES)

    # Rows that saw no visible key have l = 0: output 0, lse -inf.
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    inverse_l = 1.0 / l_safe
    if DROPOUT:
        inverse_l = dropout[2] / l_safe  # 1 / (1 - p) for the dropped P
    out = scale_output(acc, inverse_l, SPLIT_PRODUCTS)
    if staged:
        # The copy engine clips rows past Nq and columns past the head dim (the tensor map's bounds).
        stage_columns(q_smem, out, SPLIT_PRODUCTS)
        fence_async_shared()
        thread_barrier()
        tma_store(o_desc, [batch, head, start_m, 0], own_slot)
    else:
        store_output_columns(out[0], out_base, stride_om, start_m, seqlen_q, 0, HEAD_COLS)
        if SPLIT_PRODUCTS:
            store_output_columns(out[1], out_base, stride_om, start_m, seqlen_q, HEAD_DIM // 2, HEAD_COLS)
    lse_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_base + lse_rows, lse, mask=lse_rows < seqlen_q)


@gluon.jit
def consume_program_tile(q_slots, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, Out,
                         stride_ob, stride_oh, stride_om, Lse, stride_lb, stride_lh, KeyBounds, rng, tile, rounds,
                         step, num_tiles, num_m_blocks, group_heads, heads_q, seqlen_q, seqlen_k, diag_offset,
                         window_left, qk_scale2, HALF: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_COLS: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                         Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, KEY_LENGTHS: gl.constexpr,
                         KEY_STARTS: gl.constexpr, DROPOUT: gl.constexpr, SPLIT_MASKED: gl.constexpr,
                         HALF_DIAGONAL: gl.constexpr, LAZY_RESCALE: gl.constexpr, Q_ROTATING: gl.constexpr,
                         softcap_in2, SOFTCAP: gl.constexpr, SPLIT_PRODUCTS: gl.constexpr):
    """consume_tile on tile number ``tile``, the program's ``rounds``-th; returns the ring steps it took. rng: (Seed,
    threshold, dropout_scale), read with DROPOUT."""
    batch, head, tile_m, cta_first, cta_end, seqlen_k, key_start, diag_offset = tile_at(
        tile, num_tiles, num_m_blocks, group_heads, heads_q, seqlen_k, KeyBounds, diag_offset, window_left, BLOCK_M,
        BLOCK_N, CAUSAL, WINDOW, KEY_LENGTHS, KEY_STARTS)
    out_base = Out + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
    lse_base = Lse + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
    if DROPOUT:  # (the consumer's rows' keys of the RNG, the threshold, 1 / (1 - p) and the tile's first key, from
        # which its key blocks count: softmax_step, consume_tile)
        Seed, threshold, dropout_scale = rng
        rows = tile_m + HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout(BLOCK_N)))
        dropout = (row_keys(head_key(batch * heads_q + head, gl.load(Seed)), rows, gl.load(Seed + 2)), threshold,
                   dropout_scale, key_start)
    else:
        dropout = (0, 0, 1.0, 0)
    consume_tile(q_slots, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, rounds, step,
                 o_desc, out_base, stride_om, lse_base, batch, head, tile_m + HALF * BLOCK_M, cta_first, cta_end,
                 seqlen_q, seqlen_k, diag_offset, window_left, dropout, qk_scale2, HALF, HEAD_DIM, HEAD_COLS, BLOCK_M,
                 BLOCK_N, NUM_STAGES, Q_BUFFERS, CAUSAL, WINDOW, DROPOUT, SPLIT_MASKED, HALF_DIAGONAL, LAZY_RESCALE,
                 Q_ROTATING, softcap_in2, SOFTCAP, SPLIT_PRODUCTS)
    return cta_end - cta_first


@gluon.jit
def consumer_partition(q_slots, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc,
                       Out, stride_ob, stride_oh, stride_om, Lse, stride_lb, stride_lh, KeyBounds, rng, tile_slots,
                       tile_full, tile_empty, num_tiles, num_m_blocks, group_heads, heads_q, seqlen_q, seqlen_k,
                       diag_offset, window_left, qk_scale2, HALF: gl.constexpr, HEAD_DIM: gl.constexpr,
                       HEAD_COLS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                       KEY_LENGTHS: gl.constexpr, KEY_STARTS: gl.constexpr, DROPOUT: gl.constexpr,
                       TILE_COUNTER: gl.constexpr, SPLIT_MASKED: gl.constexpr, HALF_DIAGONAL: gl.constexpr,
                       LAZY_RESCALE: gl.constexpr, Q_ROTATING: gl.constexpr, softcap_in2, SOFTCAP: gl.constexpr,
                       SPLIT_PRODUCTS: gl.constexpr):
    """One softmax warpgroup: rows HALF * BLOCK_M .. (HALF + 1) * BLOCK_M of each of the program's tiles, in the
    load warp's order (``step`` and ``rounds`` follow its ring slots and Q rounds): round-robin, or with TILE_COUNTER
    the tile numbers the load warp hands over (take_tile)."""
    step = 0
    rounds = 0
    slot_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if TILE_COUNTER:
        tile = take_tile(tile_slots, tile_full, tile_empty, 0, slot_layout)
    else:
        tile = gl.program_id(0)
    while tile < num_tiles:
        step += consume_program_tile(q_slots, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                                     o_desc, Out, stride_ob, stride_oh, stride_om, Lse, stride_lb, stride_lh,
                                     KeyBounds, rng, tile, rounds, step, num_tiles, num_m_blocks, group_heads, heads_q,
                                     seqlen_q, seqlen_k, diag_offset, window_left, qk_scale2, HALF, HEAD_DIM,
                                     HEAD_COLS, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFFERS, CAUSAL, WINDOW, KEY_LENGTHS,
                                     KEY_STARTS, DROPOUT, SPLIT_MASKED, HALF_DIAGONAL, LAZY_RESCALE, Q_ROTATING,
                                     softcap_in2, SOFTCAP, SPLIT_PRODUCTS)
        rounds += 1
        if TILE_COUNTER:
            tile = take_tile(tile_slots, tile_full, tile_empty, rounds, slot_layout)
        else:
            tile += gl.num_programs(0)
    # The last tile's staged output must be read before the program's shared memory goes.
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_m_blocks", "num_tiles", "group_heads", "diag_offset",
                              "window_left", "threshold", "stride_lb", "stride_lh"])
def hopper_forward_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, Lse, TileCounter, KeyBounds, Seed,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    heads_q, kv_group, seqlen_q, seqlen_k, num_m_blocks, num_tiles, group_heads, qk_scale2, diag_offset, window_left,
    threshold, dropout_scale, softcap_in2,
    HEAD_DIM: gl.constexpr, HEAD_COLS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, TILE_COUNTER: gl.constexpr,
    SPLIT_MASKED: gl.constexpr, HALF_DIAGONAL: gl.constexpr = False, LAZY_RESCALE: gl.constexpr = False,
    Q_ROTATING: gl.constexpr = False, WINDOW: gl.constexpr = False, KEY_LENGTHS: gl.constexpr = False,
    DROPOUT: gl.constexpr = False, SOFTCAP: gl.constexpr = False, SPLIT_PRODUCTS: gl.constexpr = False,
    KEY_STARTS: gl.constexpr = False,
):
    """q_desc, k_desc, v_desc, o_desc: host tensor maps (hopper_launch.tensor_map) of Q and Out (B, Hq, Nq, D) in
    blocks of (1, 1, BLOCK_M, HEAD_DIM) and of K, V (B, Hkv, Nk, D) in blocks of (1, 1, BLOCK_N, HEAD_DIM): the copy
    engine zero-fills rows past each head's sequence end (and clips the output's), and no program spends time making
    maps. D = HEAD_COLS, the head dim; HEAD_DIM is the tiles' width, a power of two >= D (hopper_launch.TILE_WIDTH),
    whose columns past D the copy engine zero-fills (and clips from the output).
    Out (B, Hq, Nq, D): any strides, last dim contiguous (read through o_desc with two Q buffers, through Out and its
    strides with one). Lse (B, Hq, Nq) fp32 by (stride_lb, stride_lh), natural log. Query head h reads key/value
    head h // kv_group; qk_scale2 = scale * log2(e) > 0; causal: query row i sees keys j <= i + diag_offset; WINDOW:
    no key j < i + diag_offset - window_left (a sliding window, causal or not; window_left >= 0, unread without it).
    KEY_LENGTHS: batch entry b has KeyBounds[b] keys (int32, <= Nk; the keys after them are padding no row sees, as a
    right-padding key mask says: hopper_launch.why_not), so its tiles move and compute only the blocks before that;
    without it KeyBounds is not read. KEY_STARTS (with KEY_LENGTHS): KeyBounds holds 2B int32, and batch entry b's
    keys are KeyBounds[B + b] .. KeyBounds[b] - 1 (a left- or both-sides-padding key mask: its tiles skip the padding
    on both sides, tile_at; with DROPOUT the RNG still hashes each key at its index from key 0). DROPOUT: P is
    dropped with the shared RNG (rng.py: Seed's int32 words 0 and 2, threshold the uint32 threshold's bit pattern)
    and the output scaled by dropout_scale = 1 / (1 - p); the lse is the undropped softmax's. Without it Seed,
    threshold and dropout_scale are not read. SOFTCAP: the scores are
    softcap * tanh(scale * qk / softcap): softcap_in2 = 2 * log2(e) * scale / softcap, and qk_scale2 is then
    softcap * log2(e) (> 0); without it softcap_in2 is not read. SPLIT_PRODUCTS (a head dim of 3/4 of the tile
    width: 192 of 256): each product runs over the head dim's columns only, in two parts (output_parts), instead of
    multiplying the zero fill past it.

    Tiles of 2 * BLOCK_M query rows: num_m_blocks = cdiv(Nq, 2 * BLOCK_M) per (batch, head), num_tiles =
    B * Hq * num_m_blocks, in tile_rows' order (group_heads: its causal groups). Program p takes tiles p, p + G,
    p + 2G, ... of a grid of G programs: G = num_tiles is one tile per program, a smaller G a persistent grid,
    whose next tile's loads run under this tile's last products and output. TILE_COUNTER: after its first, program p
    takes the next tile no program has taken yet from TileCounter (int32, 0 at the launch and left at 0 by it:
    causal tiles differ in work, and whichever program is free first takes the next); without it TileCounter is not
    read.
    Q_BUFFERS (1 or 2): Q buffers, so that the next tile's Q loads during this one (consume_tile); Q_ROTATING (with
    one buffer): three Q slots taken in turn instead of two, so that the lower consumer's next Q loads during this
    tile and the upper consumer's output goes through the copy engine (q_slot, consume_tile). SPLIT_MASKED: a
    tile's key blocks run as two loops, the unmasked ones and then those that need the mask, instead of one loop that
    checks each block. HALF_DIAGONAL: the lower consumer's causal diagonal block at half width where its rows see only
    that half (attend_block on half its keys). LAZY_RESCALE: a row's maximum moves only past 2^RESCALE_LOG2 growth, and
    a consumer whose rows' maxima all stayed skips the output's rescaling (softmax_step).
    Launched with 4 warps (the first consumer) plus the partitions' own."""
    dtype: gl.constexpr = q_desc.dtype

    # Slots of (1, 1, rows, D) tiles, as the copy engine writes them (the products read them as (rows, D)); Q buffer
    # b holds the two consumers' tiles at slots 2b and 2b + 1 (Q_ROTATING: see q_slot).
    q_slots: gl.constexpr = 3 if Q_ROTATING else 2 * Q_BUFFERS  # one consumer's BLOCK_M rows each
    q_pairs: gl.constexpr = 3 if Q_ROTATING else Q_BUFFERS  # Q's ready/empty barrier pairs
    q_users: gl.constexpr = 1 if Q_ROTATING else 2  # consumers releasing one pair's slots
    q_smem = gl.allocate_shared_memory(dtype, [q_slots, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [q_pairs, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [q_pairs, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # TILE_COUNTER: the tile numbers the load warp hands the consumers (hand_tile), in two slots.
    tile_slots = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(2):
        mbarrier.init(tile_full.index(slot), count=1)
        mbarrier.init(tile_empty.index(slot), count=2)  # one arrival per consumer
    for pair in gl.static_range(q_pairs):
        mbarrier.init(q_ready.index(pair), count=1)
        mbarrier.init(q_empty.index(pair), count=q_users)  # one arrival per consumer using it
    for slot in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(k_empty.index(slot), count=2)
        mbarrier.init(v_empty.index(slot), count=2)

    gl.warp_specialize([
        (consumer_partition, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, Out,
                              stride_ob, stride_oh, stride_om, Lse, stride_lb, stride_lh, KeyBounds,
                              (Seed, threshold, dropout_scale), tile_slots, tile_full, tile_empty, num_tiles,
                              num_m_blocks, group_heads, heads_q, seqlen_q, seqlen_k, diag_offset, window_left,
                              qk_scale2, 0, HEAD_DIM, HEAD_COLS, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFFERS, CAUSAL,
                              WINDOW, KEY_LENGTHS, KEY_STARTS, DROPOUT, TILE_COUNTER, SPLIT_MASKED, HALF_DIAGONAL,
                              LAZY_RESCALE, Q_ROTATING, softcap_in2, SOFTCAP, SPLIT_PRODUCTS)),
        (consumer_partition, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, Out,
                              stride_ob, stride_oh, stride_om, Lse, stride_lb, stride_lh, KeyBounds,
                              (Seed, threshold, dropout_scale), tile_slots, tile_full, tile_empty, num_tiles,
                              num_m_blocks, group_heads, heads_q, seqlen_q, seqlen_k, diag_offset, window_left,
                              qk_scale2, 1, HEAD_DIM, HEAD_COLS, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFFERS, CAUSAL,
                              WINDOW, KEY_LENGTHS, KEY_STARTS, DROPOUT, TILE_COUNTER, SPLIT_MASKED, HALF_DIAGONAL,
                              LAZY_RESCALE, Q_ROTATING, softcap_in2, SOFTCAP, SPLIT_PRODUCTS)),
        (load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                          v_empty, tile_slots, tile_full, tile_empty, TileCounter, KeyBounds, num_tiles,
                          num_m_blocks, group_heads, heads_q, kv_group, seqlen_k, diag_offset, window_left, BLOCK_M,
                          BLOCK_N, NUM_STAGES, Q_BUFFERS, CAUSAL, TILE_COUNTER, Q_ROTATING, WINDOW, KEY_LENGTHS,
                          KEY_STARTS)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])
