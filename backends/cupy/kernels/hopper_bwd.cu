// FlashAttention backward for Hopper (sm_90a): dK and dV per block of BLOCK_N = 128 keys, dQ added to a float32
// accumulator with atomics; TMA loads, wgmma, a producer warpgroup and two consumer warpgroups.
//
// A CTA owns 128 keys of one (batch, kv head): K and V are loaded once; then, for every query head of the group
// and every block of BLOCK_M = QUERY_ROWS queries (64; or 128 at d = 64) that can see the keys, the producer loads
// Q, dO, and the rows' lse (log2 units) and delta (kernels/bwd_preprocess.cu) into a ring of STAGES slots. Consumer
// warpgroup w owns keys 64w..64w+63 of the block. Per query block:
//   S^T = K Q^T, dP^T = V dO^T                       (wgmma, all operands in shared memory)
//   P^T = 2^(S^T scale_log2 - lse), dS^T = P^T (dP^T - delta) scale     (in registers)
//   dV += P^T dO, dK += dS^T Q                        (wgmma, P^T and dS^T from registers)
//   dQ += dS K                                        (wgmma, dS^T through shared memory: at d = 128 warpgroup w
//                                                      forms dQ columns 64w..64w+63 over all 128 keys; at d = 64
//                                                      with 64 queries every column over its own 64 keys, with 128
//                                                      queries query rows 64w..64w+63 over all 128 keys)
// The consumers leave dQ in shared memory; warps 1-3 of the producer warpgroup add it to dq_accum while the
// consumers go on with the next query block: with 16-byte float32 atomics (DQ_BULK 0; at d = 64 with 64 queries the
// two warpgroups' tiles summed first), or each tile row handed to the copy engine as one bulk reduce-add (DQ_BULK
// 1). With DQ_BUFFERS 2 the consumers and the writers take two dQ buffers in turn, so a block's dQ can be stored
// while the writers still add the one before.
// Keys past seqlen_k read as zeros (K and V), so they add nothing to dQ and their dK / dV rows are not stored;
// query rows past seqlen_q have lse = +inf (P = 0). The causal / window band masks P per element only in the
// blocks that cut it.
//
// BOOL_MASK: a boolean attn_mask (True = attend; mask and its four strides) hides scores after the band does.
// FLOAT_MASK: an additive float32 attn_mask (float_mask and its strides) is added to them after that; not with
// SOFTCAP, whose factor is found from P (the mask's term would be in it). Its gradient is not formed here.
// SOFTCAP: the scores are softcap * tanh(s scale / softcap) (as in the forward) and dS^T takes the factor 1 - tanh^2,
// with tanh found again from P and the lse (P = 0 gives dS = 0 whatever the factor).
//
// DETERMINISTIC 1 (the backward on request of reproducible gradients): the CTAs whose keys a query block sees add
// their dQ tiles to it one after another, from the highest key block down, so every dq_accum element sums its terms
// in one order and dQ is the same bit for bit from run to run. A counter per (batch, query head, query block) in
// dq_turns (zeros at launch) says how many have added. blockIdx.x runs over the key blocks from the last one, and the
// GPU starts CTAs in blockIdx order, so a CTA only waits for CTAs started before it: no deadlock however large the
// grid.
//
// DQ_DIRECT 1 (every key in one CTA: seqlen_k <= BLOCK_N, one key block): no other CTA adds to a query row's dQ, so
// the writers store each dQ tile as the gradient itself (dq_accum then points at dQ, (B, Hq, Nq, D) contiguous, in the
// input dtype) and write zeros to the rows of the query blocks that see none of the keys: no float32 buffer to zero
// before the launch and convert after it, and the same result bit for bit at every run.
//
// -D options: MHATTN_BF16, HEAD_DIM (64 or 128), QUERY_ROWS (64, or 128 at d = 64), STAGES, DQ_BULK (0 or 1),
// DQ_BUFFERS (1 or 2), DETERMINISTIC (0 or 1), DQ_DIRECT (0 or 1), BOOL_MASK (0 or 1), FLOAT_MASK (0 or 1), SOFTCAP
// (0 or 1), SMEM_BYTES (checked against the layout below).
#define NUM_WARPS 12
#include "common.cuh"
#include "hopper.cuh"

#ifndef DQ_DIRECT
#define DQ_DIRECT 0
#endif

