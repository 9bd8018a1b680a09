// FlashAttention-2 backward, query side: dQ for one block of BLOCK_M query rows of one (batch, head).
//
// The deterministic alternative to accumulating dQ with atomics from the key-side kernel: each warp owns
// 16 or 32 query rows (one or two m16 tiles sharing every K / V fragment it loads) and keeps their dQ in
// float32 registers while the CTA walks the key blocks those rows can see (K and V double-buffered with
// cp.async). Per key block:
//   S  = Q K^T      P = 2^(S * scale * log2 e - lse_log2)
//   dP = dO V^T     dS = P (dP keep / (1 - p) - delta)      dQ += dS K   (dS fed from registers)
// dQ is scaled by the softmax scale at the end. VARLEN: packed sequences (sequences.cuh).
#include "score_mask.cuh"
#include "sequences.cuh"
#include "warp_mma.cuh"

#ifndef Q_IN_REGS
#define Q_IN_REGS 0
#endif

constexpr int ROWS_PER_WARP = BLOCK_M / NUM_WARPS;
constexpr int MT = ROWS_PER_WARP / 16;  // m16 tiles per warp: each K / V fragment feeds MT products
constexpr int NT_S = BLOCK_N / 8;
constexpr int NT_O = HEAD_DIM / 8;
constexpr u32 Q_TILE_BYTES = BLOCK_M * SMEM_ROW * 2;
constexpr u32 KV_TILE_BYTES = BLOCK_N * SMEM_ROW * 2;
// shared memory: Q | dO | K[2] | V[2]
constexpr u32 OFF_Q = 0;
constexpr u32 OFF_DO = Q_TILE_BYTES;
constexpr u32 OFF_K = 2 * Q_TILE_BYTES;
constexpr u32 OFF_V = OFF_K + 2 * KV_TILE_BYTES;
static_assert(ROWS_PER_WARP * NUM_WARPS == BLOCK_M && (MT == 1 || MT == 2), "each warp owns 16 or 32 query rows");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
    mhattn_bwd_dq(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                  const elem_t* __restrict__ d_o, const float* __restrict__ lse_log2, const float* __restrict__ delta,
                  elem_t* __restrict__ dq,
                  i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                  i64 do_sb, i64 do_sh, i64 do_sn, i64 dq_sb, i64 dq_sh, i64 dq_sn,
                  int seqlen_q, int seqlen_q_pad, int seqlen_k, int heads_q, int group, int head_dim,
                  float scale_log2, float scale, int diag_offset, int window_left, int window_right,
                  const unsigned char* __restrict__ mask, i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk,
                  const u32* __restrict__ seed_words, u32 drop_threshold, float drop_scale,
                  int head_dim_v, float softcap_in2, float softcap_out2, const float* __restrict__ float_mask,
                  i64 fm_sb, i64 fm_sh, i64 fm_sq, i64 fm_sk, float* __restrict__ dmask SEQUENCE_PARAMS) {
  MHATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // most keys first under a causal mask
  const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
  const int m0 = m_block * BLOCK_M;
#if VARLEN
  const Sequence seq = packed_backward(b, seqlen_q, seqlen_k, seq_q, seq_k, q, q_sn, d_o, do_sn, k, k_sn, v, v_sn,
                                       lse_log2, delta);
  if (m0 >= seq.seqlen_q) return;  // past this sequence's last query (the grid is sized by the longest)
  dq += seq.q_start * dq_sn;
#endif
  const int warp_row0 = warp * ROWS_PER_WARP;
  const u32 s_base = smem_u32(smem);
  const int dim_v = ANY_DIMS ? head_dim_v : head_dim;  // columns of V and dO
  const Softcap softcap{softcap_in2, softcap_out2};
#if FLOAT_MASK
  const MaskGrad mask_grad{dmask != nullptr ? dmask + ((i64)b * heads_q + h) * seqlen_q * seqlen_k : nullptr};
#endif

  q += b * q_sb + h * q_sh;
  d_o += b * do_sb + h * do_sh;
  k += b * k_sb + hk * k_sh;
  v += b * v_sb + hk * v_sh;
  dq += b * dq_sb + h * dq_sh;

  // Key blocks this query block can see, and what hides a score.
  const int m_last = min_of(m0 + BLOCK_M, seqlen_q) - 1;
  const KeyBlockRange blocks = key_block_range(m0, m_last, seqlen_k, diag_offset, window_left, window_right);
  const int nb_lo = blocks.lo, nb_hi = blocks.hi;
  const ScoreMask smask = score_mask(b, h, seqlen_q, seqlen_k, diag_offset, window_left, window_right, mask, m_sb,
                                     m_sh, m_sq, m_sk, float_mask, fm_sb, fm_sh, fm_sq, fm_sk);

  // This lane's rows (g and g + 8 of each m16 tile): lse in log2 units (+inf for padding or rows that see
  // nothing) and delta.
  float row_lse[MT][2], row_delta[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const i64 vec = ((i64)(VARLEN ? 0 : b) * heads_q + h) * seqlen_q_pad + m0 + warp_row0 + mt * 16 + g + 8 * hr;
      row_lse[mt][hr] = lse_log2[vec];
      row_delta[mt][hr] = delta[vec];
    }

#if HAS_EXTRAS
  const bool use_dropout = drop_threshold != 0u;
  DropoutRng rng;
  rng.init((u32)(b * heads_q + h), seed_words, drop_threshold);
  u32 row_key[MT][2];
  rng.row_keys(row_key, m0 + warp_row0, g);
#endif

  load_tile_async<BLOCK_M>(s_base + OFF_Q, q, q_sn, m0, seqlen_q, head_dim, tid);
  load_tile_async<BLOCK_M>(s_base + OFF_DO, d_o, do_sn, m0, seqlen_q, dim_v, tid);
  if (nb_lo < nb_hi) {
    load_tile_async<BLOCK_N>(s_base + OFF_K, k, k_sn, nb_lo * BLOCK_N, seqlen_k, head_dim, tid);
    load_tile_async<BLOCK_N>(s_base + OFF_V, v, v_sn, nb_lo * BLOCK_N, seqlen_k, dim_v, tid);
  }
  cp_async_commit();

  float acc_dq[MT][NT_O][4];
  zero_acc(acc_dq);
#if Q_IN_REGS
  u32 q_frag[MT][KD][4], do_frag[MT][KD][4];
#else
  u32 (*q_frag)[KD][4] = nullptr;  // unused: Q and dO fragments come from shared memory
  u32 (*do_frag)[KD][4] = nullptr;
#endif

  for (int nb = nb_lo; nb < nb_hi; ++nb) {
    const int stage = (nb - nb_lo) & 1;
    const u32 s_k = s_base + OFF_K + stage * KV_TILE_BYTES;
    const u32 s_v = s_base + OFF_V + stage * KV_TILE_BYTES;
    cp_async_wait<0>();
    block_sync();
    if (nb + 1 < nb_hi) {
      const u32 nxt = (stage ^ 1) * KV_TILE_BYTES;
      load_tile_async<BLOCK_N>(s_base + OFF_K + nxt, k, k_sn, (nb + 1) * BLOCK_N, seqlen_k, head_dim, tid);
      load_tile_async<BLOCK_N>(s_base + OFF_V + nxt, v, v_sn, (nb + 1) * BLOCK_N, seqlen_k, dim_v, tid);
    }
    cp_async_commit();
#if Q_IN_REGS
    if (nb == nb_lo) load_a_frags(q_frag, s_base + OFF_Q, do_frag, s_base + OFF_DO, warp_row0, lane);
#endif

    // S = Q K^T and dP = dO V^T
    float s[MT][NT_S][4], dp[MT][NT_S][4];
    mma_abt<MT, NT_S, Q_IN_REGS != 0>(s, q_frag, s_base + OFF_Q, warp_row0, s_k, 0, lane);
    mma_abt<MT, NT_S, Q_IN_REGS != 0>(dp, do_frag, s_base + OFF_DO, warp_row0, s_v, 0, lane);

    // dS = P (dP keep / (1 - p) - delta), with P = 0 where the row cannot see the key.
    const int n0 = nb * BLOCK_N;
    const bool need_mask = smask.block_needs_mask(n0 + BLOCK_N > seqlen_k, m0, m_last, n0, n0 + BLOCK_N - 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = m0 + warp_row0 + mt * 16 + g + 8 * hr;
        const VisibleColumns keys = smask.keys_of_query(i, n0 + 2 * t);  // relative to this lane's first column
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int jj = nt * 8 + e;
            const int j = n0 + 2 * t + jj;
            float th;
            float x = log2_score(s[mt][nt][2 * hr + e], scale_log2, softcap, th);
            if (need_mask) x = smask.apply(x, keys.contains(jj), i, j);
            const float p = fast_exp2(x - row_lse[mt][hr]);
            float dpv = dp[mt][nt][2 * hr + e];
#if HAS_EXTRAS
            if (use_dropout) dpv = dropped(dpv, rng.keep(row_key[mt][hr], j), drop_scale);
#endif
#if FLOAT_MASK || SOFTCAP
            float ds = p * (dpv - row_delta[mt][hr]);
#if FLOAT_MASK
            mask_grad.store(i, j, seqlen_q, seqlen_k, ds);  // the mask is added after the softcap
#endif
#if SOFTCAP
            ds *= softcap_grad(th);
#endif
            dp[mt][nt][2 * hr + e] = ds;
#else
            dp[mt][nt][2 * hr + e] = p * (dpv - row_delta[mt][hr]);
#endif
          }
      }

    // dQ += dS K (K read transposed: rows = keys = the k dimension)
    mma_regs_ab(acc_dq, dp, s_k, lane);
  }

  cp_async_wait<0>();
  block_sync();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc_to_smem<NT_O>(smem + OFF_Q, acc_dq[mt], warp_row0 + mt * 16, scale, lane);
  block_sync();
  store_tile<BLOCK_M>(dq, dq_sn, smem + OFF_Q, m0, seqlen_q, head_dim, tid);
}
