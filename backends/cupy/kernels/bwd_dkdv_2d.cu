// FlashAttention-2 backward, key side, with each matrix product tiled over the warps in two dimensions:
// dK and dV for one block of BLOCK_N keys of one (batch, kv head), and in mode 3 also dQ (float32 atomics).
//
// The CTA walks every (query head of the group, query block) that can see its keys in a fixed order, with
// Q, dO and the per-row lse / delta of the next step in flight (cp.async, two stages). Per step, three
// phases, each with its own split of the warps:
//   scores   (keys x queries, S_WARPS_N x S_WARPS_M warps): S^T = K Q^T and dP^T = V dO^T for the warp's
//            sub-block, then P^T = 2^(S^T scale log2 e - lse_log2) and dS^T = P^T (dP^T keep / (1 - p) - delta);
//            P^T (with dropout applied) and dS^T go to shared memory as 16-bit [key][query] tiles;
//   dK, dV   (keys x head dim, KV_WARPS_N x KV_WARPS_D warps): dV += P^T dO and dK += dS^T Q, the A operand
//            read back from those tiles; the accumulators stay in registers for the whole walk
//            (deterministic: no atomics);
//   dQ       (mode 3; queries x head dim, DQ_WARPS_M x DQ_WARPS_D warps): scale dS K for this key block,
//            added to a float32 dq_accum (B, Hq, Nq, head_dim) with atomics, whose order varies.
// Against the one-dimensional layout of bwd_dkdv.cu (each warp multiplies all queries of the step with
// its own 16 or 32 keys) every warp reads a smaller share of Q and dO per step, at the price of the
// shared-memory round trip of P^T and dS^T; the kernels are bound by shared-memory bandwidth.
// dK is scaled by the softmax scale at the end.
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
#ifndef DQ_WARPS_M
#define DQ_WARPS_M 1
#endif
#define COMPUTE_DQ (DKDV_MODE == 3)
#if VARLEN
static_assert(!COMPUTE_DQ, "VARLEN: packed sequences take dQ from bwd_dq.cu (no atomic dQ layout for them)");
#endif
static_assert(DKDV_MODE == 0 || DKDV_MODE == 3, "DKDV_MODE: 0 (dK and dV) or 3 (dK, dV and dQ with atomics)");

// scores phase: S_ROWS keys x S_COLS queries per warp
constexpr int S_WARPS_M = NUM_WARPS / S_WARPS_N;
constexpr int S_ROWS = BLOCK_N / S_WARPS_N;
constexpr int S_COLS = BLOCK_M / S_WARPS_M;
constexpr int S_MT = S_ROWS / 16;  // m16 tiles of keys
constexpr int S_NT = S_COLS / 8;   // n8 tiles of queries
// dK / dV phase: KV_ROWS keys x KV_COLS head-dim columns per warp
constexpr int KV_WARPS_D = NUM_WARPS / KV_WARPS_N;
constexpr int KV_ROWS = BLOCK_N / KV_WARPS_N;
constexpr int KV_COLS = HEAD_DIM / KV_WARPS_D;
constexpr int KV_MT = KV_ROWS / 16;
constexpr int KV_NT = KV_COLS / 8;
// dQ phase: DQ_ROWS queries x DQ_COLS head-dim columns per warp
constexpr int DQ_WARPS_D = NUM_WARPS / DQ_WARPS_M;
constexpr int DQ_ROWS = BLOCK_M / DQ_WARPS_M;
constexpr int DQ_COLS = HEAD_DIM / DQ_WARPS_D;
constexpr int DQ_MT = DQ_ROWS / 16;
constexpr int DQ_NT = DQ_COLS / 8;
static_assert(S_WARPS_N * S_WARPS_M == NUM_WARPS && S_ROWS % 16 == 0 && S_COLS % 16 == 0,
              "the scores phase splits BLOCK_N x BLOCK_M into warp tiles of whole 16 x 16 blocks");
static_assert(KV_WARPS_N * KV_WARPS_D == NUM_WARPS && KV_ROWS % 16 == 0 && KV_COLS % 16 == 0,
              "the dK / dV phase splits BLOCK_N x HEAD_DIM into warp tiles of whole 16 x 16 blocks");
static_assert(!COMPUTE_DQ || (DQ_WARPS_M * DQ_WARPS_D == NUM_WARPS && DQ_ROWS % 16 == 0 && DQ_COLS % 16 == 0),
              "the dQ phase splits BLOCK_M x HEAD_DIM into warp tiles of whole 16 x 16 blocks");