constexpr int BLOCK_N = 128;                   // keys per CTA (64 per consumer warpgroup)
constexpr int BLOCK_M = QUERY_ROWS;            // queries per step
constexpr int D_CHUNKS = HEAD_DIM / 64;
constexpr int ACC_REGS = HEAD_DIM / 2;         // dK or dV accumulators per thread (64 keys x HEAD_DIM)
constexpr int SQ_REGS = BLOCK_M / 2;           // S^T or dP^T per thread (64 keys x BLOCK_M queries)
constexpr int DQ_REGS = 32;                    // a warpgroup's dQ product per thread (64 x 64)
constexpr int Q_STEPS = BLOCK_M / 16;          // k16 steps of dV / dK (over the queries)
constexpr u32 ROW_BYTES = 128;
constexpr u32 SWIZZLE_ATOM = 1024;
constexpr u32 KV_CHUNK_BYTES = BLOCK_N * ROW_BYTES;
constexpr u32 KV_BYTES = KV_CHUNK_BYTES * D_CHUNKS;
constexpr u32 Q_CHUNK_BYTES = BLOCK_M * ROW_BYTES;
constexpr u32 Q_BYTES = Q_CHUNK_BYTES * D_CHUNKS;
constexpr u32 VEC_BYTES = BLOCK_M * 4;         // lse or delta of a query block
constexpr u32 DS_CHUNK_BYTES = BLOCK_N * ROW_BYTES;     // dS^T of 64 queries: 128 keys, one swizzled chunk
constexpr u32 DS_BYTES = DS_CHUNK_BYTES * (BLOCK_M / 64);  // dS^T: 128 keys x BLOCK_M queries
// Shared memory from a 1024-byte aligned base.
constexpr u32 K_OFFSET = 0;
constexpr u32 V_OFFSET = K_OFFSET + KV_BYTES;
constexpr u32 Q_OFFSET = V_OFFSET + KV_BYTES;                // STAGES slots of Q
constexpr u32 DO_OFFSET = Q_OFFSET + STAGES * Q_BYTES;       // STAGES slots of dO
constexpr u32 DS_OFFSET = DO_OFFSET + STAGES * Q_BYTES;      // two dS^T buffers
constexpr u32 LSE_OFFSET = DS_OFFSET + 2 * DS_BYTES;         // STAGES slots of lse
constexpr u32 DELTA_OFFSET = LSE_OFFSET + STAGES * VEC_BYTES;
// dQ of a query block: at d = 128 the warpgroups split its 64-column chunks (over all keys, after a barrier between
// them); at d = 64 with 64 queries each forms all of it over its own keys, into a tile of its own; with 128 queries
// they split its rows (over all keys, after the barrier).
constexpr bool DQ_BY_QUERIES = BLOCK_M == 128;
constexpr bool DQ_BY_KEYS = D_CHUNKS == 1 && !DQ_BY_QUERIES;
constexpr int DQ_TILES = DQ_BY_KEYS ? 2 : 1;
constexpr int DQ_ROW_FLOATS = HEAD_DIM + 8;                  // padded: the consumers' float2 stores hit distinct banks
constexpr u32 DQ_TILE_BYTES = BLOCK_M * DQ_ROW_FLOATS * 4;
constexpr u32 DQ_OFFSET = DELTA_OFFSET + STAGES * VEC_BYTES;  // float32
constexpr u32 DQ_BUFFER_BYTES = DQ_TILES * DQ_TILE_BYTES;
constexpr u32 BAR_OFFSET = DQ_OFFSET + DQ_BUFFERS * DQ_BUFFER_BYTES;
constexpr u32 BAR_COUNT = 1 + 2 * DQ_BUFFERS + 2 * STAGES;  // kv_full; dq_full, dq_empty per buffer; q_full, q_empty
                                                            // per slot
constexpr u32 DQ_WRITER_WARPS = 3;                           // warps 1-3 of the producer warpgroup
constexpr u32 LAYOUT_BYTES = BAR_OFFSET + 8 * BAR_COUNT + SWIZZLE_ATOM;
constexpr u32 CONSUMER_WARPS = 8;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;
constexpr int DQ_BARRIER = 1;                  // named barriers (+ w at d = 64): the dS^T dQ reads is in shared memory
constexpr int WRITER_BARRIER = 3;              // the dQ writers' named barrier (DETERMINISTIC)
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "the Hopper backward takes head dims 64 and 128");
static_assert(QUERY_ROWS == 64 || (QUERY_ROWS == 128 && HEAD_DIM == 64), "QUERY_ROWS is 64, or 128 at d = 64");
static_assert(DQ_BULK == 0 || DQ_BULK == 1, "DQ_BULK is 0 (atomics) or 1 (bulk reduce-add)");
static_assert(DQ_BUFFERS == 1 || DQ_BUFFERS == 2, "DQ_BUFFERS is 1 or 2");
static_assert(DETERMINISTIC == 0 || DETERMINISTIC == 1, "DETERMINISTIC is 0 or 1");
static_assert(DQ_DIRECT == 0 || (DQ_DIRECT == 1 && !DQ_BULK && !DETERMINISTIC),
              "DQ_DIRECT is 0, or 1 with the writers' own stores (no bulk reduce-add, no turns: one key block)");
