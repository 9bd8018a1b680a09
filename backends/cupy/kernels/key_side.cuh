// What the two dK/dV kernels (bwd_dkdv.cu, bwd_dkdv_2d.cu) share: the shared-memory layout of their key
// block and their two stages of query-side tiles, the walk over the (query head, query block) steps that can
// see a key block, and the loads of one step.
//
// Shared memory: K | V | Q[2] | dO[2] | lse_log2[2] | delta[2], then whatever the kernel stages itself
// (from OFF_KEY_SIDE_END). Needs BLOCK_N, BLOCK_M and the definitions of common.cuh.
#pragma once
#include "common.cuh"

constexpr u32 KV_TILE_BYTES = BLOCK_N * SMEM_ROW * 2;
constexpr u32 Q_TILE_BYTES = BLOCK_M * SMEM_ROW * 2;
constexpr u32 OFF_K = 0;
constexpr u32 OFF_V = OFF_K + KV_TILE_BYTES;
constexpr u32 OFF_Q = OFF_V + KV_TILE_BYTES;
constexpr u32 OFF_DO = OFF_Q + 2 * Q_TILE_BYTES;
constexpr u32 OFF_LSE = OFF_DO + 2 * Q_TILE_BYTES;
constexpr u32 OFF_DELTA = OFF_LSE + 2 * BLOCK_M * 4;
constexpr u32 OFF_KEY_SIDE_END = OFF_DELTA + 2 * BLOCK_M * 4;

// Starts the copies of the key block's K and V rows [n0, n0 + BLOCK_N) (V has dim_v columns).
MHATTN_DEVICE void load_key_block(u32 s_base, const elem_t* k, i64 k_sn, const elem_t* v, i64 v_sn, int n0,
                                  int seqlen_k, int head_dim, int dim_v, int tid) {
  load_tile_async<BLOCK_N>(s_base + OFF_K, k, k_sn, n0, seqlen_k, head_dim, tid);
  load_tile_async<BLOCK_N>(s_base + OFF_V, v, v_sn, n0, seqlen_k, dim_v, tid);
}

// The steps of one key block [n0, n_last]: every query block that holds a query seeing one of these keys (the
// same range for every query head of the group), for each query head of the group in turn, in a fixed order.
struct QueryWalk {
  int mb_lo;  // first query block
  int n_mb;   // query blocks per query head
  int total;  // steps: group * n_mb

  MHATTN_DEVICE int head(int it, int hk, int group) const { return hk * group + it / n_mb; }
  MHATTN_DEVICE int row0(int it) const { return (mb_lo + it % n_mb) * BLOCK_M; }
};

MHATTN_DEVICE QueryWalk query_walk(int n0, int n_last, int seqlen_q, int group, int diag_offset, int window_left,
                                   int window_right) {
  int i_lo = 0, i_hi = seqlen_q;  // query rows that can see these keys
#if HAS_BOUNDS
  i_lo = (int)max_of((i64)0, (i64)n0 - diag_offset - window_right);
  i_hi = (int)min_of((i64)seqlen_q, (i64)n_last - diag_offset + window_left + 1);
#endif
  QueryWalk w;
  w.mb_lo = i_lo / BLOCK_M;
  w.n_mb = i_hi > i_lo ? (i_hi + BLOCK_M - 1) / BLOCK_M - w.mb_lo : 0;
  w.total = group * w.n_mb;
  return w;
}

// The query-side inputs of one (batch, kv head): Q and dO rows of query head hq, and the padded per-row
// vectors (B, Hq, Nq_pad) of lse in log2 units and delta.
struct QuerySide {
  const elem_t* q;   // at batch b
  const elem_t* d_o;
  const float* lse_log2;
  const float* delta;
  i64 q_sh, q_sn, do_sh, do_sn;
  int b, heads_q, seqlen_q, seqlen_q_pad, head_dim;
  int dim_v;  // columns of dO

  // Starts the copies of step (query head hq, query block at row m0) into stage `stage`.
  MHATTN_DEVICE void load_step(u32 s_base, int hq, int m0, int stage, int tid) const {
    load_tile_async<BLOCK_M>(s_base + OFF_Q + stage * Q_TILE_BYTES, q + hq * q_sh, q_sn, m0, seqlen_q, head_dim, tid);
    load_tile_async<BLOCK_M>(s_base + OFF_DO + stage * Q_TILE_BYTES, d_o + hq * do_sh, do_sn, m0, seqlen_q, dim_v,
                             tid);
    const i64 vec = ((i64)b * heads_q + hq) * seqlen_q_pad + m0;
    load_vec_async<BLOCK_M>(s_base + OFF_LSE + stage * BLOCK_M * 4, lse_log2 + vec, tid);
    load_vec_async<BLOCK_M>(s_base + OFF_DELTA + stage * BLOCK_M * 4, delta + vec, tid);
  }
};
