// Split-KV decoding, second step: the forward with KV_SPLIT (fwd.cu, sequences.cuh) left, for each split s of a
// sequence's keys, every query row's output over those keys alone (float32, normalised, o_split (S, B, Hq, Nq, Dv))
// and its log-sum-exp (lse_split (S, B, Hq, Nq), -inf for a split without a visible key). This kernel merges
// them: lse = log sum_s e^lse_s, out = sum_s e^(lse_s - lse) o_s, written to out (B, Hq, Nq, Dv) with the caller's
// strides and to lse (B, Hq, Nq). A row that sees no key in any split gets out 0 and lse -inf.
// One warp per row; a lane handles the columns lane, lane + 32, ...
#include "ptx.cuh"

#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
    mhattn_kv_combine(const float* __restrict__ o_split, const float* __restrict__ lse_split, elem_t* __restrict__ o,
                      float* __restrict__ lse, i64 o_sb, i64 o_sh, i64 o_sn, int heads_q, int seqlen_q, int head_dim_v,
                      int splits, i64 rows) {
  const int lane = threadIdx.x & 31;
  const i64 row = (i64)blockIdx.x * NUM_WARPS + (threadIdx.x >> 5);  // (b, h, i) of lse's layout
  if (row >= rows) return;  // whole warps leave together
  const i64 bh = row / seqlen_q;
  const int i = (int)(row - bh * seqlen_q);
  const int b = (int)(bh / heads_q), h = (int)(bh - (i64)b * heads_q);

  float m = -MHATTN_INF;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, lse_split[s * rows + row]);
  float total = 0.f;
  for (int s = 0; s < splits; ++s) total += m == -MHATTN_INF ? 0.f : fast_exp2((lse_split[s * rows + row] - m) * LOG2E);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  elem_t* out_row = o + b * o_sb + h * o_sh + (i64)i * o_sn;
  for (int c = lane; c < head_dim_v; c += 32) {
    float acc = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float l = lse_split[s * rows + row];
      if (l != -MHATTN_INF) acc += fast_exp2((l - m) * LOG2E) * o_split[(s * rows + row) * head_dim_v + c];
    }
    out_row[c] = (elem_t)(pack2(acc * inv, 0.f) & 0xffffu);
  }
  if (lane == 0) lse[row] = total > 0.f ? m + fast_log2(total) * LN2 : -MHATTN_INF;
}
