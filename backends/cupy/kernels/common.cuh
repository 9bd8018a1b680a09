// Building blocks shared by the attention kernels: compile-time configuration, shared-memory tiles,
// tensor-core fragment loads, the visibility rule (causal / window / boolean mask) and the dropout RNG.
//
// Every kernel is specialised by -D options (see mhattn/backends/cupy/variants.py):
//   MHATTN_BF16   1 = bfloat16, 0 = float16
//   HEAD_DIM      head dim bucket (multiple of 32); the real head dim (a multiple of 8) is a run-time
//                 argument and the columns beyond it are zero-filled in shared memory
//   BLOCK_M       query rows per tile, BLOCK_N key rows per tile, NUM_WARPS warps per CTA
//   HAS_BOUNDS    causal diagonal and/or sliding window (bounds are run-time arguments)
//   HAS_EXTRAS    boolean mask and dropout (each switched on at run time by a non-null mask / a non-zero
//                 dropout threshold)
// Feature flags (0 when absent; the kernels without them compile to the same code as before they existed):
//   SOFTCAP       scores become softcap * tanh(scores / softcap); the backward multiplies dS by 1 - tanh^2
//   FLOAT_MASK    an additive float32 mask broadcast over (B, H, Nq, Nk) by strides; the dQ kernel also
//                 writes dS (the mask's gradient) when given a dmask buffer
//   ANY_DIMS      the value head dim is its own run-time argument, and rows that are not whole 16-byte
//                 chunks (head dims that are not multiples of 8) are loaded and stored element by element,
//                 bounds-checked, with the padded columns zero-filled
#pragma once
#include "ptx.cuh"

#ifndef HEAD_DIM
#error "define HEAD_DIM"
#endif
#ifndef HAS_BOUNDS
#define HAS_BOUNDS 0
#endif
#ifndef HAS_EXTRAS
#define HAS_EXTRAS 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef SOFTCAP
#define SOFTCAP 0
#endif
#ifndef FLOAT_MASK
#define FLOAT_MASK 0
#endif
#ifndef ANY_DIMS
#define ANY_DIMS 0
#endif

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 32, at most 256");

constexpr int NUM_THREADS = NUM_WARPS * 32;
// Shared-memory tiles are row-major with HEAD_DIM + 8 elements per row: the 16-byte pad shifts each row
// by 4 banks, so the 8 row addresses of an ldmatrix (and the 16-byte cp.async stores) hit distinct banks.
constexpr int SMEM_ROW = HEAD_DIM + 8;
constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;  // 16-byte chunks per tile row

template <class T>
MHATTN_DEVICE T min_of(T a, T b) { return a < b ? a : b; }
template <class T>
MHATTN_DEVICE T max_of(T a, T b) { return a > b ? a : b; }

// ---- global -> shared tiles ------------------------------------------------------------------------

// Whether the rows of a tile can move in 16-byte chunks: aligned start, row stride and head dim in whole chunks.
MHATTN_DEVICE bool rows_in_chunks(const elem_t* g, i64 row_stride, int head_dim) {
  return ((row_stride | (i64)head_dim) & 7) == 0 && ((u64)g & 15) == 0;
}

// The rows of a row-major global matrix, `stride` elements apart (last dim contiguous). The tile loads take any
// type with these members (the first row's address, a row's offset from it in elements, whether rows move in
// 16-byte chunks): the paged KV cache's rows (sequences.cuh) are another.
struct StridedRows {
  const elem_t* g;
  i64 stride;
  MHATTN_DEVICE const elem_t* base() const { return g; }
  MHATTN_DEVICE i64 offset(int r) const { return (i64)r * stride; }
  MHATTN_DEVICE bool in_chunks(int head_dim) const { return rows_in_chunks(g, stride, head_dim); }
};

