// Per-sequence addressing for the packed (varlen) and KV-cache entry points, switched on at compile time:
//   VARLEN     1 = packed sequences: sequence b's queries are rows seq_q[b] .. seq_q[b + 1] - 1 of q (out, dO,
//              dQ), its keys rows seq_k[b] .. seq_k[b + 1] - 1 of k and v (dK, dV) (cu_seqlens prefix sums);
//              the batch strides are 0 and the seqlen_q / seqlen_k arguments are the longest sequence's (they
//              size the grid); a CTA past its sequence's end leaves at once. The forward's lse is (Hq, total_q)
//              with head stride `packed_stride`.
//   KV_CACHE   1 = a contiguous cache (B, Hkv, Nmax, D): sequence b attends over its first seq_k[b] keys with
//              its queries aligned bottom-right (diagonal offset seq_k[b] - Nq); 2 = a paged cache
//              (num_blocks, Hkv, block_size, D) whose key j of sequence b is row j % page_size of pool block
//              block_table[b * table_stride + j / page_size] (the batch strides of k and v are the pool's block
//              strides). Forward only.
//   KV_SPLIT   1 (with KV_CACHE) = decoding tiles that may split a sequence's keys: the grid is (query block + blocks
//              * split, head, batch) and split s of `splits` (a run-time argument) takes its share of the key
//              blocks; with splits > 1 each split writes its rows' output over its keys alone, normalised, in float32
//              to o_split (S, B, Hq, Nq, Dv) and their log-sum-exp to lse (S, B, Hq, Nq), which kv_combine.cu
//              merges; with splits == 1 the kernel writes out and lse itself.
// With both 0 (the default) the kernels take no sequence arguments and compile to the code they had before
// these flags existed.
#pragma once
#include "ptx.cuh"

#ifndef VARLEN
#define VARLEN 0
#endif
#ifndef KV_CACHE
#define KV_CACHE 0
#endif
#ifndef KV_SPLIT
#define KV_SPLIT 0
#endif
#define PER_SEQUENCE (VARLEN || KV_CACHE)

// The kernels' last parameters with a per-sequence flag on (none without).
#if PER_SEQUENCE
#define SEQUENCE_PARAMS                                                                                    \
  , const int* __restrict__ seq_q, const int* __restrict__ seq_k, const int* __restrict__ block_table, \
      i64 table_stride, int page_size, i64 packed_stride, float* __restrict__ o_split, int splits
#else
#define SEQUENCE_PARAMS
#endif

#if PER_SEQUENCE

// VARLEN: the backward's per-head lse_log2 / delta vectors hold sequence b's rows from vector_start(b): 16-byte
// aligned and VECTOR_GAP rows further per sequence, so that each sequence's rows padded to a multiple of
// VECTOR_PAD (the largest query tile; the padding carries lse_log2 = +inf) end before the next one's start.
// The host sizes the vectors with the same numbers (packed.py).
constexpr int VECTOR_PAD = 128;
constexpr int VECTOR_GAP = VECTOR_PAD + 4;

struct Sequence {
  int q_start, k_start;  // VARLEN: the sequence's first rows in the packed tensors; else 0
  int seqlen_q, seqlen_k;
  i64 vec_start;         // VARLEN: vector_start of the sequence; else 0
};

MHATTN_DEVICE i64 vector_start(int b, int q_start) { return (i64)((q_start + 3) & ~3) + (i64)b * VECTOR_GAP; }

// Sequence b's rows and lengths; seqlen_q / seqlen_k: the kernel's arguments (kept where the flag fixes none).
MHATTN_DEVICE Sequence sequence_of(int b, int seqlen_q, int seqlen_k, const int* seq_q, const int* seq_k) {
  Sequence s{0, 0, seqlen_q, seqlen_k, 0};
#if VARLEN
  s.q_start = seq_q[b];
  s.seqlen_q = seq_q[b + 1] - s.q_start;
  s.k_start = seq_k[b];
  s.seqlen_k = seq_k[b + 1] - s.k_start;
  s.vec_start = vector_start(b, s.q_start);
#elif KV_CACHE
  s.seqlen_k = seq_k[b];
#endif
  return s;
}

#if VARLEN
// Packed sequence b of the backward's main kernels: its lengths replace seqlen_q / seqlen_k, and Q, dO, K, V and the
// lse_log2 / delta vectors move to its first rows (each kernel moves its outputs itself). In, Vec: the pointers'
// types with their qualifiers.
template <class In, class Vec>
MHATTN_DEVICE Sequence packed_backward(int b, int& seqlen_q, int& seqlen_k, const int* seq_q, const int* seq_k, In& q,
                                       i64 q_sn, In& d_o, i64 do_sn, In& k, i64 k_sn, In& v, i64 v_sn, Vec& lse_log2,
                                       Vec& delta) {
  const Sequence seq = sequence_of(b, seqlen_q, seqlen_k, seq_q, seq_k);
  seqlen_q = seq.seqlen_q;
  seqlen_k = seq.seqlen_k;
  q += seq.q_start * q_sn;
  d_o += seq.q_start * do_sn;
  k += seq.k_start * k_sn;
  v += seq.k_start * v_sn;
  lse_log2 += seq.vec_start;  // the vectors' rows of this sequence start here in every head
  delta += seq.vec_start;
  return seq;
}
#endif

// KV_CACHE 2: the K or V rows of one (sequence, kv head) in the paged pool, for load_rows_async (common.cuh).
// Offsets count from block 0 of the pool at the kv head; only rows below the sequence's length are asked for,
// so only the block-table entries of its used blocks are read.
struct PagedRows {
  const elem_t* g;     // the pool at block 0, kv head hk
  i64 row_stride, block_stride;
  const int* table;    // the sequence's row of the block table
  int page_size;
  MHATTN_DEVICE const elem_t* base() const { return g; }
  MHATTN_DEVICE i64 offset(int r) const {
    return (i64)table[r / page_size] * block_stride + (i64)(r % page_size) * row_stride;
  }
  MHATTN_DEVICE bool in_chunks(int head_dim) const {
    return ((row_stride | block_stride | (i64)head_dim) & 7) == 0 && ((u64)g & 15) == 0;
  }
};

#if KV_SPLIT
// Split `split` of `splits`: its share of the key blocks of a sequence with seqlen_k keys, within `blocks` (a split
// may get none: lo == hi).
MHATTN_DEVICE KeyBlockRange split_share(KeyBlockRange blocks, int seqlen_k, int split, int splits) {
  const int per_split = ((seqlen_k + BLOCK_N - 1) / BLOCK_N + splits - 1) / splits;
  const int lo = max_of(blocks.lo, split * per_split);
  return KeyBlockRange{lo, max_of(lo, min_of(blocks.hi, (split + 1) * per_split))};
}

// A split's output rows [r0, r0 + 16) of one accumulator block (columns 8 nt + 2t, + 1 of each n8 tile; NT8 tiles),
// already normalised, to o_split (rows of `ncols` floats); rows >= nrows and columns >= ncols are skipped.
template <int NT8>
MHATTN_DEVICE void split_rows_out(float* o_split, const float (&acc)[NT8][4], int r0, int nrows, int ncols,
                                  int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = r0 + g + 8 * hr;
    if (row >= nrows) continue;
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + 2 * t + e;
        if (col < ncols) o_split[(i64)row * ncols + col] = acc[nt][2 * hr + e];
      }
  }
}
#endif  // KV_SPLIT
#endif  // PER_SEQUENCE
