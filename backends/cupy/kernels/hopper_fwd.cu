// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, a producer warpgroup and consumer warpgroups.
//
// The kernel can be persistent: CTAs walk tiles of BLOCK_M = 64 * CONSUMERS query rows of one (batch, head) (tile_at's
// order), so the loads of a tile's first blocks overlap the end of the one before. A CTA's first tile is its index;
// then, with a tile counter (tiles of unequal cost: a causal mask or a window), the next one not yet taken (an
// atomic add: whichever CTA is free takes the next tile), else the one gridDim.x further. The producer hands each
// tile index to the consumers through shared memory. A CTA has 1 + CONSUMERS warpgroups:
//   warpgroup 0, the producer: one thread issues the TMA copies: per tile Q (once the consumers are done with the
//     last tile's Q), then K and V of each key block into rings of STAGES slots that run on across tiles; a slot
//     is loaded again once every consumer warp has released it;
//   warpgroups 1..CONSUMERS, the consumers: 64 query rows each. Per key block: S = Q K^T (wgmma, both operands
//     in shared memory), online softmax in registers, O += P V (wgmma, P from registers). S of the next key
//     block is issued before P V of this one, so the softmax of a block runs while the tensor cores multiply.
// The producer gives registers back (setmaxnreg) so the consumers can hold S, P and O at once. With PINGPONG (two
// consumers) the consumers take turns to issue their products (two named barriers): one warpgroup's products
// queue on the tensor cores while the other runs its softmax.
// With STAGED_OUT, Q has two buffers that tiles take in turn, so the next tile's Q loads while this one runs, and a
// consumer writes its normalised output into its rows of the tile's Q buffer (free once its last S product is done)
// for the copy engine to store through a fourth tensor map (of O, boxes of 64 rows): one bulk store per 64-column
// chunk instead of scattered 4-byte stores from the accumulators. The buffer goes back to the producer after the
// next tile's first S product, when the store has long been read. Without it, Q's one buffer goes back after the
// tile's last S product and the output is stored from registers.
//
// Q, K, V are read through tensor maps over (column, row, head, batch) (innermost first; backends/cupy/tensor_maps.py),
// boxes of 64 columns x BLOCK_M (Q) or BLOCK_N (K, V) rows with the 128-byte swizzle: rows past a head's sequence
// end read as zeros. Out: O (B, Hq, Nq, D) with the caller's strides; lse (B, Hq, Nq) float32, natural log, -inf
// for a row that sees no key (whose output is 0). Masking: the causal / sliding-window band of common.cuh's
// Bounds (unbounded sides as 2^30) and the keys past seqlen_k, tested per element only in the key blocks that
// cut them.
//
// BOOL_MASK: a boolean attn_mask (True = attend; mask and its four strides, any of them 0) hides scores after the band
// does. FLOAT_MASK: an additive float32 attn_mask (float_mask and its four strides) is added to them after that.
// SOFTCAP: each block's scores become softcap * tanh(s scale / softcap) before the mask and the softmax (softcap_in2,
// softcap_out2: common.cuh's Softcap; unused without it).
// LAZY_RESCALE: a row's running maximum (the reference its exponents are taken from) moves only when a block's top
// score passes it by more than RESCALE_LOG2; a warp whose rows' maxima all stay skips the rescaling of its output
// accumulators (HEAD_DIM / 2 multiplies a thread a block). Exponents then stay below 2^RESCALE_LOG2, far inside float32
// and the 16-bit P, and O / l and the lse are exact whichever reference the row used.
//
// -D options: MHATTN_BF16, HEAD_DIM (64, 128, 256: whole 64-column chunks), BLOCK_N (64 or 128), STAGES,
// CONSUMERS (2 or 3), PINGPONG (0 or 1, with 2 consumers), STAGED_OUT (0 or 1), LAZY_RESCALE (0 or 1),
// TURNS_ACROSS_TILES (0 or 1), BOOL_MASK (0 or 1), FLOAT_MASK (0 or 1), SOFTCAP (0 or 1), SMEM_BYTES (dynamic shared
// memory the host gives; checked against the layout below).
#define NUM_WARPS (4 * (CONSUMERS + 1))
#include "common.cuh"
#include "hopper.cuh"

