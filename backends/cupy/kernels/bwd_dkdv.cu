// FlashAttention-2 backward, key side: dK and dV for one block of BLOCK_N keys of one (batch, kv head).
//
// Each warp owns 16 or 32 key rows (one or two m16 tiles sharing every Q / dO fragment it loads) and
// keeps their dK and dV rows in float32 registers while the CTA walks every query block (of every query head sharing this kv head, for GQA) that can see its keys, so the
// sums are formed in one fixed order: deterministic, no atomics. Q, dO and the per-row lse / delta
// vectors of the next query block are in flight (cp.async, two stages) while this one is processed.
// Per query block, with the scores transposed (rows = keys, columns = queries):
//   S^T  = K Q^T                  P^T = 2^(S^T * scale * log2 e - lse_log2)
//   dP^T = V dO^T                 dS^T = P^T * (dP^T * keep / (1 - p) - delta)
//   dV  += (P^T * keep / (1 - p)) dO        dK += dS^T Q   (P^T, dS^T fed from registers)
// dK is scaled by the softmax scale at the end.
//
// DKDV_MODE 0 computes both; 1 only dV and 2 only dK: for head dims above 128 both accumulators do not
// fit in registers at once and the host launches the kernel twice. Mode 3 (the non-deterministic fast
// path) also forms dQ here: dS^T goes through shared memory, dQ_partial = scale dS K for this key block,
// and is added to a float32 dq_accum (B, Hq, Nq, head_dim) with atomic adds, whose order varies.
#include "key_side.cuh"
#include "score_mask.cuh"
#include "sequences.cuh"
#include "warp_mma.cuh"

#ifndef DKDV_MODE
#define DKDV_MODE 0
#endif
#ifndef KV_IN_REGS
#define KV_IN_REGS 0
#endif
#define COMPUTE_DV (DKDV_MODE != 2)
#define COMPUTE_DK (DKDV_MODE != 1)
#define COMPUTE_DQ (DKDV_MODE == 3)
#if VARLEN
static_assert(!COMPUTE_DQ, "VARLEN: packed sequences take dQ from bwd_dq.cu (no atomic dQ layout for them)");
#endif

constexpr int ROWS_PER_WARP = BLOCK_N / NUM_WARPS;
constexpr int MT = ROWS_PER_WARP / 16;  // m16 tiles of key rows per warp
constexpr int NT_S = BLOCK_M / 8;       // n8 tiles across a query block (columns of S^T)
constexpr int NT_O = HEAD_DIM / 8;      // n8 tiles across a dK / dV row block
// shared memory: the key-side layout of key_side.cuh (| dS^T in mode 3)
// mode 3: dS^T staged as a [key][query] tile (BLOCK_M + 8 elements per row, same bank-spreading pad)
constexpr int DS_ROW = BLOCK_M + 8;
constexpr u32 OFF_DS = OFF_KEY_SIDE_END;
// mode 3: the dQ product is split over warps: DQ_TILES m16 tiles, NUM_WARPS / DQ_TILES warps per tile
// sharing its head-dim columns in chunks of 32
constexpr int DQ_TILES = BLOCK_M / 16;
constexpr int DQ_WARPS_PER_TILE = NUM_WARPS / DQ_TILES > 0 ? NUM_WARPS / DQ_TILES : 1;
#if COMPUTE_DQ
static_assert(NUM_WARPS % DQ_TILES == 0 && (HEAD_DIM / 32) % DQ_WARPS_PER_TILE == 0,
              "mode 3 splits dQ's m16 tiles and 32-column chunks evenly over the warps");