// ANY_DIMS: rows [row0, row0 + ROWS) x columns [0, HEAD_DIM) copied at once (plain loads, each element
// bounds-checked, zeros beyond nrows / head_dim) for rows that are not whole 16-byte chunks. The callers'
// barriers order these stores as they order the cp.async copies.
template <int ROWS, class Rows>
MHATTN_DEVICE void load_rows_checked(u32 s_tile, const Rows& rows, int row0, int nrows, int head_dim, int tid) {
  constexpr int TOTAL = ROWS * CHUNKS_PER_ROW;
  for (int c = tid; c < TOTAL; c += NUM_THREADS) {
    const int r = c / CHUNKS_PER_ROW;
    const int col = (c % CHUNKS_PER_ROW) * 8;
    const int grow = row0 + r;
    u32 w[4] = {0u, 0u, 0u, 0u};
    if (grow < nrows) {
      const elem_t* src = rows.base() + rows.offset(grow) + col;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (col + e < head_dim) w[e >> 1] |= (u32)src[e] << (16 * (e & 1));
    }
    st_shared_v4(s_tile + (u32)((r * SMEM_ROW + col) * 2), w);
  }
}

// Starts the copy of rows [row0, row0 + ROWS) x columns [0, HEAD_DIM) of `rows` into a shared tile. Rows >= nrows
// and columns >= head_dim are filled with zeros, so padded head-dim columns add nothing to any dot product.
template <int ROWS, class Rows>
MHATTN_DEVICE void load_rows_async(u32 s_tile, const Rows& rows, int row0, int nrows, int head_dim, int tid) {
#if ANY_DIMS
  if (!rows.in_chunks(head_dim)) {
    load_rows_checked<ROWS>(s_tile, rows, row0, nrows, head_dim, tid);
    return;
  }
#endif
  constexpr int TOTAL = ROWS * CHUNKS_PER_ROW;
#pragma unroll
  for (int c0 = 0; c0 < TOTAL; c0 += NUM_THREADS) {
    const int c = c0 + tid;
    if (TOTAL % NUM_THREADS == 0 || c < TOTAL) {
      const int r = c / CHUNKS_PER_ROW;
      const int col = (c % CHUNKS_PER_ROW) * 8;
      const int grow = row0 + r;
      const bool ok = grow < nrows && col < head_dim;
      const elem_t* src = ok ? rows.base() + rows.offset(grow) + col : rows.base();
      cp_async_16(s_tile + (u32)((r * SMEM_ROW + col) * 2), src, ok ? 16u : 0u);
    }
  }
}

// load_rows_async of a row-major global matrix (row stride in elements, last dim contiguous).
template <int ROWS>
MHATTN_DEVICE void load_tile_async(u32 s_tile, const elem_t* g, i64 row_stride, int row0, int nrows, int head_dim,
                                   int tid) {
  load_rows_async<ROWS>(s_tile, StridedRows{g, row_stride}, row0, nrows, head_dim, tid);
}

// Starts the copy of COUNT floats (COUNT a multiple of 4) of a float vector into shared memory. The
// vectors copied this way (per-row log-sum-exp and delta of the backward pass) are allocated padded so
// every copied chunk is in range and 16-byte aligned.
template <int COUNT>
MHATTN_DEVICE void load_vec_async(u32 s_vec, const float* g, int tid) {
  static_assert(COUNT % 4 == 0, "vector tiles are copied in 16-byte chunks");
  for (int c = tid; c < COUNT / 4; c += NUM_THREADS) cp_async_16(s_vec + (u32)(c * 16), g + c * 4, 16u);
}

// ANY_DIMS: the store of store_tile element by element, for rows that are not whole 16-byte chunks.
template <int ROWS>
MHATTN_DEVICE void store_tile_checked(elem_t* g, i64 row_stride, const unsigned char* s_tile, int row0, int nrows,
                                      int head_dim, int tid) {
  const int cols = min_of(head_dim, HEAD_DIM);
  for (int c = tid; c < ROWS * HEAD_DIM; c += NUM_THREADS) {
    const int r = c / HEAD_DIM, col = c % HEAD_DIM;
    if (row0 + r < nrows && col < cols)
      g[(i64)(row0 + r) * row_stride + col] = *reinterpret_cast<const elem_t*>(s_tile + (r * SMEM_ROW + col) * 2);
  }
}