constexpr int BLOCK_M = 64 * CONSUMERS;
constexpr int D_CHUNKS = HEAD_DIM / 64;        // 64-column chunks of a row (one 128-byte swizzled tile each)
constexpr int S_REGS = BLOCK_N / 2;            // score accumulators per thread (64 rows x BLOCK_N per warpgroup)
constexpr int O_REGS = HEAD_DIM / 2;           // output accumulators per thread
constexpr int P_STEPS = BLOCK_N / 16;          // k16 steps of P V
constexpr u32 ROW_BYTES = 128;                 // one row of a column chunk
constexpr u32 Q_CHUNK_BYTES = BLOCK_M * ROW_BYTES;
constexpr u32 KV_CHUNK_BYTES = BLOCK_N * ROW_BYTES;
constexpr u32 Q_BYTES = Q_CHUNK_BYTES * D_CHUNKS;
constexpr u32 KV_BYTES = KV_CHUNK_BYTES * D_CHUNKS;  // one K or V slot
constexpr u32 SWIZZLE_ATOM = 1024;             // 8 rows of 128 bytes: the tiles' alignment and wgmma's row-group stride
constexpr int Q_BUFS = STAGED_OUT ? 2 : 1;     // Q buffers the tiles take in turn
// Shared memory from a 1024-byte aligned base: the Q buffers, the K slots, the V slots, then the barriers.
constexpr u32 K_OFFSET = Q_BUFS * Q_BYTES;
constexpr u32 V_OFFSET = K_OFFSET + STAGES * KV_BYTES;
constexpr u32 BAR_OFFSET = V_OFFSET + STAGES * KV_BYTES;
// q_full, q_empty per Q buffer; tile_full, tile_empty for each of two tile slots; k_full, v_full, k_empty, v_empty
// per ring slot
constexpr u32 BAR_COUNT = 2 * Q_BUFS + 4 + 4 * STAGES;
constexpr u32 TILE_OFFSET = BAR_OFFSET + 8 * BAR_COUNT;  // two tile indices
constexpr u32 LAYOUT_BYTES = TILE_OFFSET + 8 + SWIZZLE_ATOM;  // + the worst-case alignment shift
constexpr u32 CONSUMER_WARPS = 4 * CONSUMERS;  // each releases a slot once
// Register budgets (setmaxnreg), within what the CTA got at launch (budgets_fit_launch).
constexpr int PRODUCER_REGS = CONSUMERS == 3 ? 56 : HEAD_DIM == 256 ? 40 : 56;
constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 152 : HEAD_DIM == 256 ? 232 : 224;  // d = 256: O is 128 a thread
// The consumers' warpgroup index taken from lane 0 (a shuffle), so that ptxas can prove the Q operand's wgmma
// descriptors uniform and form them in uniform registers (16 moves there a block fewer at d = 128). H100: d = 64
// +1-3%, d = 128 level, d = 256 2-4% slower (its spills grow), so d = 256 keeps the per-thread value (NOTES, H20).
constexpr bool UNIFORM_WARPGROUP = HEAD_DIM <= 128;
constexpr float LN2 = 0.6931471805599453f;
constexpr float RESCALE_LOG2 = 8.f;  // LAZY_RESCALE: how far (log2 units) a block's top may pass a row's maximum
static_assert(HEAD_DIM % 64 == 0, "HEAD_DIM must be whole 64-column chunks");
static_assert(BLOCK_N == 64 || BLOCK_N == 128, "BLOCK_N must be 64 or 128 (the wgmma_ss overloads)");
static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
static_assert(LAYOUT_BYTES <= SMEM_BYTES, "the host gives less shared memory than the layout needs");
static_assert(budgets_fit_launch(NUM_THREADS, PRODUCER_REGS, 128 * CONSUMERS, CONSUMER_REGS),
              "register budgets exceed what the CTA gets at launch");
static_assert(!PINGPONG || CONSUMERS == 2, "the ping-pong schedule takes two consumers");
static_assert(STAGED_OUT == 0 || STAGED_OUT == 1, "STAGED_OUT is 0 or 1");
static_assert(LAZY_RESCALE == 0 || LAZY_RESCALE == 1, "LAZY_RESCALE is 0 or 1");
static_assert(TURNS_ACROSS_TILES == 0 || TURNS_ACROSS_TILES == 1, "TURNS_ACROSS_TILES is 0 or 1");
constexpr int STAGE_BARRIER = 3;  // named barriers 3.. (one per consumer): its output rows written to shared memory

// The Q buffers and their barriers: full = the buffer's copy landed; empty = every consumer warp is done with it.
struct QBuffers : BarrierPairs<Q_BUFS> {
  u32 base;  // the first buffer
  MHATTN_DEVICE u32 slot(int b) const { return base + b * Q_BYTES; }
};

