// Backward preprocessing: per query row, delta = rowsum(dO * O) - grad_lse and the log-sum-exp in log2
// units, both written to padded float32 vectors (B, Hq, Nq_pad) that the dK/dV and dQ kernels read.
//
// Rows i >= Nq (the padding up to Nq_pad) and rows that saw no key (lse = -inf) get lse_log2 = +inf and
// delta = 0 (grad_lse is ignored there, as in the reference), so P = 2^(S - lse_log2) = 0 for them
// without any test in the main kernels. One warp per row; a lane handles 8 consecutive elements (ANY_DIMS:
// one element at a time, for rows that are not whole 16-byte chunks). head_dim is the value head dim.
// VARLEN (sequences.cuh): o, dO packed (total_q, Hq, Dv), lse and grad_lse (Hq, total_q) with head stride
// packed_stride; the grid is (row blocks of the longest sequence padded, head, sequence) and each sequence's rows
// go to its own stretch of the vectors (head stride seqlen_q_pad), padded to a multiple of VECTOR_PAD.
#include "ptx.cuh"
#include "sequences.cuh"

#ifndef NUM_WARPS
#define NUM_WARPS 8
#endif

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
    mhattn_bwd_preprocess(const elem_t* __restrict__ o, const elem_t* __restrict__ d_o, const float* __restrict__ lse,
                          const float* __restrict__ grad_lse, float* __restrict__ lse_log2, float* __restrict__ delta,
                          i64 o_sb, i64 o_sh, i64 o_sn, i64 do_sb, i64 do_sh, i64 do_sn,
                          int heads_q, int seqlen_q, int seqlen_q_pad, int head_dim, i64 total_rows SEQUENCE_PARAMS) {
  const int lane = threadIdx.x & 31;
#if VARLEN
  const int i = blockIdx.x * NUM_WARPS + (threadIdx.x >> 5), h = blockIdx.y, b = blockIdx.z;
  const Sequence seq = sequence_of(b, seqlen_q, 0, seq_q, seq_k);
  if (i >= (seq.seqlen_q + VECTOR_PAD - 1) / VECTOR_PAD * VECTOR_PAD) return;  // whole warps leave together
  seqlen_q = seq.seqlen_q;
  o += seq.q_start * o_sn;
  d_o += seq.q_start * do_sn;
  const i64 row = h * (i64)seqlen_q_pad + seq.vec_start + i;  // in the vectors
#else
  const i64 row = (i64)blockIdx.x * NUM_WARPS + (threadIdx.x >> 5);
  if (row >= total_rows) return;  // whole warps leave together
  const i64 bh = row / seqlen_q_pad;
  const int i = (int)(row - bh * seqlen_q_pad);
  const int b = (int)(bh / heads_q), h = (int)(bh - (i64)b * heads_q);
#endif

  float acc = 0.f;
#ifndef ANY_DIMS
#define ANY_DIMS 0
#endif
#if ANY_DIMS
  // any head dim and row alignment: one element a lane at a time
  if (i < seqlen_q) {
    const elem_t* o_row = o + b * o_sb + h * o_sh + (i64)i * o_sn;
    const elem_t* do_row = d_o + b * do_sb + h * do_sh + (i64)i * do_sn;
    for (int c = lane; c < head_dim; c += 32) acc += elem_to_float(o_row[c]) * elem_to_float(do_row[c]);
  }
#else
  if (i < seqlen_q && lane * 8 < head_dim) {
    const U128 ov = *reinterpret_cast<const U128*>(o + b * o_sb + h * o_sh + (i64)i * o_sn + lane * 8);
    const U128 dv = *reinterpret_cast<const U128*>(d_o + b * do_sb + h * do_sh + (i64)i * do_sn + lane * 8);
    const u32 ow[4] = {ov.x, ov.y, ov.z, ov.w};
    const u32 dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      acc += elem_to_float((elem_t)(ow[w] & 0xffffu)) * elem_to_float((elem_t)(dw[w] & 0xffffu));
      acc += elem_to_float((elem_t)(ow[w] >> 16)) * elem_to_float((elem_t)(dw[w] >> 16));
    }
  }
#endif
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) acc += shfl_xor(acc, m);

  if (lane == 0) {
#if VARLEN
    const i64 src = h * packed_stride + seq.q_start + i;  // lse and grad_lse are (Hq, total_q)
#else
    const i64 src = bh * seqlen_q + i;  // lse and grad_lse are (B, Hq, Nq) contiguous
#endif
    const float l = i < seqlen_q ? lse[src] : -MHATTN_INF;
    const bool seen = l != -MHATTN_INF;
    float d = seen ? acc : 0.f;
    if (seen && grad_lse != nullptr) d -= grad_lse[src];
    lse_log2[row] = seen ? l * 1.4426950408889634f : MHATTN_INF;
    delta[row] = d;
  }
}