static_assert(!(FLOAT_MASK && SOFTCAP), "the softcap's factor is found from P, which a float mask's term changes");
// (the bulk path at d = 64 hands the engine both warpgroups' tiles, which it adds in either order)
static_assert(!(DETERMINISTIC && DQ_BULK && DQ_TILES == 2), "a deterministic dQ at d = 64 takes the atomics");
static_assert(LAYOUT_BYTES <= SMEM_BYTES, "the host gives less shared memory than the layout needs");
static_assert(budgets_fit_launch(NUM_THREADS, PRODUCER_REGS, 256, CONSUMER_REGS),
              "register budgets exceed what the CTA gets at launch");

using Ring = BarrierPairs<STAGES>;  // q_full, q_empty per ring slot

// The dQ buffers' barriers (after kv_full): full = the consumers stored the buffer's dQ; empty = the writers are done
// with it. Step `step` takes buffer step % DQ_BUFFERS, in its (step / DQ_BUFFERS)-th round.
struct DqBuffers : BarrierPairs<DQ_BUFFERS> {
  MHATTN_DEVICE static int of(int step) { return step % DQ_BUFFERS; }
  MHATTN_DEVICE static u32 round(int step) { return (u32)(step / DQ_BUFFERS) & 1u; }
  MHATTN_DEVICE static float* tile(float* s_dq, int step) { return s_dq + of(step) * (DQ_BUFFER_BYTES / 4); }
};

// The query blocks that can see keys [n0, n0 + BLOCK_N): [first, first + count).
struct QueryBlocks {
  int first, count;
};
MHATTN_DEVICE QueryBlocks query_blocks(int n0, int seqlen_q, const Bounds& bounds) {
  const i64 lowest = (i64)n0 - bounds.diag_offset - bounds.right;                  // first query of the first key
  const i64 highest = (i64)(n0 + BLOCK_N - 1) - bounds.diag_offset + bounds.left;  // last query of the last key
  const i64 n_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const i64 first = lowest <= 0 ? 0 : min_of<i64>(lowest / BLOCK_M, n_blocks);
  const i64 end = highest < 0 ? 0 : min_of<i64>(highest / BLOCK_M + 1, n_blocks);
  return {(int)first, (int)max_of<i64>(end - first, 0)};
}

// The key blocks after block n (of n_blocks) that see query block m, which block n sees: with DETERMINISTIC, how many
// add their dQ to m before n does. The key blocks that see m are consecutive (the first query block a key block sees
// grows with it, and so does its last), so the last of them is found by bisection.
MHATTN_DEVICE int later_key_blocks(int m, int n, int n_blocks, int seqlen_q, const Bounds& bounds) {
  int lo = n, hi = n_blocks - 1;  // the last key block that sees m is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_blocks(mid * BLOCK_N, seqlen_q, bounds).first <= m)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo - n;
}

// ---- the producer ----------------------------------------------------------------------------------------

MHATTN_DEVICE void produce(const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map,
                           const TensorMap* do_map, const float* lse_log2, const float* delta, u32 base, u32 kv_full,
                           Ring ring, QueryBlocks blocks, int n0, int hk, int b, int group, int heads_q,
                           int seqlen_q_pad) {
  mbar_arrive_expect_tx(kv_full, 2 * KV_BYTES);
#pragma unroll
  for (int c = 0; c < D_CHUNKS; ++c) {
    tma_load_4d(base + K_OFFSET + c * KV_CHUNK_BYTES, k_map, kv_full, c * 64, n0, hk, b);
    tma_load_4d(base + V_OFFSET + c * KV_CHUNK_BYTES, v_map, kv_full, c * 64, n0, hk, b);
  }
  int step = 0;
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const i64 rows = ((i64)b * heads_q + h) * seqlen_q_pad;
    for (int i = 0; i < blocks.count; ++i, ++step) {
      const int s = step % STAGES;
      const int m0 = (blocks.first + i) * BLOCK_M;
      mbar_wait(ring.empty(s), ((step / STAGES) & 1) ^ 1);
      mbar_arrive_expect_tx(ring.full(s), 2 * Q_BYTES + 2 * VEC_BYTES);
#pragma unroll
      for (int c = 0; c < D_CHUNKS; ++c) {
        tma_load_4d(base + Q_OFFSET + s * Q_BYTES + c * Q_CHUNK_BYTES, q_map, ring.full(s), c * 64, m0, h, b);
        tma_load_4d(base + DO_OFFSET + s * Q_BYTES + c * Q_CHUNK_BYTES, do_map, ring.full(s), c * 64, m0, h, b);
      }
      bulk_load(base + LSE_OFFSET + s * VEC_BYTES, lse_log2 + rows + m0, VEC_BYTES, ring.full(s));
      bulk_load(base + DELTA_OFFSET + s * VEC_BYTES, delta + rows + m0, VEC_BYTES, ring.full(s));
    }
  }
}

// ---- the consumers' steps --------------------------------------------------------------------------------