// The ring slots' barriers, K's slots then V's: full = the slot's copy landed; empty = every consumer warp is done
// with it.
struct Slots : BarrierPairs<2 * STAGES> {
  MHATTN_DEVICE u32 k_full(int s) const { return full(s); }
  MHATTN_DEVICE u32 v_full(int s) const { return full(STAGES + s); }
  MHATTN_DEVICE u32 k_empty(int s) const { return empty(s); }
  MHATTN_DEVICE u32 v_empty(int s) const { return empty(STAGES + s); }
};

// The key blocks a CTA's query rows [m0, m0 + rows) may see: [first, first + count).
struct KeyBlocks {
  int first, count;
};
MHATTN_DEVICE KeyBlocks key_blocks(int m0, int rows, int seqlen_k, const Bounds& bounds) {
  const i64 lowest = (i64)m0 + bounds.diag_offset - bounds.left;               // first key of the first row
  const i64 highest = (i64)(m0 + rows - 1) + bounds.diag_offset + bounds.right;  // last key of the last row
  const i64 n_blocks = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
  const i64 first = lowest <= 0 ? 0 : min_of<i64>(lowest / BLOCK_N, n_blocks);
  const i64 end = highest < 0 ? 0 : min_of<i64>(highest / BLOCK_N + 1, n_blocks);
  return {(int)first, (int)max_of<i64>(end - first, 0)};
}

// What every tile shares, and the tiles' order.
struct Problem {
  int seqlen_q, seqlen_k, heads_q, group;
  int n_mblocks, pairs, sched_pairs;  // query tiles per (batch, head); (batch, head) pairs; pairs per group
  Bounds bounds;
  const unsigned char* mask;  // BOOL_MASK: the boolean attn_mask and its strides
  i64 m_sb, m_sh, m_sq, m_sk;
  MHATTN_DEVICE int tiles() const { return n_mblocks * pairs; }
  MHATTN_DEVICE BoolMask mask_of(int b, int h) const { return BoolMask{mask + b * m_sb + h * m_sh, m_sq, m_sk}; }
  const float* fmask;  // FLOAT_MASK: the float32 attn_mask and its strides
  i64 fm_sb, fm_sh, fm_sq, fm_sk;
  MHATTN_DEVICE FloatMask fmask_of(int b, int h) const { return FloatMask{fmask + b * fm_sb + h * fm_sh, fm_sq, fm_sk}; }
};

struct Tile {
  int m0, h, hk, b;
  KeyBlocks blocks;
};

// Tile `index`: the tiles run in groups of `sched_pairs` (batch, head) pairs, group by group; within a group the
// query tile is the slower index and runs backwards. Under a causal mask the last query tiles see the most keys, so
// every group starts with its heaviest tiles, and a group is small enough that its pairs' K and V stay in L2 while
// its tiles run side by side (ops.sched_pairs sizes it).
MHATTN_DEVICE Tile tile_at(int index, const Problem& pb) {
  const int group_tiles = pb.n_mblocks * pb.sched_pairs;
  const int group = index / group_tiles;
  const int first_pair = group * pb.sched_pairs;
  const int pairs = min_of(pb.sched_pairs, pb.pairs - first_pair);  // the last group may hold fewer
  const int within = index - group * group_tiles;
  const int bh = first_pair + within % pairs;
  Tile tile;
  tile.m0 = (pb.n_mblocks - 1 - within / pairs) * BLOCK_M;
  tile.h = bh % pb.heads_q;
  tile.b = bh / pb.heads_q;
  tile.hk = tile.h / pb.group;
  tile.blocks = key_blocks(tile.m0, min_of(BLOCK_M, pb.seqlen_q - tile.m0), pb.seqlen_k, pb.bounds);
  return tile;
}

// ---- the producer ----------------------------------------------------------------------------------------

