// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// One CTA computes BLOCK_M query rows of one (batch, head); each warp owns ROWS_PER_WARP of those rows
// (16 or 32: one or two m16 tiles), so the softmax statistics of a row never leave its warp. The CTA
// walks the key blocks its rows can see; K and V tiles are double-buffered in shared memory with
// cp.async (the next block is in flight while this one is multiplied). Per key block:
//   S = Q K^T            (A = Q from shared memory or registers, B = K via ldmatrix)
//   online softmax       (base-2 exponent: scores are pre-multiplied by scale * log2(e))
//   O = O * alpha + P V  (P converted to 16-bit in registers and fed back as the A operand; V via
//                         ldmatrix.trans)
// Out: O (B, Hq, Nq, Dv) with the caller's strides, lse (B, Hq, Nq) float32 natural log, -inf for a row
// that sees no key (whose output is 0). The parameters after drop_scale serve the feature flags (SOFTCAP,
// FLOAT_MASK, ANY_DIMS; common.cuh) and are unused without them (dmask: the dQ kernel's only); the sequence
// arguments serve VARLEN (packed sequences) and KV_CACHE (a contiguous or paged cache), see sequences.cuh.
#include "score_mask.cuh"
#include "sequences.cuh"
#include "warp_mma.cuh"

constexpr int ROWS_PER_WARP = BLOCK_M / NUM_WARPS;
constexpr int MT = ROWS_PER_WARP / 16;  // m16 tiles per warp
constexpr int NT_S = BLOCK_N / 8;       // n8 tiles across a score block
constexpr int NT_O = HEAD_DIM / 8;      // n8 tiles across an output row block
constexpr u32 Q_TILE_BYTES = BLOCK_M * SMEM_ROW * 2;
constexpr u32 KV_TILE_BYTES = BLOCK_N * SMEM_ROW * 2;
constexpr float LN2 = 0.6931471805599453f;
static_assert(ROWS_PER_WARP * NUM_WARPS == BLOCK_M && (MT == 1 || MT == 2), "each warp owns 16 or 32 query rows");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
#ifndef Q_IN_REGS
#define Q_IN_REGS 0
#endif

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
    mhattn_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
               elem_t* __restrict__ o, float* __restrict__ lse,
               i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
               i64 o_sb, i64 o_sh, i64 o_sn,
               int seqlen_q, int seqlen_k, int heads_q, int group, int head_dim, int sched_pairs, float scale_log2,
               int diag_offset, int window_left, int window_right,
               const unsigned char* __restrict__ mask, i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk,
               const u32* __restrict__ seed_words, u32 drop_threshold, float drop_scale,
               int head_dim_v, float softcap_in2, float softcap_out2, const float* __restrict__ float_mask,
               i64 fm_sb, i64 fm_sh, i64 fm_sq, i64 fm_sk, float* __restrict__ dmask SEQUENCE_PARAMS) {
  MHATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
#if KV_SPLIT
  // Decoding (sequences.cuh): grid (query block + blocks * split, head, batch).
  const int n_mblocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const int m_block = blockIdx.x % n_mblocks, split = blockIdx.x / n_mblocks;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
#elif HAS_BOUNDS
  // Query blocks differ in cost (a causal mask or a window): grid x walks the query blocks of groups of
  // `sched_pairs` (batch, head) pairs, group by group; within a group the query block is the slowest index
  // and runs backwards. Under a causal mask the last query blocks see the most keys, so every group starts
  // with its heaviest blocks (longest tasks first: a group's tail, and the grid's, holds short ones), while
  // a group is small enough that its pairs' K and V stay in L2 as its CTAs run side by side (ops.py sizes it).
  const int n_mblocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const int bh_total = (int)(gridDim.x / (unsigned)n_mblocks);
  const unsigned group_ctas = (unsigned)n_mblocks * (unsigned)sched_pairs;
  const int sched_group = (int)(blockIdx.x / group_ctas);
  const int first_pair = sched_group * sched_pairs;
  const int pairs = min_of(sched_pairs, bh_total - first_pair);  // the last group may hold fewer
  const int within = (int)(blockIdx.x - (unsigned)sched_group * group_ctas);
  const int m_block = n_mblocks - 1 - within / pairs;
  const int bh = first_pair + within % pairs;
  const int h = bh % heads_q, b = bh / heads_q, hk = h / group;
#else
  // Every query block costs the same: grid (query block, head, batch), so the CTAs running side by side are
  // consecutive query blocks of a few (batch, head) pairs and share their K and V in L2.
  const int m_block = blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
#endif
  const int m0 = m_block * BLOCK_M;
#if PER_SEQUENCE
  const Sequence seq = sequence_of(b, seqlen_q, seqlen_k, seq_q, seq_k);
  if (m0 >= seq.seqlen_q) return;  // VARLEN: past this sequence's last query (the grid is sized by the longest)
  seqlen_q = seq.seqlen_q;
  seqlen_k = seq.seqlen_k;
#if KV_CACHE
  diag_offset = seqlen_k - seqlen_q;  // a sequence's queries are its last seqlen_q positions
#endif
#endif
  const int warp_row0 = warp * ROWS_PER_WARP;
  const int dim_v = ANY_DIMS ? head_dim_v : head_dim;  // columns of V and O
  const Softcap softcap{softcap_in2, softcap_out2};

  q += b * q_sb + h * q_sh;
#if KV_CACHE == 2
  const PagedRows k_rows{k + hk * k_sh, k_sn, k_sb, block_table + b * table_stride, page_size};
  const PagedRows v_rows{v + hk * v_sh, v_sn, v_sb, block_table + b * table_stride, page_size};
#else
  k += b * k_sb + hk * k_sh;
  v += b * v_sb + hk * v_sh;
#endif
  o += b * o_sb + h * o_sh;
#if VARLEN
  q += seq.q_start * q_sn;
  k += seq.k_start * k_sn;
  v += seq.k_start * v_sn;
  o += seq.q_start * o_sn;
  lse += h * packed_stride + seq.q_start;
#elif KV_SPLIT
  // with splits > 1, this split's rows of lse (S, B, Hq, Nq) and o_split (S, B, Hq, Nq, Dv)
  lse += (((i64)split * gridDim.z + b) * heads_q + h) * seqlen_q;
  o_split += (((i64)split * gridDim.z + b) * heads_q + h) * seqlen_q * dim_v;
#else
  lse += ((i64)b * heads_q + h) * seqlen_q;
#endif
#if KV_CACHE != 2
  const StridedRows k_rows{k, k_sn}, v_rows{v, v_sn};
#endif

  const u32 s_q = smem_u32(smem);
  const u32 s_k = s_q + Q_TILE_BYTES;       // stage s at s_k + s * KV_TILE_BYTES
  const u32 s_v = s_k + 2 * KV_TILE_BYTES;  // stage s at s_v + s * KV_TILE_BYTES

  // Key blocks this query block can see, and what hides a score.
  const int m_last = min_of(m0 + BLOCK_M, seqlen_q) - 1;
#if KV_SPLIT
  const KeyBlockRange blocks =
      split_share(key_block_range(m0, m_last, seqlen_k, diag_offset, window_left, window_right), seqlen_k, split,
                  splits);
#else
  const KeyBlockRange blocks = key_block_range(m0, m_last, seqlen_k, diag_offset, window_left, window_right);
#endif
  const int nb_lo = blocks.lo, nb_hi = blocks.hi;
  const ScoreMask smask = score_mask(b, h, seqlen_q, seqlen_k, diag_offset, window_left, window_right, mask, m_sb,
                                     m_sh, m_sq, m_sk, float_mask, fm_sb, fm_sh, fm_sq, fm_sk);

#if HAS_EXTRAS
  const bool use_dropout = drop_threshold != 0u;
  DropoutRng rng;
  rng.init((u32)(b * heads_q + h), seed_words, drop_threshold);
  u32 row_key[MT][2];
  rng.row_keys(row_key, m0 + warp_row0, g);
#endif

  load_tile_async<BLOCK_M>(s_q, q, q_sn, m0, seqlen_q, head_dim, tid);
  if (nb_lo < nb_hi) {
    load_rows_async<BLOCK_N>(s_k, k_rows, nb_lo * BLOCK_N, seqlen_k, head_dim, tid);
    load_rows_async<BLOCK_N>(s_v, v_rows, nb_lo * BLOCK_N, seqlen_k, dim_v, tid);
  }
  cp_async_commit();

  float acc_o[MT][NT_O][4];
  float row_max[MT][2], row_sum[MT][2];  // row_max in log2 units (scores times scale * log2 e)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    zero_acc(acc_o[mt]);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      row_max[mt][hr] = -MHATTN_INF;
      row_sum[mt][hr] = 0.f;
    }
  }