// Issues d (64 rows of A x 64 queries) = A B^T over the head dim: A = this warpgroup's 64 rows of K or V, B = the
// slot's Q or dO (both K-major).
MHATTN_DEVICE void issue_keys_by_queries(float (&d)[SQ_REGS], u32 s_rows, u32 s_queries) {
  s_rows = warp_uniform(s_rows), s_queries = warp_uniform(s_queries);
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
    const u32 chunk = kk / 4, within = (kk % 4) * 32;
    wgmma_ss(d, smem_desc(s_rows, chunk * KV_CHUNK_BYTES + within, 16, SWIZZLE_ATOM),
             smem_desc(s_queries, chunk * Q_CHUNK_BYTES + within, 16, SWIZZLE_ATOM), kk > 0);
  }
}

// Issues acc (64 keys x HEAD_DIM) += A B over the queries: A = P^T or dS^T from registers, B = the slot's dO or Q
// (MN-major: rows are queries).
MHATTN_DEVICE void issue_key_gradient(float (&acc)[ACC_REGS], const u32 (&a)[Q_STEPS][4], u32 s_queries) {
  s_queries = warp_uniform(s_queries);
#pragma unroll
  for (int kk = 0; kk < Q_STEPS; ++kk)
    wgmma_rs(acc, a[kk], smem_desc(s_queries, kk * 16 * ROW_BYTES, Q_CHUNK_BYTES, SWIZZLE_ATOM), 1);
}

// Issues warpgroup w's dq (64 queries x 64 columns) = dS K: A = dS^T in shared memory read transposed, B = K
// (MN-major: rows are keys). At d = 128: column chunk w over the block's 128 keys; at d = 64 with 64 queries: over
// keys 64w.. only; with 128 queries: queries 64w.. (dS^T's query chunk w) over the 128 keys.
MHATTN_DEVICE void issue_dq(float (&dq)[DQ_REGS], u32 s_ds, u32 s_k, int w) {
  constexpr int KEYS = DQ_BY_KEYS ? 64 : BLOCK_N;
  const u32 first_row = DQ_BY_KEYS ? 64 * w * ROW_BYTES : 0;
  const u32 ds_chunk = DQ_BY_QUERIES ? w : 0, k_chunk = D_CHUNKS == 1 ? 0 : w;
  const u32 ds_rows = warp_uniform(s_ds + ds_chunk * DS_CHUNK_BYTES + first_row);
  const u32 k_rows = warp_uniform(s_k + k_chunk * KV_CHUNK_BYTES + first_row);
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk)
    wgmma_ss<1, 1>(dq, smem_desc(ds_rows, kk * 16 * ROW_BYTES, DS_CHUNK_BYTES, SWIZZLE_ATOM),
                   smem_desc(k_rows, kk * 16 * ROW_BYTES, KV_CHUNK_BYTES,
                             SWIZZLE_ATOM),
                   kk > 0);
}

// Hides the scores of query/key pairs outside the band, and of keys past seqlen_k (their zero rows of K would give
// P = 2^-lse, unbounded): score s[4i + 2r + e] is key key0 + 8r, query m0 + 8i + 2t + e; key j sees queries
// j - diag_offset - right .. j - diag_offset + left.
MHATTN_DEVICE void mask_scores(float (&s)[SQ_REGS], int key0, int m0, int t, int seqlen_k, const Bounds& bounds) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 diag = (i64)(key0 + 8 * r) - bounds.diag_offset - m0 - 2 * t;  // the diagonal, as a column 8i + e
    const bool key_exists = key0 + 8 * r < seqlen_k;
    hide_outside(s, r, key_exists ? clamp_column<BLOCK_M>(diag - bounds.right) : BLOCK_M,
                 clamp_column<BLOCK_M>(diag + bounds.left));
  }
}

// P^T from S^T (in place), with each query column's lse (log2 units) from the slot.
MHATTN_DEVICE void probabilities(float (&st)[SQ_REGS], const float* lse, int t, float scale_log2) {
#pragma unroll
  for (int i = 0; i < BLOCK_M / 8; ++i) {
    const float2 l2 = *reinterpret_cast<const float2*>(lse + 8 * i + 2 * t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st[4 * i + 2 * r] = fast_exp2(fmaf(st[4 * i + 2 * r], scale_log2, -l2.x));
      st[4 * i + 2 * r + 1] = fast_exp2(fmaf(st[4 * i + 2 * r + 1], scale_log2, -l2.y));
    }
  }
}

// SOFTCAP: d(score) / d(s scale) = 1 - tanh^2 of a probability p of a query column whose lse (log2 units) is
// lse_log2: tanh = (log2 p + lse_log2) / (softcap log2 e). p = 0 (masked or underflowed) gives 1: dS is 0 there anyway.
MHATTN_DEVICE float softcap_factor(float p, float lse_log2, float inv_out2) {
  const float th = p > 0.f ? (fast_log2(p) + lse_log2) * inv_out2 : 0.f;
  return softcap_grad(th);
}