// Loads one tile: Q into buffer q_round % Q_BUFS once the consumers have released it (q_round: tiles with keys
// loaded so far), then K and V of each key block into the ring (ring: key blocks loaded so far, over all tiles).
MHATTN_DEVICE void produce_tile(const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map, QBuffers qb,
                                u32 s_k, u32 s_v, Slots slots, const Tile& tile, int q_round, int& ring) {
  const KeyBlocks blocks = tile.blocks;
  const int buf = q_round % Q_BUFS;
  mbar_wait(qb.empty(buf), ((q_round / Q_BUFS) & 1) ^ 1);  // the first round passes: the buffers start empty
  mbar_arrive_expect_tx(qb.full(buf), Q_BYTES);
#pragma unroll
  for (int c = 0; c < D_CHUNKS; ++c)
    tma_load_4d(qb.slot(buf) + c * Q_CHUNK_BYTES, q_map, qb.full(buf), c * 64, tile.m0, tile.h, tile.b);
  for (int i = 0; i < blocks.count; ++i, ++ring) {
    const int s = ring % STAGES;
    const u32 parity = ((ring / STAGES) & 1) ^ 1;  // the first round passes: the slots start empty
    const int n0 = (blocks.first + i) * BLOCK_N;
    const int hk = tile.hk, b = tile.b;
    mbar_wait(slots.k_empty(s), parity);
    mbar_arrive_expect_tx(slots.k_full(s), KV_BYTES);
#pragma unroll
    for (int c = 0; c < D_CHUNKS; ++c)
      tma_load_4d(s_k + s * KV_BYTES + c * KV_CHUNK_BYTES, k_map, slots.k_full(s), c * 64, n0, hk, b);
    mbar_wait(slots.v_empty(s), parity);
    mbar_arrive_expect_tx(slots.v_full(s), KV_BYTES);
#pragma unroll
    for (int c = 0; c < D_CHUNKS; ++c)
      tma_load_4d(s_v + s * KV_BYTES + c * KV_CHUNK_BYTES, v_map, slots.v_full(s), c * 64, n0, hk, b);
  }
}

// ---- the consumers' steps --------------------------------------------------------------------------------

// The ping-pong schedule's turns (no-ops without PINGPONG): consumer c issues its products between take() on
// named barrier 1 + c and pass() on the other's. In every tile consumer 0 goes first and both take the same number
// of turns. Without TURNS_ACROSS_TILES consumer 1's start() arrives on barrier 1 and it leaves out the pass after its
// last turn, so no arrival is left over from one tile to the next; with it consumer 1 arrives once before its first
// tile (prime()) and passes after every turn, so consumer 0 can begin the next tile while consumer 1 still writes
// this tile's output (one arrival is left over when the CTA ends).
struct Turns {
  int mine, other;
  MHATTN_DEVICE void prime() const {
    if (PINGPONG && TURNS_ACROSS_TILES && mine == 2) named_barrier_arrive(1, 256);
  }
  MHATTN_DEVICE void start() const {
    if (PINGPONG && !TURNS_ACROSS_TILES && mine == 2) named_barrier_arrive(1, 256);
  }
  MHATTN_DEVICE void take() const {
    if (PINGPONG) named_barrier_sync(mine, 256);
  }
  MHATTN_DEVICE void pass(bool last = false) const {
    if (PINGPONG && !(last && mine == 2 && !TURNS_ACROSS_TILES)) named_barrier_arrive(other, 256);
  }
};

// Issues S = Q K^T for this warpgroup's 64 rows (s_q_rows: its first row in Q's first column chunk) and one K slot.
MHATTN_DEVICE void issue_scores(float (&s)[S_REGS], u32 s_q_rows, u32 s_k_slot) {
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
    const u32 chunk = kk / 4, within = (kk % 4) * 32;  // k16 step kk: 32 bytes into a 128-byte row
    const u64 a = smem_desc(s_q_rows, chunk * Q_CHUNK_BYTES + within, 16, SWIZZLE_ATOM);
    const u64 bk = smem_desc(s_k_slot, chunk * KV_CHUNK_BYTES + within, 16, SWIZZLE_ATOM);
    wgmma_ss(s, a, bk, kk > 0);
  }
}

// Issues O += P V for one V slot (k16 step kk: keys 16kk.. of the slot, all HEAD_DIM columns).
MHATTN_DEVICE void issue_pv(float (&o)[O_REGS], const u32 (&p)[P_STEPS][4], u32 s_v_slot) {
#pragma unroll
  for (int kk = 0; kk < P_STEPS; ++kk)
    wgmma_rs(o, p[kk], smem_desc(s_v_slot, kk * 16 * ROW_BYTES, KV_CHUNK_BYTES, SWIZZLE_ATOM), 1);
}

// Hides the scores this thread holds that its rows may not see: keys past seqlen_k or outside the band. The
// thread's rows are row0 and row0 + 8; score s[4i + 2r + e] is row row0 + 8r, key n0 + 8i + 2t + e. Each row's
// visible keys are one range, turned into 32-bit bounds relative to the block before the per-score tests.
MHATTN_DEVICE void mask_scores(float (&s)[S_REGS], int row0, int n0, int t, int seqlen_k, const Bounds& bounds) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 diag = (i64)(row0 + 8 * r) + bounds.diag_offset - n0 - 2 * t;  // the diagonal, as a column of 8i + e
    hide_outside(s, r, clamp_column<BLOCK_N>(diag - bounds.left),
                 clamp_column<BLOCK_N>(min_of<i64>(diag + bounds.right, (i64)seqlen_k - n0 - 2 * t - 1)));
  }
}