#endif
static_assert(ROWS_PER_WARP * NUM_WARPS == BLOCK_N && (MT == 1 || MT == 2), "each warp owns 16 or 32 key rows");
static_assert(BLOCK_M % 16 == 0 && BLOCK_M <= 128, "BLOCK_M must be a multiple of 16, at most 128");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
    mhattn_bwd_dkdv(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                    const elem_t* __restrict__ d_o, const float* __restrict__ lse_log2,
                    const float* __restrict__ delta, elem_t* __restrict__ dk, elem_t* __restrict__ dv,
                    float* __restrict__ dq_accum,
                    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
                    i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb, i64 dv_sh,
                    i64 dv_sn,
                    int seqlen_q, int seqlen_q_pad, int seqlen_k, int heads_q, int group, int head_dim,
                    float scale_log2, float scale, int diag_offset, int window_left, int window_right,
                    const unsigned char* __restrict__ mask, i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk,
                    const u32* __restrict__ seed_words, u32 drop_threshold, float drop_scale,
                    int head_dim_v, float softcap_in2, float softcap_out2, const float* __restrict__ float_mask,
                    i64 fm_sb, i64 fm_sh, i64 fm_sq, i64 fm_sk, float* __restrict__ dmask SEQUENCE_PARAMS) {
  MHATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int n0 = blockIdx.x * BLOCK_N;
#if VARLEN
  const Sequence seq = packed_backward(b, seqlen_q, seqlen_k, seq_q, seq_k, q, q_sn, d_o, do_sn, k, k_sn, v, v_sn,
                                       lse_log2, delta);
  if (n0 >= seq.seqlen_k) return;  // past this sequence's last key (the grid is sized by the longest)
  dk += seq.k_start * dk_sn;
  dv += seq.k_start * dv_sn;
#endif
  const int n_last = min_of(n0 + BLOCK_N, seqlen_k) - 1;
  const int warp_row0 = warp * ROWS_PER_WARP;
  const u32 s_base = smem_u32(smem);

  k += b * k_sb + hk * k_sh;
  v += b * v_sb + hk * v_sh;
  dk += b * dk_sb + hk * dk_sh;
  dv += b * dv_sb + hk * dv_sh;

  // The (query head, query block) steps that can see these keys, walked in a fixed order.
  const QueryWalk walk = query_walk(n0, n_last, seqlen_q, group, diag_offset, window_left, window_right);
  const int total = walk.total;
  const int dim_v = ANY_DIMS ? head_dim_v : head_dim;  // columns of V, dO and dV
  const QuerySide query_side{q + b * q_sb, d_o + b * do_sb, lse_log2, delta, q_sh, q_sn, do_sh, do_sn,
                             VARLEN ? 0 : b, heads_q, seqlen_q, seqlen_q_pad, head_dim, dim_v};
  const Softcap softcap{softcap_in2, softcap_out2};

#if HAS_EXTRAS
  const bool use_dropout = drop_threshold != 0u;
#endif

  load_key_block(s_base, k, k_sn, v, v_sn, n0, seqlen_k, head_dim, dim_v, tid);
  if (total > 0) query_side.load_step(s_base, walk.head(0, hk, group), walk.row0(0), 0, tid);
  cp_async_commit();

#if COMPUTE_DK
  float acc_dk[MT][NT_O][4];
  zero_acc(acc_dk);
#endif
#if COMPUTE_DV
  float acc_dv[MT][NT_O][4];
  zero_acc(acc_dv);
#endif
#if KV_IN_REGS
  u32 k_frag[MT][KD][4];
#if COMPUTE_DK
  u32 v_frag[MT][KD][4];
#endif
#else
  u32 (*k_frag)[KD][4] = nullptr;  // unused: K and V fragments come from shared memory
  u32 (*v_frag)[KD][4] = nullptr;
#endif

  for (int it = 0; it < total; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    block_sync();  // step `it` has landed; everyone is done with the other stage
    if (it + 1 < total)
      query_side.load_step(s_base, walk.head(it + 1, hk, group), walk.row0(it + 1), stage ^ 1, tid);
    cp_async_commit();
#if KV_IN_REGS
    if (it == 0) {
#if COMPUTE_DK
      load_a_frags(k_frag, s_base + OFF_K, v_frag, s_base + OFF_V, warp_row0, lane);
#else
      load_a_frags(k_frag, s_base + OFF_K, warp_row0, lane);
#endif
    }
#endif

    const int hq = walk.head(it, hk, group);
    const int m0 = walk.row0(it);
    const u32 s_q = s_base + OFF_Q + stage * Q_TILE_BYTES;
    const u32 s_do = s_base + OFF_DO + stage * Q_TILE_BYTES;
    const float* s_lse = reinterpret_cast<const float*>(smem + OFF_LSE + stage * BLOCK_M * 4);
    const float* s_delta = reinterpret_cast<const float*>(smem + OFF_DELTA + stage * BLOCK_M * 4);

    // S^T = K Q^T for this warp's key rows against the BLOCK_M queries.
    float st[MT][NT_S][4];
    mma_abt<MT, NT_S, KV_IN_REGS != 0>(st, k_frag, s_base + OFF_K, warp_row0, s_q, 0, lane);

    // P^T = 2^(S^T scale log2e - lse_log2); invisible pairs -> 0. Padded query rows carry lse_log2 = +inf.
    const ScoreMask smask = score_mask(b, hq, seqlen_q, seqlen_k, diag_offset, window_left, window_right, mask, m_sb,
                                       m_sh, m_sq, m_sk, float_mask, fm_sb, fm_sh, fm_sq, fm_sk);
    const bool need_mask = smask.block_needs_mask(false, m0, min_of(m0 + BLOCK_M, seqlen_q) - 1, n0, n_last);
#if SOFTCAP && COMPUTE_DK
    float st_tanh[MT][NT_S][4];  // tanh of each score, for dS's softcap factor
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int j = n0 + warp_row0 + mt * 16 + g + 8 * hr;
        const VisibleColumns queries = smask.queries_of_key(j, m0 + 2 * t);  // relative to this lane's first column
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int cc = nt * 8 + e;  // column relative to m0 + 2t
            float th;
            float x = log2_score(st[mt][nt][2 * hr + e], scale_log2, softcap, th);
#if SOFTCAP && COMPUTE_DK
            st_tanh[mt][nt][2 * hr + e] = th;
#endif
            if (need_mask) x = smask.apply(x, queries.contains(cc), m0 + 2 * t + cc, j);
            st[mt][nt][2 * hr + e] = fast_exp2(x - s_lse[2 * t + cc]);
          }
      }