// dS^T = P^T (dP^T - delta) scale from dP^T (in place), with each query column's delta (and under SOFTCAP its lse)
// from the slot.
MHATTN_DEVICE void score_gradients(float (&dpt)[SQ_REGS], const float (&pt)[SQ_REGS], const float* delta,
                                   const float* lse, int t, float scale, const Softcap& softcap) {
  const float inv_out2 = SOFTCAP ? 1.f / softcap.out2 : 0.f;
#pragma unroll
  for (int i = 0; i < BLOCK_M / 8; ++i) {
    const float2 d2 = *reinterpret_cast<const float2*>(delta + 8 * i + 2 * t);
    const float2 l2 = SOFTCAP ? *reinterpret_cast<const float2*>(lse + 8 * i + 2 * t) : make_float2(0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float& x = dpt[4 * i + 2 * r];
      float& y = dpt[4 * i + 2 * r + 1];
      const float p = pt[4 * i + 2 * r], q = pt[4 * i + 2 * r + 1];
      x = p * (x - d2.x) * (SOFTCAP ? scale * softcap_factor(p, l2.x, inv_out2) : scale);
      y = q * (y - d2.y) * (SOFTCAP ? scale * softcap_factor(q, l2.y, inv_out2) : scale);
    }
  }
}

// This warp's dS^T (its 16 keys from warp_row0, packed as A fragments) into the block's dS^T tile, one stmatrix per
// k16 step: rows are keys, 128-byte rows of 64 queries in the swizzled layout (16-byte chunk c of row r at chunk
// c ^ (r % 8)), one such tile per 64 queries. Fragment register j of step kk is the 8 x 8 matrix of keys + 8 (j % 2),
// queries 16 kk + 8 (j / 2)..
MHATTN_DEVICE void store_ds(u32 s_ds, const u32 (&ds)[Q_STEPS][4], int warp_row0, int lane) {
  const int matrix = lane >> 3, row = warp_row0 + 8 * (matrix & 1) + (lane & 7);
#pragma unroll
  for (int kk = 0; kk < Q_STEPS; ++kk) {
    const int chunk = 2 * kk + (matrix >> 1);  // the matrix's 16-byte chunk along the queries
    const u32 tile = s_ds + (chunk / 8) * DS_CHUNK_BYTES;
    stmatrix_x4(tile + row * ROW_BYTES + (((chunk % 8) ^ (row & 7)) << 4), ds[kk][0], ds[kk][1], ds[kk][2],
                ds[kk][3]);
  }
}

// This thread's dQ (rows row_in_block, + 8; columns col0 + 8i + 2t, + 1) into the shared dQ tile.
MHATTN_DEVICE void store_dq(float* s_dq, const float (&dq)[DQ_REGS], int row_in_block, int col0, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float* dst = s_dq + (row_in_block + 8 * r) * DQ_ROW_FLOATS + col0 + 2 * t;
#pragma unroll
    for (int i = 0; i < DQ_REGS / 4; ++i)
      *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
  }
}

// Four floats of the shared dQ tile at (row, col), both warpgroups' tiles summed where there are two (d = 64 with 64
// queries a step).
MHATTN_DEVICE float4 dq_tile_quad(const float* s_dq, int row, int col) {
  float4 v = *reinterpret_cast<const float4*>(s_dq + row * DQ_ROW_FLOATS + col);
  if (DQ_TILES == 2) {  // the other warpgroup's share
    const float4 u = *reinterpret_cast<const float4*>(s_dq + DQ_TILE_BYTES / 4 + row * DQ_ROW_FLOATS + col);
    v = make_float4(v.x + u.x, v.y + u.y, v.z + u.z, v.w + u.w);
  }
  return v;
}

// Adds the shared dQ tile's first `rows` rows to rows m0.. of dq_head (one head's dq_accum) with 16-byte atomics,
// `worker` 0..95 taking every 96th float4.
MHATTN_DEVICE void add_dq_by_atomics(const float* s_dq, float* dq_head, int m0, int rows, int worker) {
  for (int x = worker; x < rows * (HEAD_DIM / 4); x += 32 * DQ_WRITER_WARPS) {
    const int row = x / (HEAD_DIM / 4), col = (x % (HEAD_DIM / 4)) * 4;
    const float4 v = dq_tile_quad(s_dq, row, col);
    float* dst = dq_head + (i64)(m0 + row) * HEAD_DIM + col;
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
  }
}