// Online softmax of one block of scores (in place: raw dot products in, unnormalised probabilities out) for
// the thread's two rows; m (log2 units, scaled) and l (this thread's partial row sums) move on, alpha gets the
// factor the output accumulators must be scaled by (1 where m stays: with LAZY_RESCALE, unless the block's top passes
// m by more than RESCALE_LOG2).
MHATTN_DEVICE void online_softmax(float (&s)[S_REGS], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                  float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float top = -MHATTN_INF;
#pragma unroll
    for (int i = 0; i < BLOCK_N / 8; ++i) top = fmaxf(top, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
    top = fmaxf(top, shfl_xor(top, 1));  // the four threads of a quad hold one row
    top = fmaxf(top, shfl_xor(top, 2));
    const float top_log2 = top * scale_log2;
    const float m_new = LAZY_RESCALE ? (top_log2 > m[r] + RESCALE_LOG2 ? top_log2 : m[r]) : fmaxf(m[r], top_log2);
    const float base = m_new == -MHATTN_INF ? 0.f : m_new;  // a row with nothing visible yet stays at zero
    alpha[r] = LAZY_RESCALE && m_new == m[r] ? 1.f : fast_exp2(m[r] - base);
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < BLOCK_N / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * i + 2 * r + e];
        x = fast_exp2(fmaf(x, scale_log2, -base));
        sum += x;
      }
    }
    l[r] = l[r] * alpha[r] + sum;
  }
}

// O of the thread's two rows times their alpha; with LAZY_RESCALE only in a warp where some row's maximum moved.
MHATTN_DEVICE void rescale_output(float (&o)[O_REGS], const float (&alpha)[2]) {
  if (LAZY_RESCALE && !__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
  for (int i = 0; i < HEAD_DIM / 8; ++i) {
    o[4 * i] *= alpha[0];
    o[4 * i + 1] *= alpha[0];
    o[4 * i + 2] *= alpha[1];
    o[4 * i + 3] *= alpha[1];
  }
}

// O / l and lse for the thread's two rows (those below seqlen_q).
// A row's sum of probabilities from its four threads' partial sums l (every lane of the quad must call it).
MHATTN_DEVICE float row_sum(float l) {
  const float sum = l + shfl_xor(l, 1);
  return sum + shfl_xor(sum, 2);
}
// The row's natural-log lse from its running maximum m (log2 units, scaled) and its sum; -inf where it saw no key.
MHATTN_DEVICE float row_lse(float m, float sum) { return sum > 0.f ? (m + fast_log2(sum)) * LN2 : -MHATTN_INF; }

MHATTN_DEVICE void store_rows(const float (&o)[O_REGS], const float (&m)[2], const float (&l)[2], elem_t* o_bh,
                              float* lse_bh, i64 o_sn, int row0, int t, int seqlen_q) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = row_sum(l[r]);
    const int row = row0 + 8 * r;
    if (row >= seqlen_q) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    elem_t* dst = o_bh + row * o_sn + 2 * t;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i)
      *reinterpret_cast<u32*>(dst + 8 * i) = pack2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    if (t == 0) lse_bh[row] = row_lse(m[r], sum);
  }
}

// STAGED_OUT: O / l of the thread's two rows into its rows of the tile's Q buffer `q_buf` (Q's 128-byte swizzled
// layout: 16-byte unit u of a chunk's row r at unit u ^ (r % 8)) for the copy engine; lse for the rows below seqlen_q.
// row_in_tile: the thread's first row within the tile; row0: the same row in the head.
MHATTN_DEVICE void stage_rows(const float (&o)[O_REGS], const float (&m)[2], const float (&l)[2], u32 q_buf,
                              float* lse_bh, int row_in_tile, int row0, int t, int seqlen_q) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = row_sum(l[r]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int row = row_in_tile + 8 * r;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i) {  // columns 8i + 2t, + 1: chunk i / 8, 16-byte unit i % 8
      const u32 addr = q_buf + (i / 8) * Q_CHUNK_BYTES + row * ROW_BYTES + (((i % 8) ^ (row & 7)) << 4) + 4 * t;
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(pack2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv))
                   : "memory");
    }
    if (t == 0 && row0 + 8 * r < seqlen_q) lse_bh[row0 + 8 * r] = row_lse(m[r], sum);
  }
}

// ---- a consumer's tile ------------------------------------------------------------------------------------