static_assert(BLOCK_M % 16 == 0 && BLOCK_M <= 128, "BLOCK_M must be a multiple of 16, at most 128");

// P^T and dS^T tiles: [key][query], BLOCK_M + 8 elements per row (the same bank-spreading pad as SMEM_ROW)
constexpr int PT_ROW = BLOCK_M + 8;
constexpr u32 PT_TILE_BYTES = BLOCK_N * PT_ROW * 2;
// shared memory: the key-side layout of key_side.cuh | P^T | dS^T
constexpr u32 OFF_PT = OFF_KEY_SIDE_END;
constexpr u32 OFF_DST = OFF_PT + PT_TILE_BYTES;

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
    mhattn_bwd_dkdv_2d(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
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
  const u32 s_base = smem_u32(smem);
  // this warp's block in each phase (keys / queries relative to n0 / m0)
  const int s_row0 = (warp % S_WARPS_N) * S_ROWS, s_col0 = (warp / S_WARPS_N) * S_COLS;
  const int kv_row0 = (warp % KV_WARPS_N) * KV_ROWS, kv_col0 = (warp / KV_WARPS_N) * KV_COLS;
#if COMPUTE_DQ
  const int dq_row0 = (warp % DQ_WARPS_M) * DQ_ROWS, dq_col0 = (warp / DQ_WARPS_M) * DQ_COLS;
#endif

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

  float acc_dk[KV_MT][KV_NT][4], acc_dv[KV_MT][KV_NT][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);
#if KV_IN_REGS
  u32 k_frag[S_MT][KD][4], v_frag[S_MT][KD][4];
#else
  u32 (*k_frag)[KD][4] = nullptr;  // unused: K and V fragments come from shared memory
  u32 (*v_frag)[KD][4] = nullptr;
#endif

  for (int it = 0; it < total; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    block_sync();  // step `it` has landed; everyone is done with the other stage and with P^T / dS^T
    if (it + 1 < total)
      query_side.load_step(s_base, walk.head(it + 1, hk, group), walk.row0(it + 1), stage ^ 1, tid);
    cp_async_commit();
#if KV_IN_REGS
    if (it == 0) load_a_frags(k_frag, s_base + OFF_K, v_frag, s_base + OFF_V, s_row0, lane);
#endif

    const int hq = walk.head(it, hk, group);
    const int m0 = walk.row0(it);
    const u32 s_q = s_base + OFF_Q + stage * Q_TILE_BYTES;
    const u32 s_do = s_base + OFF_DO + stage * Q_TILE_BYTES;
    const float* s_lse = reinterpret_cast<const float*>(smem + OFF_LSE + stage * BLOCK_M * 4);
    const float* s_delta = reinterpret_cast<const float*>(smem + OFF_DELTA + stage * BLOCK_M * 4);

    // ---- scores phase ----
    float st[S_MT][S_NT][4];
    mma_abt<S_MT, S_NT, KV_IN_REGS != 0>(st, k_frag, s_base + OFF_K, s_row0, s_q, s_col0, lane);

    const ScoreMask smask = score_mask(b, hq, seqlen_q, seqlen_k, diag_offset, window_left, window_right, mask, m_sb,
                                       m_sh, m_sq, m_sk, float_mask, fm_sb, fm_sh, fm_sq, fm_sk);
    const bool need_mask = smask.block_needs_mask(false, m0, min_of(m0 + BLOCK_M, seqlen_q) - 1, n0, n_last);
#if SOFTCAP
    float st_tanh[S_MT][S_NT][4];  // tanh of each score, for dS's softcap factor
#endif
    // P^T = 2^(S^T scale log2e - lse_log2); invisible pairs -> 0. Padded query rows carry lse_log2 = +inf.
    const int first_col = m0 + s_col0 + 2 * t;  // this lane's first query column
#pragma unroll
    for (int mt = 0; mt < S_MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int j = n0 + s_row0 + mt * 16 + g + 8 * hr;
        const VisibleColumns queries = smask.queries_of_key(j, first_col);
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int cc = nt * 8 + e;  // column relative to first_col
            float th;
            float x = log2_score(st[mt][nt][2 * hr + e], scale_log2, softcap, th);
#if SOFTCAP
            st_tanh[mt][nt][2 * hr + e] = th;
#endif
            if (need_mask) x = smask.apply(x, queries.contains(cc), first_col + cc, j);
            st[mt][nt][2 * hr + e] = fast_exp2(x - s_lse[s_col0 + 2 * t + cc]);
          }
      }

    float dpt[S_MT][S_NT][4];
    mma_abt<S_MT, S_NT, KV_IN_REGS != 0>(dpt, v_frag, s_base + OFF_V, s_row0, s_do, s_col0, lane);

    // dS^T = P^T (dP^T keep / (1 - p) - delta); P^T (dropped) and dS^T to shared memory.
#if HAS_EXTRAS
    DropoutRng rng;
    if (use_dropout) rng.init((u32)(b * heads_q + hq), seed_words, drop_threshold);
#endif
    unsigned char* s_pt = smem + OFF_PT;
    unsigned char* s_dst = smem + OFF_DST;
#pragma unroll
    for (int mt = 0; mt < S_MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = s_row0 + mt * 16 + g + 8 * hr;  // key, relative to n0
          const int col = s_col0 + nt * 8 + 2 * t;        // query, relative to m0
          float p_kept[2], ds[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = st[mt][nt][2 * hr + e];
            float dp = dpt[mt][nt][2 * hr + e];
            p_kept[e] = p;
#if HAS_EXTRAS
            if (use_dropout) {
              const bool keep = rng.keep_pair(m0 + col + e, n0 + row);
              dp = dropped(dp, keep, drop_scale);
              p_kept[e] = dropped(p, keep, drop_scale);
            }
#endif
            ds[e] = p * (dp - s_delta[col + e]);
#if SOFTCAP
            ds[e] *= softcap_grad(st_tanh[mt][nt][2 * hr + e]);
#endif
          }
          *reinterpret_cast<u32*>(s_pt + (row * PT_ROW + col) * 2) = pack2(p_kept[0], p_kept[1]);
          *reinterpret_cast<u32*>(s_dst + (row * PT_ROW + col) * 2) = pack2(ds[0], ds[1]);
        }
    block_sync();  // P^T and dS^T complete

    // ---- dK / dV phase: dV += P^T dO, dK += dS^T Q ----
    mma_smem_ab<KV_MT, KV_NT, BLOCK_M / 16, false>(acc_dv, s_base + OFF_PT, PT_ROW, kv_row0, s_do, kv_col0, lane);
    mma_smem_ab<KV_MT, KV_NT, BLOCK_M / 16, false>(acc_dk, s_base + OFF_DST, PT_ROW, kv_row0, s_q, kv_col0, lane);

#if COMPUTE_DQ
    // ---- dQ phase: dQ_partial = scale dS K (dS read transposed from the dS^T tile) ----
    {
      float acc[DQ_MT][DQ_NT][4];
      zero_acc(acc);
      mma_smem_ab<DQ_MT, DQ_NT, BLOCK_N / 16, true>(acc, s_base + OFF_DST, PT_ROW, dq_row0, s_base + OFF_K, dq_col0,
                                                    lane);
      float* dq_rows = dq_accum + (((i64)b * heads_q + hq) * seqlen_q) * head_dim;
#pragma unroll
      for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = m0 + dq_row0 + mt * 16 + g + 8 * hr;
          if (row < seqlen_q) {
#pragma unroll
            for (int nt = 0; nt < DQ_NT; ++nt) {
              const int c = dq_col0 + nt * 8 + 2 * t;
              if (c < head_dim)
                atomic_add_dq_pair(dq_rows + (i64)row * head_dim + c, c, head_dim, acc[mt][nt][2 * hr] * scale,
                                   acc[mt][nt][2 * hr + 1] * scale);
            }
          }
        }
    }
#endif
  }

  // Stage through shared memory (over K and V, each warp its own block) for 16-byte stores.
  cp_async_wait<0>();
  block_sync();
#pragma unroll
  for (int mt = 0; mt < KV_MT; ++mt) {
    acc_to_smem<KV_NT>(smem + OFF_K, acc_dk[mt], kv_row0 + mt * 16, scale, lane, kv_col0);
    acc_to_smem<KV_NT>(smem + OFF_V, acc_dv[mt], kv_row0 + mt * 16, 1.f, lane, kv_col0);
  }
  block_sync();
  store_tile<BLOCK_N>(dk, dk_sn, smem + OFF_K, n0, seqlen_k, head_dim, tid);
  store_tile<BLOCK_N>(dv, dv_sn, smem + OFF_V, n0, seqlen_k, dim_v, tid);
}