// Writes a row-major shared tile of `ROWS` rows (elements) to global memory with 16-byte stores, skipping
// rows >= nrows and columns >= head_dim.
template <int ROWS>
MHATTN_DEVICE void store_tile(elem_t* g, i64 row_stride, const unsigned char* s_tile, int row0, int nrows,
                              int head_dim, int tid) {
#if ANY_DIMS
  if (!rows_in_chunks(g, row_stride, head_dim)) {
    store_tile_checked<ROWS>(g, row_stride, s_tile, row0, nrows, head_dim, tid);
    return;
  }
#endif
  constexpr int TOTAL = ROWS * CHUNKS_PER_ROW;
#pragma unroll
  for (int c0 = 0; c0 < TOTAL; c0 += NUM_THREADS) {
    const int c = c0 + tid;
    if (TOTAL % NUM_THREADS == 0 || c < TOTAL) {
      const int r = c / CHUNKS_PER_ROW;
      const int col = (c % CHUNKS_PER_ROW) * 8;
      const int grow = row0 + r;
      if (grow < nrows && col < head_dim) {
        *reinterpret_cast<U128*>(g + (i64)grow * row_stride + col) =
            *reinterpret_cast<const U128*>(s_tile + (r * SMEM_ROW + col) * 2);
      }
    }
  }
}

// ---- tensor-core fragments from shared tiles (all tiles row-major, SMEM_ROW elements per row) ------
//
// mma.m16n8k16 operand layouts, lane = 4 * g + t:
//   A (16x16): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16x8):  b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C (16x8):  c0, c1 = C[g][2t], C[g][2t+1]; c2, c3 = C[g+8][2t], C[g+8][2t+1]

// A fragment: rows r0..r0+15, columns k0..k0+15 of a tile stored [row][k] with `row_elems` elements per row.
MHATTN_DEVICE void load_a_frag_rows(u32 (&a)[4], u32 s_tile, int row_elems, int r0, int k0, int lane) {
  const int row = r0 + (lane & 15);
  const int col = k0 + ((lane >> 4) << 3);
  ldsm_x4(a, s_tile + (u32)((row * row_elems + col) * 2));
}

// The same from a head-dim tile (SMEM_ROW elements per row).
MHATTN_DEVICE void load_a_frag(u32 (&a)[4], u32 s_tile, int r0, int k0, int lane) {
  load_a_frag_rows(a, s_tile, SMEM_ROW, r0, k0, lane);
}

// A fragment of rows m0..m0+15, columns k0..k0+15 of A from a tile that stores A transposed, [k][m]
// with `row_elems` elements per row (e.g. dS from a [key][query] tile), read transposed by ldmatrix.
MHATTN_DEVICE void load_a_frag_trans(u32 (&a)[4], u32 s_tile, int row_elems, int m0, int k0, int lane) {
  const int row = k0 + (lane & 7) + ((lane >> 4) << 3);
  const int col = m0 + (((lane >> 3) & 1) << 3);
  ldsm_x4_trans(a, s_tile + (u32)((row * row_elems + col) * 2));
}

// B fragments of two n8 tiles from a tile stored [n][k] (the B operand transposed, e.g. K for Q K^T):
// n rows n0..n0+15, k columns k0..k0+15. b[0], b[1] serve n0..n0+7; b[2], b[3] serve n0+8..n0+15.
MHATTN_DEVICE void load_b_frag_nk(u32 (&b)[4], u32 s_tile, int n0, int k0, int lane) {
  const int row = n0 + (lane & 7) + ((lane >> 4) << 3);
  const int col = k0 + (((lane >> 3) & 1) << 3);
  ldsm_x4(b, s_tile + (u32)((row * SMEM_ROW + col) * 2));
}

// B fragments of two n8 tiles from a tile stored [k][n] (e.g. V for P V): k rows k0..k0+15, n columns
// n0..n0+15, read transposed by ldmatrix. b[0], b[1] serve n0..n0+7; b[2], b[3] serve n0+8..n0+15.
MHATTN_DEVICE void load_b_frag_kn(u32 (&b)[4], u32 s_tile, int k0, int n0, int lane) {
  const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
  const int col = n0 + ((lane >> 4) << 3);
  ldsm_x4_trans(b, s_tile + (u32)((row * SMEM_ROW + col) * 2));
}

// The A fragment for k columns 16kk..16kk+15 from two accumulator n8 tiles (2kk, 2kk+1) of a 16-row
// result: the register-level reuse that feeds P (or dS) straight into the next matrix product.
MHATTN_DEVICE void acc_to_a_frag(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2(lo[0], lo[1]);
  a[1] = pack2(lo[2], lo[3]);
  a[2] = pack2(hi[0], hi[1]);
  a[3] = pack2(hi[2], hi[3]);
}