// DQ_DIRECT: the shared dQ tile's first `rows` rows (both warpgroups' tiles summed where there are two) converted to
// the input dtype and stored as rows m0.. of dq_head (one head's dQ), `worker` 0..95 taking every 96th group of four.
MHATTN_DEVICE void store_dq_rows(const float* s_dq, elem_t* dq_head, int m0, int rows, int worker) {
  for (int x = worker; x < rows * (HEAD_DIM / 4); x += 32 * DQ_WRITER_WARPS) {
    const int row = x / (HEAD_DIM / 4), col = (x % (HEAD_DIM / 4)) * 4;
    const float4 v = dq_tile_quad(s_dq, row, col);
    *reinterpret_cast<uint2*>(dq_head + (i64)(m0 + row) * HEAD_DIM + col) = make_uint2(pack2(v.x, v.y),
                                                                                        pack2(v.z, v.w));
  }
}

// DQ_DIRECT: zeros into rows [lo, hi) of dq_head (query rows that see none of the keys), `worker` 0..95 taking every
// 96th group of four.
MHATTN_DEVICE void zero_dq_rows(elem_t* dq_head, int lo, int hi, int worker) {
  elem_t* rows = dq_head + (i64)lo * HEAD_DIM;
  for (int x = worker; x < (hi - lo) * (HEAD_DIM / 4); x += 32 * DQ_WRITER_WARPS)
    *reinterpret_cast<uint2*>(rows + 4 * x) = make_uint2(0u, 0u);
}

// Adds the shared dQ tile's first `rows` rows to rows m0.. of dq_head by the copy engine: one bulk reduce-add per
// tile row (tile rows are DQ_ROW_FLOATS * 4 bytes apart, a multiple of 16), `worker` 0..95 issuing every 96th; at
// d = 64 both warpgroups' tiles go as they are (the engine sums them in L2). Then waits until the engine has read
// them, so the tiles can be handed back. At d = 64 this path is a third slower than the atomics (NOTES.md, B6).
MHATTN_DEVICE void add_dq_by_bulk_reduce(float* s_dq, float* dq_head, int m0, int rows, int worker) {
  if (worker >= rows * DQ_TILES) return;
  for (int x = worker; x < rows * DQ_TILES; x += 32 * DQ_WRITER_WARPS) {
    const int tile = x / rows, row = x - tile * rows;
    const float* src = s_dq + tile * (DQ_TILE_BYTES / 4) + row * DQ_ROW_FLOATS;
    bulk_reduce_add_f32(dq_head + (i64)(m0 + row) * HEAD_DIM, smem_u32(src), HEAD_DIM * 4);
  }
  bulk_commit();
  bulk_wait_read();
}

// DETERMINISTIC: waits until `turn` other key blocks have added to the query block of `counter` (worker 0 polls; the
// barrier holds the other writers until then).
MHATTN_DEVICE void wait_for_turn(const int* counter, int turn, int worker) {
  if (worker == 0)
    while (load_acquire_gpu(counter) != turn) __nanosleep(32);
  named_barrier_sync(WRITER_BARRIER, 32 * DQ_WRITER_WARPS);
  if (DQ_BULK) fence_async_global();  // the bulk adds come after what the acquire saw
}

// DETERMINISTIC: hands the query block of `counter` on to the next key block once every writer's adds are done and
// visible at gpu scope.
MHATTN_DEVICE void pass_turn(int* counter, int worker) {
  if (DQ_BULK) {
    bulk_wait_all();
    fence_async_global();
  }
  fence_gpu();
  named_barrier_sync(WRITER_BARRIER, 32 * DQ_WRITER_WARPS);
  if (worker == 0) add_release_gpu(counter, 1);
}

// The dQ writers (warps 1-3 of the producer warpgroup, `worker` 0..95): per query block, its buffer's dQ tile added
// to dq_accum, rows below seqlen_q; the steps in the consumers' order. With DETERMINISTIC, in turn with the other key
// blocks (n_block of n_blocks).
MHATTN_DEVICE void write_dq(float* s_dq, float* dq_accum, int* dq_turns, DqBuffers dqb, QueryBlocks blocks,
                            int n_block, int n_blocks, const Bounds& bounds, int hk, int b, int group, int heads_q,
                            int seqlen_q, int worker) {
  const int m_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  int step = 0;
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const i64 head_offset = ((i64)b * heads_q + h) * seqlen_q * HEAD_DIM;
    float* dq_head = dq_accum + head_offset;
    elem_t* dq_out = reinterpret_cast<elem_t*>(dq_accum) + head_offset;  // DQ_DIRECT: dQ itself
    int* turns_head = DETERMINISTIC ? dq_turns + ((i64)b * heads_q + h) * m_blocks : nullptr;
    if (DQ_DIRECT) {  // the rows no query block of this CTA's reaches
      zero_dq_rows(dq_out, 0, min_of(blocks.first * BLOCK_M, seqlen_q), worker);
      zero_dq_rows(dq_out, min_of((blocks.first + blocks.count) * BLOCK_M, seqlen_q), seqlen_q, worker);
    }
    for (int i = 0; i < blocks.count; ++i, ++step) {
      const int m = blocks.first + i, m0 = m * BLOCK_M;
      const int rows = min_of(BLOCK_M, seqlen_q - m0);
      mbar_wait(dqb.full(DqBuffers::of(step)), DqBuffers::round(step));
      if (DETERMINISTIC)
        wait_for_turn(turns_head + m, worker == 0 ? later_key_blocks(m, n_block, n_blocks, seqlen_q, bounds) : 0,
                      worker);
      if (DQ_DIRECT)
        store_dq_rows(DqBuffers::tile(s_dq, step), dq_out, m0, rows, worker);
      else if (DQ_BULK)
        add_dq_by_bulk_reduce(DqBuffers::tile(s_dq, step), dq_head, m0, rows, worker);
      else
        add_dq_by_atomics(DqBuffers::tile(s_dq, step), dq_head, m0, rows, worker);
      if (DETERMINISTIC) pass_turn(turns_head + m, worker);
      __syncwarp();
      if ((worker & 31) == 0) mbar_arrive(dqb.empty(DqBuffers::of(step)));
    }
  }
}