#if HAS_EXTRAS
    // keep bit of element (mt, nt, e) at position 4 nt + e of keep_bits[mt]
    unsigned long long keep_bits[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) keep_bits[mt] = ~0ull;
    if (use_dropout) {
      DropoutRng rng;
      rng.init((u32)(b * heads_q + hq), seed_words, drop_threshold);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        keep_bits[mt] = 0ull;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = m0 + nt * 8 + 2 * t + (e & 1);
            const int j = n0 + warp_row0 + mt * 16 + g + ((e >> 1) << 3);
            if (rng.keep_pair(i, j)) keep_bits[mt] |= 1ull << (4 * nt + e);
          }
      }
    }
#endif

#if COMPUTE_DK
    // dP^T = V dO^T, then dS^T = P^T (dP^T keep / (1 - p) - delta), kept in dpt.
    float dpt[MT][NT_S][4];
    mma_abt<MT, NT_S, KV_IN_REGS != 0>(dpt, v_frag, s_base + OFF_V, warp_row0, s_do, 0, lane);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float dp = dpt[mt][nt][e];
#if HAS_EXTRAS
          if (use_dropout) dp = dropped(dp, (keep_bits[mt] >> (4 * nt + e)) & 1ull, drop_scale);
#endif
          dpt[mt][nt][e] = st[mt][nt][e] * (dp - s_delta[nt * 8 + 2 * t + (e & 1)]);
#if SOFTCAP
          dpt[mt][nt][e] *= softcap_grad(st_tanh[mt][nt][e]);
#endif
        }
#endif

#if COMPUTE_DV
#if HAS_EXTRAS
    if (use_dropout) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            st[mt][nt][e] = dropped(st[mt][nt][e], (keep_bits[mt] >> (4 * nt + e)) & 1ull, drop_scale);
    }
#endif
    // dV += P_dropped^T dO
    mma_regs_ab(acc_dv, st, s_do, lane);
#endif

#if COMPUTE_DK
    // dK += dS^T Q
    mma_regs_ab(acc_dk, dpt, s_q, lane);
#endif

#if COMPUTE_DQ
    // dQ_partial = scale dS K: dS^T to shared memory as [key][query], then each warp takes an m16 tile of
    // queries (and a share of the head-dim columns) with dS read back transposed as the A operand.
    {
      unsigned char* s_ds = smem + OFF_DS;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
          const int col = nt * 8 + 2 * t;
          const int row = warp_row0 + mt * 16 + g;
          *reinterpret_cast<u32*>(s_ds + (row * DS_ROW + col) * 2) = pack2(dpt[mt][nt][0], dpt[mt][nt][1]);
          *reinterpret_cast<u32*>(s_ds + ((row + 8) * DS_ROW + col) * 2) = pack2(dpt[mt][nt][2], dpt[mt][nt][3]);
        }
      block_sync();
      const int tile = warp % DQ_TILES;
      const int part = warp / DQ_TILES;
      constexpr int CHUNKS = HEAD_DIM / 32 / DQ_WARPS_PER_TILE;
      float* dq_rows = dq_accum + (((i64)b * heads_q + hq) * seqlen_q) * head_dim;
      const int row_a = m0 + tile * 16 + g, row_b = row_a + 8;
#pragma unroll 1
      for (int chunk = 0; chunk < CHUNKS; ++chunk) {
        const int c0 = (part * CHUNKS + chunk) * 32;
        if (c0 >= head_dim) break;
        float acc[1][4][4];
        zero_acc(acc);
        mma_smem_ab<1, 4, BLOCK_N / 16, true>(acc, smem_u32(s_ds), DS_ROW, tile * 16, s_base + OFF_K, c0, lane);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int c = c0 + nt * 8 + 2 * t;
          if (c < head_dim) {
            if (row_a < seqlen_q)
              atomic_add_dq_pair(dq_rows + (i64)row_a * head_dim + c, c, head_dim, acc[0][nt][0] * scale,
                                 acc[0][nt][1] * scale);
            if (row_b < seqlen_q)
              atomic_add_dq_pair(dq_rows + (i64)row_b * head_dim + c, c, head_dim, acc[0][nt][2] * scale,
                                 acc[0][nt][3] * scale);
          }
        }
      }
    }
#endif
  }

  // Stage through shared memory (over K and V, each warp its own rows) for 16-byte stores.
  cp_async_wait<0>();
  block_sync();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#if COMPUTE_DK
    acc_to_smem<NT_O>(smem + OFF_K, acc_dk[mt], warp_row0 + mt * 16, scale, lane);
#endif
#if COMPUTE_DV
    acc_to_smem<NT_O>(smem + OFF_V, acc_dv[mt], warp_row0 + mt * 16, 1.f, lane);
#endif
  }
  block_sync();
#if COMPUTE_DK
  store_tile<BLOCK_N>(dk, dk_sn, smem + OFF_K, n0, seqlen_k, head_dim, tid);
#endif
#if COMPUTE_DV
  store_tile<BLOCK_N>(dv, dv_sn, smem + OFF_V, n0, seqlen_k, dim_v, tid);
#endif
}