// What a consumer thread keeps from tile to tile.
struct Consumer {
  int lane, t, row_in_tile;  // row_in_tile: this thread's first row within the tile (the other is 8 below)
  int wg_row_in_tile;        // this warpgroup's first row within the tile
  int index;                 // this consumer warpgroup (0 ..)
  bool stores;               // STAGED_OUT: the thread that hands this warpgroup's output to the copy engine
  u32 s_k, s_v;
  QBuffers qb;
  Slots slots;
  Turns turns;
  float scale_log2;
  Softcap softcap;
  float mask_unit;  // FLOAT_MASK: log2(e) over the factor the softmax multiplies the scores by
  MHATTN_DEVICE u32 q_rows(int buf) const { return qb.slot(buf) + wg_row_in_tile * ROW_BYTES; }
};

// STAGED_OUT: hands Q buffer `buf` back to the producer once the copy engine has read the output staged in it.
MHATTN_DEVICE void release_staged_buffer(const Consumer& c, int buf) {
  if (c.stores) bulk_wait_read();
  release_slot(c.qb.empty(buf), c.lane);
}

// STAGED_OUT: this warpgroup's output rows, staged in Q buffer `buf`, stored by the copy engine (one box of 64 rows
// per 64-column chunk) once every thread of the warpgroup has written its rows.
MHATTN_DEVICE void store_staged_rows(const Consumer& c, const TensorMap* o_map, int buf, const Tile& tile) {
  fence_async_shared();
  named_barrier_sync(STAGE_BARRIER + c.index, 128);
  if (c.stores) {
#pragma unroll
    for (int chunk = 0; chunk < D_CHUNKS; ++chunk)
      tma_store_4d(o_map, c.q_rows(buf) + chunk * Q_CHUNK_BYTES, chunk * 64, tile.m0 + c.wg_row_in_tile, tile.h,
                   tile.b);
    bulk_commit();
  }
}