// Stores a 16-row accumulator block (NT8 n8 tiles) as elements into a shared tile at row r0, column c0.
template <int NT8>
MHATTN_DEVICE void acc_to_smem(unsigned char* s_tile, const float (&acc)[NT8][4], int r0, float scale, int lane,
                               int c0 = 0) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    const int col = c0 + nt * 8 + 2 * t;
    *reinterpret_cast<u32*>(s_tile + ((r0 + g) * SMEM_ROW + col) * 2) = pack2(acc[nt][0] * scale, acc[nt][1] * scale);
    *reinterpret_cast<u32*>(s_tile + ((r0 + g + 8) * SMEM_ROW + col) * 2) = pack2(acc[nt][2] * scale, acc[nt][3] * scale);
  }
}

// ---- which keys a query sees ----------------------------------------------------------------------

// The causal / sliding-window rule: key j is visible to query i iff -left <= j - i - diag_offset <= right.
// Unbounded sides arrive as a large bound (2^30). Kernels turn it into per-row ranges of visible keys (or
// per-key ranges of queries); this struct answers the per-block question that decides whether a block
// needs masking at all.
struct Bounds {
  int diag_offset, left, right;
  // Every (i, j) in [i0, i1] x [j0, j1] inside the band?
  MHATTN_DEVICE bool block_inside(int i0, int i1, int j0, int j1) const {
    return (i64)j0 - i1 - diag_offset >= -(i64)left && (i64)j1 - i0 - diag_offset <= (i64)right;
  }
  // The blocks of BLOCK keys that rows [i0, i1] see whole (inside the band, every key below seqlen_k): block index
  // range [lo, hi), hi <= lo where there is none. block_inside turned into a range once per row block, so a loop
  // over key blocks tests two integers a block.
  template <int BLOCK>
  MHATTN_DEVICE void whole_blocks(int i0, int i1, int seqlen_k, int& lo, int& hi) const {
    const i64 first_key = (i64)i1 + diag_offset - left;   // every key from here on is right of the band's left edge
    const i64 end_key = (i64)i0 + diag_offset + right + 1;  // ... and below here left of its right edge
    lo = first_key <= 0 ? 0 : (int)min_of<i64>((first_key + BLOCK - 1) / BLOCK, 1 << 30);
    hi = end_key <= 0 ? 0 : (int)min_of<i64>(min_of<i64>(end_key, seqlen_k) / BLOCK, 1 << 30);
  }
  // The blocks of BLOCK rows that see keys [j0, j1] whole (the mirror of whole_blocks, for a loop over row blocks):
  // block index range [lo, hi).
  template <int BLOCK>
  MHATTN_DEVICE void whole_row_blocks(int j0, int j1, int& lo, int& hi) const {
    const i64 first_row = (i64)j1 - diag_offset - right;                // rows from here on see key j1
    const i64 last_row = (i64)j0 - diag_offset + left - (BLOCK - 1);    // block starts up to here see key j0 whole
    lo = first_row <= 0 ? 0 : (int)min_of<i64>((first_row + BLOCK - 1) / BLOCK, 1 << 30);
    hi = last_row < 0 ? 0 : (int)min_of<i64>(last_row / BLOCK + 1, 1 << 30);
  }
};

// A boolean attn_mask (True = attend) broadcast to (B, H, Nq, Nk) with arbitrary strides (0 allowed).
struct BoolMask {
  const unsigned char* ptr;  // at (b, h) already; nullptr = no mask
  i64 stride_q, stride_k;
  MHATTN_DEVICE bool allows(int i, int j) const { return ptr[(i64)i * stride_q + (i64)j * stride_k] != 0; }
};

// ---- dropout: the counter-based RNG of mhattn/dropout_rng.py, bit for bit --------------------------