#if Q_IN_REGS
  u32 q_frag[MT][KD][4];
#else
  u32 (*q_frag)[KD][4] = nullptr;  // unused: Q fragments come from shared memory
#endif

  for (int nb = nb_lo; nb < nb_hi; ++nb) {
    const int stage = (nb - nb_lo) & 1;
    const u32 s_k_cur = s_k + stage * KV_TILE_BYTES, s_v_cur = s_v + stage * KV_TILE_BYTES;
    cp_async_wait<0>();
    block_sync();  // this block's K, V (and Q) have landed; everyone is done with the other stage
    if (nb + 1 < nb_hi) {
      const u32 nxt = (stage ^ 1) * KV_TILE_BYTES;
      load_rows_async<BLOCK_N>(s_k + nxt, k_rows, (nb + 1) * BLOCK_N, seqlen_k, head_dim, tid);
      load_rows_async<BLOCK_N>(s_v + nxt, v_rows, (nb + 1) * BLOCK_N, seqlen_k, dim_v, tid);
    }
    cp_async_commit();
#if Q_IN_REGS
    if (nb == nb_lo) load_a_frags(q_frag, s_q, warp_row0, lane);
#endif

    // S = Q K^T
    float s[MT][NT_S][4];
    mma_abt<MT, NT_S, Q_IN_REGS != 0>(s, q_frag, s_q, warp_row0, s_k_cur, 0, lane);

    // Scale to log2 units, then hide what the row cannot see (only blocks that cut the visible region).
    const int n0 = nb * BLOCK_N;
    const bool need_mask = smask.block_needs_mask(n0 + BLOCK_N > seqlen_k, m0, m_last, n0, n0 + BLOCK_N - 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float th;
          s[mt][nt][e] = log2_score(s[mt][nt][e], scale_log2, softcap, th);
        }
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = m0 + warp_row0 + mt * 16 + g + 8 * hr;
          const int first = n0 + 2 * t;  // this lane's first key column
          const VisibleColumns keys = smask.keys_of_query(i, first);
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int jj = nt * 8 + e;
              s[mt][nt][2 * hr + e] = smask.apply(s[mt][nt][2 * hr + e], keys.contains(jj), i, first + jj);
            }
        }
    }

    // Online softmax: new running max, rescale what was accumulated, P = 2^(S - max).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float mx = row_max[mt][hr];
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
        mx = fmaxf(mx, shfl_xor(mx, 1));  // the 4 lanes of a quad share a row
        mx = fmaxf(mx, shfl_xor(mx, 2));
        // A row that has seen no key yet keeps max = -inf; shift by 0 so 2^(-inf - shift) = 0, not NaN.
        const float shift = mx == -MHATTN_INF ? 0.f : mx;
        const float alpha = fast_exp2(row_max[mt][hr] - shift);
        row_max[mt][hr] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = fast_exp2(s[mt][nt][2 * hr + e] - shift);
            s[mt][nt][2 * hr + e] = p;
            sum += p;
          }
        row_sum[mt][hr] = row_sum[mt][hr] * alpha + sum;  // per-lane partial sums, reduced at the end
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
          acc_o[mt][nt][2 * hr] *= alpha;
          acc_o[mt][nt][2 * hr + 1] *= alpha;
        }
      }