// One tile of this consumer's 64 rows: O and lse written. q_round: tiles with keys consumed so far; ring: key
// blocks consumed so far (the producer's counts).
MHATTN_DEVICE void consume_tile(const Consumer& c, const Tile& tile, const Problem& pb, int q_round, int& ring,
                                const TensorMap* o_map, elem_t* o, float* lse, i64 o_sb, i64 o_sh, i64 o_sn) {
  float o_acc[O_REGS];
#pragma unroll
  for (int i = 0; i < O_REGS; ++i) o_acc[i] = 0.f;
  float m[2] = {-MHATTN_INF, -MHATTN_INF}, l[2] = {0.f, 0.f}, alpha[2];
  float s_acc[S_REGS];
  u32 p[P_STEPS][4];
  const int row0 = tile.m0 + c.row_in_tile, wg_row0 = tile.m0 + c.wg_row_in_tile;
  const KeyBlocks blocks = tile.blocks;
  const BoolMask bool_mask = BOOL_MASK ? pb.mask_of(tile.b, tile.h) : BoolMask{nullptr, 0, 0};
  const FloatMask float_mask = FLOAT_MASK ? pb.fmask_of(tile.b, tile.h) : FloatMask{nullptr, 0, 0};
  const int buf = q_round % Q_BUFS;
  const u32 s_q_rows = c.q_rows(buf);
  // Whether key block n0 needs per-element masking for this warpgroup's rows: outside the blocks they see whole.
  int whole_lo, whole_hi;
  pb.bounds.whole_blocks<BLOCK_N>(wg_row0, wg_row0 + 63, pb.seqlen_k, whole_lo, whole_hi);
  auto cuts = [&](int n0) { return n0 < whole_lo * BLOCK_N || n0 >= whole_hi * BLOCK_N; };
  // Key block n0's scores, as the tensor cores left them, made ready for the softmax: capped, masked by the band (where
  // the block cuts it) and by the attn_mask.
  auto finish_scores = [&](int n0) {
    cap_scores(s_acc, c.softcap);
    if (cuts(n0)) mask_scores(s_acc, row0, n0, c.t, pb.seqlen_k, pb.bounds);
    if (BOOL_MASK) hide_forbidden<S_REGS, true>(s_acc, bool_mask, row0, n0 + 2 * c.t, pb.seqlen_q, pb.seqlen_k);
    if (FLOAT_MASK)
      add_float_mask<S_REGS, true>(s_acc, float_mask, row0, n0 + 2 * c.t, pb.seqlen_q, pb.seqlen_k, c.mask_unit);
  };

  if (blocks.count > 0) {
    c.turns.start();
    mbar_wait(c.qb.full(buf), (q_round / Q_BUFS) & 1);
    // The first block: scores, softmax, nothing to multiply yet.
    int s = ring % STAGES;
    mbar_wait(c.slots.k_full(s), (ring / STAGES) & 1);
    c.turns.take();
    wgmma_fence();
    issue_scores(s_acc, s_q_rows, c.s_k + s * KV_BYTES);
    wgmma_commit();
    c.turns.pass();
    wgmma_wait<0>();
    touch_registers(s_acc);
    release_slot(c.slots.k_empty(s), c.lane);
    if (STAGED_OUT && q_round > 0) release_staged_buffer(c, (q_round - 1) % Q_BUFS);  // the previous tile's
    if (!STAGED_OUT && blocks.count == 1) release_slot(c.qb.empty(buf), c.lane);  // the tile's last use of Q
    int n0 = blocks.first * BLOCK_N;
    finish_scores(n0);
    online_softmax(s_acc, m, l, alpha, softmax_scale_log2(c.scale_log2));
    pack_a_fragments(p, s_acc);  // P, the A operand of P V

    for (int i = 1; i < blocks.count; ++i) {
      const int prev = s;
      const u32 prev_parity = (ring / STAGES) & 1;
      ++ring;
      s = ring % STAGES;
      // S of this block and P V of the previous one in flight together; the softmax waits only for S.
      mbar_wait(c.slots.k_full(s), (ring / STAGES) & 1);
      mbar_wait(c.slots.v_full(prev), prev_parity);
      c.turns.take();
      wgmma_fence();
      issue_scores(s_acc, s_q_rows, c.s_k + s * KV_BYTES);
      wgmma_commit();
      issue_pv(o_acc, p, c.s_v + prev * KV_BYTES);
      wgmma_commit();
      c.turns.pass();
      wgmma_wait<1>();
      touch_registers(s_acc);
      release_slot(c.slots.k_empty(s), c.lane);
      if (!STAGED_OUT && i == blocks.count - 1) release_slot(c.qb.empty(buf), c.lane);
      n0 = (blocks.first + i) * BLOCK_N;
      finish_scores(n0);
      online_softmax(s_acc, m, l, alpha, softmax_scale_log2(c.scale_log2));
      wgmma_wait<0>();
      touch_registers(o_acc);
      release_slot(c.slots.v_empty(prev), c.lane);
      rescale_output(o_acc, alpha);
      pack_a_fragments(p, s_acc);  // P, the A operand of P V
    }
    // P V of the last block.
    mbar_wait(c.slots.v_full(s), (ring / STAGES) & 1);
    c.turns.take();
    wgmma_fence();
    issue_pv(o_acc, p, c.s_v + s * KV_BYTES);
    wgmma_commit();
    c.turns.pass(true);
    wgmma_wait<0>();
    touch_registers(o_acc);
    release_slot(c.slots.v_empty(s), c.lane);
    ++ring;
  }
  const i64 bh = (i64)tile.b * pb.heads_q + tile.h;
  if (STAGED_OUT && blocks.count > 0) {
    stage_rows(o_acc, m, l, c.qb.slot(buf), lse + bh * pb.seqlen_q, c.row_in_tile, row0, c.t, pb.seqlen_q);
    store_staged_rows(c, o_map, buf, tile);
    return;
  }
  store_rows(o_acc, m, l, o + tile.b * o_sb + tile.h * o_sh, lse + bh * pb.seqlen_q, o_sn, row0, c.t, pb.seqlen_q);
}

// ---- tile handoff ----------------------------------------------------------------------------------------

// Two slots through which the producer hands tile indices to the consumers (-1: no more tiles); the n-th handoff
// takes slot n & 1.
struct TileSlots : BarrierPairs<2> {
  u32 indices;  // two ints
  MHATTN_DEVICE u32 index(int slot) const { return indices + 4u * slot; }
};

// The producer thread's handoff of its n-th tile index.
MHATTN_DEVICE void hand_tile(const TileSlots& slots, int n, int index) {
  const int slot = n & 1;
  mbar_wait(slots.empty(slot), ((n >> 1) & 1) ^ 1);  // the first round passes: the slots start empty
  asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(slots.index(slot)), "r"(index) : "memory");
  mbar_arrive(slots.full(slot));  // release: the consumers' wait sees the index
}

// A consumer warp's n-th tile index.
MHATTN_DEVICE int take_tile(const TileSlots& slots, int n, int lane) {
  const int slot = n & 1;
  mbar_wait(slots.full(slot), (n >> 1) & 1);
  int index;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(index) : "r"(slots.index(slot)) : "memory");
  __syncwarp();
  if (lane == 0) mbar_arrive(slots.empty(slot));
  return index;
}