// dK or dV rows of this thread (keys key0, key0 + 8 below seqlen_k) into the output.
MHATTN_DEVICE void store_key_rows(elem_t* dst_bh, i64 row_stride, const float (&acc)[ACC_REGS], int key0, int t,
                                  int seqlen_k) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= seqlen_k) continue;
    elem_t* dst = dst_bh + (i64)key * row_stride + 2 * t;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i)
      *reinterpret_cast<u32*>(dst + 8 * i) = pack2(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
  }
}

// ---- the kernel ------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(384, 1)
    mhattn_hopper_bwd(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                      const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap do_map,
                      const float* __restrict__ lse_log2, const float* __restrict__ delta, float* __restrict__ dq_accum,
                      int* __restrict__ dq_turns,
                      elem_t* __restrict__ dk, elem_t* __restrict__ dv, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb,
                      i64 dv_sh, i64 dv_sn, int seqlen_q, int seqlen_q_pad, int seqlen_k, int heads_q, int group,
                      float scale_log2, float scale, int diag_offset, int window_left, int window_right,
                      const unsigned char* __restrict__ mask, i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk, float softcap_in2,
                      float softcap_out2, const float* __restrict__ float_mask, i64 fm_sb, i64 fm_sh, i64 fm_sq,
                      i64 fm_sk) {
  MHATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x;
  const int n_block = DETERMINISTIC ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int n0 = n_block * BLOCK_N, hk = blockIdx.y, b = blockIdx.z;
  const Bounds bounds{diag_offset, window_left, window_right};
  const Softcap softcap{softcap_in2, softcap_out2};
  const QueryBlocks blocks = query_blocks(n0, seqlen_q, bounds);

  const u32 base = (smem_u32(smem) + SWIZZLE_ATOM - 1) & ~(SWIZZLE_ATOM - 1);
  const u32 kv_full = base + BAR_OFFSET;
  const DqBuffers dqb{kv_full + 8};
  const Ring ring{kv_full + 8 + 16 * DQ_BUFFERS};
  float* s_dq = reinterpret_cast<float*>(smem + (base - smem_u32(smem)) + DQ_OFFSET);
  if (tid == 0) {
    mbar_init(kv_full, 1);
    for (int j = 0; j < DQ_BUFFERS; ++j) {
      mbar_init(dqb.full(j), CONSUMER_WARPS);
      mbar_init(dqb.empty(j), DQ_WRITER_WARPS);
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(ring.full(s), 1);
      mbar_init(ring.empty(s), CONSUMER_WARPS);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = tid / 128;
  if (wg == 0) {
    release_registers<PRODUCER_REGS>();
    if (tid == 0)
      produce(&q_map, &k_map, &v_map, &do_map, lse_log2, delta, base, kv_full, ring, blocks, n0, hk, b, group,
              heads_q, seqlen_q_pad);
    else if (tid >= 32)
      write_dq(s_dq, dq_accum, dq_turns, dqb, blocks, n_block, gridDim.x, bounds, hk, b, group, heads_q, seqlen_q,
               tid - 32);
    return;
  }
  claim_registers<CONSUMER_REGS>();

  const int w = wg - 1, lane = tid & 31, warp = (tid & 127) >> 5, t = lane & 3;
  const int row_in_wg = warp * 16 + (lane >> 2);  // this thread's rows (keys of S^T, queries of dQ): +0 and +8
  const int key0 = n0 + 64 * w + row_in_wg;
  const u32 s_k_rows = base + K_OFFSET + 64 * w * ROW_BYTES, s_v_rows = base + V_OFFSET + 64 * w * ROW_BYTES;
  float dk_acc[ACC_REGS], dv_acc[ACC_REGS];
#pragma unroll
  for (int i = 0; i < ACC_REGS; ++i) dk_acc[i] = dv_acc[i] = 0.f;
  float st[SQ_REGS], dpt[SQ_REGS], dq[DQ_REGS];
  u32 p_frag[Q_STEPS][4], ds_frag[Q_STEPS][4];
  const float* s_vectors = reinterpret_cast<const float*>(smem + (base - smem_u32(smem)));

  // The query blocks that see this warpgroup's keys whole (none where its keys pass seqlen_k): no per-score masking.
  int whole_lo, whole_hi;
  bounds.whole_row_blocks<BLOCK_M>(n0 + 64 * w, n0 + 64 * w + 63, whole_lo, whole_hi);
  if (n0 + 64 * w + 64 > seqlen_k) whole_hi = 0;

  mbar_wait(kv_full, 0);
  int step = 0;
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const BoolMask bool_mask{BOOL_MASK ? mask + b * m_sb + h * m_sh : nullptr, m_sq, m_sk};
    const FloatMask fmask{FLOAT_MASK ? float_mask + b * fm_sb + h * fm_sh : nullptr, fm_sq, fm_sk};
    for (int i = 0; i < blocks.count; ++i, ++step) {
      const int s = step % STAGES;
      const int m0 = (blocks.first + i) * BLOCK_M;
      const u32 s_q = base + Q_OFFSET + s * Q_BYTES, s_do = base + DO_OFFSET + s * Q_BYTES;
      const u32 s_ds = base + DS_OFFSET + (step & 1) * DS_BYTES;
      mbar_wait(ring.full(s), (step / STAGES) & 1);
      wgmma_fence();
      issue_keys_by_queries(st, s_k_rows, s_q);
      wgmma_commit();
      issue_keys_by_queries(dpt, s_v_rows, s_do);
      wgmma_commit();
      wgmma_wait<1>();  // S^T: the probabilities while dP^T is multiplied
      touch_registers(st);
      cap_scores(st, softcap);
      if (m0 < whole_lo * BLOCK_M || m0 >= whole_hi * BLOCK_M)
        mask_scores(st, key0, m0, t, seqlen_k, bounds);
      if (BOOL_MASK) hide_forbidden<SQ_REGS, false>(st, bool_mask, key0, m0 + 2 * t, seqlen_k, seqlen_q);
      if (FLOAT_MASK)
        add_float_mask<SQ_REGS, false>(st, fmask, key0, m0 + 2 * t, seqlen_k, seqlen_q,
                                       LOG2E / softmax_scale_log2(scale_log2));
      probabilities(st, s_vectors + (LSE_OFFSET + s * VEC_BYTES) / 4, t, softmax_scale_log2(scale_log2));
      wgmma_wait<0>();
      touch_registers(dpt);
      score_gradients(dpt, st, s_vectors + (DELTA_OFFSET + s * VEC_BYTES) / 4,
                      s_vectors + (LSE_OFFSET + s * VEC_BYTES) / 4, t, scale, softcap);
      pack_a_fragments(p_frag, st);  // the A operands of dV and dK
      pack_a_fragments(ds_frag, dpt);
      wgmma_fence();
      issue_key_gradient(dv_acc, p_frag, s_do);
      issue_key_gradient(dk_acc, ds_frag, s_q);
      wgmma_commit();
      store_ds(s_ds, ds_frag, 64 * w + 16 * warp, lane);
      fence_async_shared();
      if (DQ_BY_KEYS)
        named_barrier_sync(DQ_BARRIER + w, 128);  // this warpgroup's dS^T written
      else
        named_barrier_sync(DQ_BARRIER, 256);  // both halves of dS^T written
      issue_dq(dq, s_ds, base + K_OFFSET, w);
      wgmma_commit();
      wgmma_wait<0>();
      touch_registers(dv_acc);
      touch_registers(dk_acc);
      touch_registers(dq);
      release_slot(ring.empty(s), lane);
      // the writers are done with the dQ this buffer held (DQ_BUFFERS steps ago)
      mbar_wait(dqb.empty(DqBuffers::of(step)), DqBuffers::round(step) ^ 1);
      store_dq(DqBuffers::tile(s_dq, step) + (DQ_BY_KEYS ? w * DQ_TILE_BYTES / 4 : 0), dq,
               (DQ_BY_QUERIES ? 64 * w : 0) + row_in_wg, D_CHUNKS == 1 ? 0 : 64 * w, t);
      if (DQ_BULK) fence_async_shared();  // the copy engine reads the tile
      release_slot(dqb.full(DqBuffers::of(step)), lane);
    }
  }
  store_key_rows(dk + b * dk_sb + hk * dk_sh, dk_sn, dk_acc, key0, t, seqlen_k);
  store_key_rows(dv + b * dv_sb + hk * dv_sh, dv_sn, dv_acc, key0, t, seqlen_k);
}