#if HAS_EXTRAS
    // Dropout acts on P after the normaliser has counted it; the 1 / (1 - p) factor is applied at the end.
    if (use_dropout) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = n0 + nt * 8 + 2 * t + (e & 1);
            if (!rng.keep(row_key[mt][e >> 1], j)) s[mt][nt][e] = 0.f;
          }
    }
#endif

    // O += P V, P straight from the score registers.
    mma_regs_ab(acc_o, s, s_v_cur, lane);
  }

  // Normalise, write lse, stage O through shared memory (over Q, each warp its own rows) for 16-byte stores.
  cp_async_wait<0>();
  block_sync();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float sum = row_sum[mt][hr];
      sum += shfl_xor(sum, 1);
      sum += shfl_xor(sum, 2);
      inv[hr] = sum > 0.f ? drop_scale / sum : 0.f;
      const int i = m0 + warp_row0 + mt * 16 + g + 8 * hr;
      if (t == 0 && i < seqlen_q) lse[i] = sum > 0.f ? (row_max[mt][hr] + fast_log2(sum)) * LN2 : -MHATTN_INF;
    }
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) {
      acc_o[mt][nt][0] *= inv[0];
      acc_o[mt][nt][1] *= inv[0];
      acc_o[mt][nt][2] *= inv[1];
      acc_o[mt][nt][3] *= inv[1];
    }
#if KV_SPLIT
    if (splits > 1) {  // float32 rows for kv_combine.cu
      split_rows_out<NT_O>(o_split, acc_o[mt], m0 + warp_row0 + mt * 16, seqlen_q, dim_v, lane);
      continue;
    }
#endif
    acc_to_smem<NT_O>(smem, acc_o[mt], warp_row0 + mt * 16, 1.f, lane);
  }
#if KV_SPLIT
  if (splits > 1) return;
#endif
  block_sync();
  store_tile<BLOCK_M>(o, o_sn, smem, m0, seqlen_q, dim_v, tid);
}