MHATTN_DEVICE u32 fmix32(u32 x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

struct DropoutRng {
  u32 bh_key, seed1, threshold;
  // bh = b * Hq + h (query head)
  MHATTN_DEVICE void init(u32 bh, u32 seed0, u32 seed1_, u32 threshold_) {
    bh_key = fmix32(bh * 0x9E3779B9u + seed0);
    seed1 = seed1_;
    threshold = threshold_;
  }
  // The seed as the host passes it: the int64 seed tensor (2,) on the device read as u32 words (little
  // endian: seed0 = word 0, seed1 = word 2), so a captured CUDA graph reads fresh words at each replay.
  // Read only with dropout (threshold != 0); the pointer may be null otherwise.
  MHATTN_DEVICE void init(u32 bh, const u32* __restrict__ seed_words, u32 threshold_) {
    init(bh, threshold_ ? seed_words[0] : 0u, threshold_ ? seed_words[2] : 0u, threshold_);
  }
  MHATTN_DEVICE u32 row_key(int i) const { return fmix32(bh_key ^ ((u32)i * 0x85EBCA6Bu + seed1)); }
  MHATTN_DEVICE bool keep(u32 row_key_i, int j) const { return fmix32(row_key_i ^ ((u32)j * 0xC2B2AE35u)) >= threshold; }
  // Whether the element (query i, key j) is kept.
  MHATTN_DEVICE bool keep_pair(int i, int j) const { return keep(row_key(i), j); }
  // The row keys of a lane's accumulator rows row0 + 16 mt + g and row0 + 16 mt + g + 8 (MT m16 tiles).
  template <int MT>
  MHATTN_DEVICE void row_keys(u32 (&keys)[MT][2], int row0, int g) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) keys[mt][hr] = row_key(row0 + mt * 16 + g + 8 * hr);
  }
};

// A kept element scaled by 1 / (1 - p) (drop_scale), a dropped one 0.
MHATTN_DEVICE float dropped(float x, bool keep, float drop_scale) { return keep ? x * drop_scale : 0.f; }

// ---- feature variants: softcap, float mask and its gradient, any head dims ------------------------

// The softcap of a score: softcap * tanh(s * scale / softcap) in log2 units, from the raw dot product s,
// with tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1) (exactly +-1 when the power over- or underflows).
struct Softcap {
  float in2;   // 2 log2(e) scale / softcap
  float out2;  // softcap * log2(e)
};

// Raw dot product -> score in log2 units; `th` receives tanh(s * scale / softcap) under SOFTCAP (for the
// backward's factor 1 - tanh^2) and is left alone otherwise.
MHATTN_DEVICE float log2_score(float s, float scale_log2, const Softcap& softcap, float& th) {
#if SOFTCAP
  th = 1.f - 2.f * fast_rcp(fast_exp2(s * softcap.in2) + 1.f);
  return th * softcap.out2;
#else
  return s * scale_log2;
#endif
}

// d(softcap * tanh(x / softcap)) / dx for the tanh `th` of log2_score.
MHATTN_DEVICE float softcap_grad(float th) { return 1.f - th * th; }

// An additive float32 attn_mask broadcast to (B, H, Nq, Nk) with arbitrary strides (0 allowed).
struct FloatMask {
  const float* ptr;  // at (b, h) already
  i64 stride_q, stride_k;
  // The score x (log2 units) of query i, key j: -inf where hidden (ok false, or outside the sequences),
  // else x + mask(i, j) log2 e.
  MHATTN_DEVICE float apply(float x, bool ok, int i, int j, int seqlen_q, int seqlen_k) const {
    if (!ok || i >= seqlen_q || j >= seqlen_k) return -MHATTN_INF;
    return x + ptr[(i64)i * stride_q + (i64)j * stride_k] * 1.4426950408889634f;  // log2 e
  }
};

// The gradient of a float mask: dS of one (b, h) written to a contiguous float32 (Nq, Nk) slice.
struct MaskGrad {
  float* ptr;  // at (b, h) already; nullptr = not asked for
  MHATTN_DEVICE void store(int i, int j, int seqlen_q, int seqlen_k, float ds) const {
    if (ptr != nullptr && i < seqlen_q && j < seqlen_k) ptr[(i64)i * seqlen_k + j] = ds;
  }
};

// Adds x, y to dQ columns c, c + 1 (c even, c < head_dim) at p (float32, column c of a dQ row) with atomics: one
// vector add where both exist and are 8-byte aligned, else one add per existing column (ANY_DIMS: odd head dims).
MHATTN_DEVICE void atomic_add_dq_pair(float* p, int c, int head_dim, float x, float y) {
#if ANY_DIMS
  if ((head_dim & 1) == 0) {
    atomic_add2_f32(p, x, y);
  } else {
    atomic_add_f32(p, x);
    if (c + 1 < head_dim) atomic_add_f32(p + 1, y);
  }
#else
  atomic_add2_f32(p, x, y);
#endif
}