// ---- the kernel ------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
    mhattn_hopper_fwd(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                      const __grid_constant__ TensorMap v_map,
#if STAGED_OUT
                      const __grid_constant__ TensorMap o_map,  // O in boxes of 64 rows
#endif
                      elem_t* __restrict__ o, float* __restrict__ lse,
                      int* __restrict__ tile_counter, i64 o_sb, i64 o_sh, i64 o_sn, int seqlen_q, int seqlen_k,
                      int heads_q, int group, int pairs, int sched_pairs, float scale_log2, int diag_offset,
                      int window_left, int window_right, const unsigned char* __restrict__ mask, i64 m_sb, i64 m_sh,
                      i64 m_sq, i64 m_sk, float softcap_in2, float softcap_out2,
                      const float* __restrict__ float_mask, i64 fm_sb, i64 fm_sh, i64 fm_sq, i64 fm_sk) {
  MHATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x;
  const Problem pb{seqlen_q, seqlen_k, heads_q, group, (seqlen_q + BLOCK_M - 1) / BLOCK_M, pairs, sched_pairs,
                   Bounds{diag_offset, window_left, window_right}, mask, m_sb, m_sh, m_sq, m_sk,
                   float_mask, fm_sb, fm_sh, fm_sq, fm_sk};
  const int tiles = pb.tiles();

  const u32 base = (smem_u32(smem) + SWIZZLE_ATOM - 1) & ~(SWIZZLE_ATOM - 1);
  const u32 s_k = base + K_OFFSET, s_v = base + V_OFFSET;
  const QBuffers qb{{base + BAR_OFFSET}, base};
  const TileSlots tile_slots{{qb.bars + 16 * Q_BUFS}, base + TILE_OFFSET};
  const Slots slots{{qb.bars + 16 * Q_BUFS + 32}};
#if STAGED_OUT
  const TensorMap* out_map = &o_map;
#else
  const TensorMap* out_map = nullptr;
#endif
  if (tid == 0) {
    for (int b = 0; b < Q_BUFS; ++b) {
      mbar_init(qb.full(b), 1);
      mbar_init(qb.empty(b), CONSUMER_WARPS);
    }
    for (int n = 0; n < 2; ++n) {
      mbar_init(tile_slots.full(n), 1);
      mbar_init(tile_slots.empty(n), CONSUMER_WARPS);
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(slots.k_full(s), 1);
      mbar_init(slots.v_full(s), 1);
      mbar_init(slots.k_empty(s), CONSUMER_WARPS);
      mbar_init(slots.v_empty(s), CONSUMER_WARPS);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = tid / 128;
  if (wg == 0) {
    release_registers<PRODUCER_REGS>();
    if (tid == 0) {
      int q_round = 0, ring = 0, n = 0;
      for (int index = blockIdx.x;; ++n) {
        hand_tile(tile_slots, n, index < tiles ? index : -1);
        if (index >= tiles) break;
        const Tile tile = tile_at(index, pb);
        if (tile.blocks.count > 0)
          produce_tile(&q_map, &k_map, &v_map, qb, s_k, s_v, slots, tile, q_round++, ring);
        index = tile_counter != nullptr ? atomicAdd(tile_counter, 1) + (int)gridDim.x : index + (int)gridDim.x;
      }
    }
    return;
  }
  claim_registers<CONSUMER_REGS>();

  const int lane = tid & 31, warp = (tid & 127) >> 5;
  const int wg_uniform = UNIFORM_WARPGROUP ? __shfl_sync(0xffffffffu, wg, 0) : wg;  // the same value, see above
  const Consumer consumer{lane, lane & 3, (wg - 1) * 64 + warp * 16 + (lane >> 2), (wg_uniform - 1) * 64,
                          wg_uniform - 1,
                          STAGED_OUT && (tid & 127) == 0, s_k, s_v, qb, slots, Turns{wg, 3 - wg}, scale_log2,
                          Softcap{softcap_in2, softcap_out2}, LOG2E / softmax_scale_log2(scale_log2)};
  int q_round = 0, ring = 0;
  consumer.turns.prime();
  for (int n = 0;; ++n) {
    const int index = take_tile(tile_slots, n, lane);
    if (index < 0) break;
    const Tile tile = tile_at(index, pb);
    consume_tile(consumer, tile, pb, q_round, ring, out_map, o, lse, o_sb, o_sh, o_sn);
    q_round += tile.blocks.count > 0;
  }
  if (consumer.stores && q_round > 0) bulk_wait_all();  // the last tile's output stored before the CTA ends
}
