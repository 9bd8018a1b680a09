// The KV cache's append, before a decoding step attends: the step's new keys k_new (B, Hkv, Nq, D) and values v_new
// (B, Hkv, Nq, Dv), any strides with contiguous head dims, written into the cache at positions seqlens[b] + i of
// each sequence b: a contiguous cache (B, Hkv, capacity, D), or a paged pool (num_blocks, Hkv, block_size, D) read
// through the block table (B, max_blocks) int32 (block_size > 0). The key counts after the append, seqlens[b] + Nq,
// go to seqlens_after (B,) int32. A row past the cache's capacity, or whose table entry lies outside the pool, is
// not written (the front end checks both before it launches: a bad index never writes out of bounds).
// One warp per (b, h, i) row; a lane copies the columns lane, lane + 32, ... of K and of V.
#include "ptx.cuh"

#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32)
    mhattn_kv_append(const elem_t* __restrict__ k_new, const elem_t* __restrict__ v_new, elem_t* __restrict__ k_cache,
                     elem_t* __restrict__ v_cache, const int* __restrict__ seqlens, int* __restrict__ seqlens_after,
                     const int* __restrict__ table, i64 kn_sb, i64 kn_sh, i64 kn_sn, i64 vn_sb, i64 vn_sh, i64 vn_sn,
                     i64 kc_sb, i64 kc_sh, i64 kc_sn, i64 vc_sb, i64 vc_sh, i64 vc_sn, i64 seqlens_stride,
                     i64 table_sb, i64 table_sn, int heads_kv, int seqlen_q, int head_dim, int head_dim_v,
                     int capacity, int block_size, int num_blocks, i64 rows) {
  const int lane = threadIdx.x & 31;
  const i64 row = (i64)blockIdx.x * NUM_WARPS + (threadIdx.x >> 5);  // (b, h, i) of k_new's rows
  if (row >= rows) return;  // whole warps leave together
  const i64 bh = row / seqlen_q;
  const int i = (int)(row - bh * seqlen_q);
  const int b = (int)(bh / heads_kv), h = (int)(bh - (i64)b * heads_kv);
  const int before = seqlens[(i64)b * seqlens_stride];
  if (h == 0 && i == 0 && lane == 0) seqlens_after[b] = before + seqlen_q;
  const int position = before + i;
  if (position < 0 || position >= capacity) return;
  i64 k_row, v_row;  // the row's offsets in the cache
  if (block_size > 0) {
    const int entry = position / block_size;
    const int block = table[(i64)b * table_sb + (i64)entry * table_sn];
    if (block < 0 || block >= num_blocks) return;
    const i64 in_block = position - entry * block_size;
    k_row = (i64)block * kc_sb + (i64)h * kc_sh + in_block * kc_sn;
    v_row = (i64)block * vc_sb + (i64)h * vc_sh + in_block * vc_sn;
  } else {
    k_row = (i64)b * kc_sb + (i64)h * kc_sh + (i64)position * kc_sn;
    v_row = (i64)b * vc_sb + (i64)h * vc_sh + (i64)position * vc_sn;
  }
  const elem_t* k_src = k_new + (i64)b * kn_sb + (i64)h * kn_sh + (i64)i * kn_sn;
  const elem_t* v_src = v_new + (i64)b * vn_sb + (i64)h * vn_sh + (i64)i * vn_sn;
  for (int c = lane; c < head_dim; c += 32) k_cache[k_row + c] = k_src[c];
  for (int c = lane; c < head_dim_v; c += 32) v_cache[v_row + c] = v_src[c];
}
