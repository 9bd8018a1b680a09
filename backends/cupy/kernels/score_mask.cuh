// Which scores a kernel hides: the causal / sliding-window band (HAS_BOUNDS), a boolean attn_mask (HAS_EXTRAS,
// switched on at run time by a non-null pointer), an additive float mask (FLOAT_MASK) and the ends of the
// sequences. The kernels ask once per block whether it needs masking at all (most blocks do not), then per
// accumulator row for the range of columns the band leaves visible, then per score.
// Needs the definitions of common.cuh.
#pragma once
#include "common.cuh"

// Columns [lo, hi] of one accumulator row that the band leaves visible, relative to the lane's first column.
struct VisibleColumns {
  int lo, hi;
  MHATTN_DEVICE bool contains(int c) const { return c >= lo && c <= hi; }
};

struct ScoreMask {
  int diag_offset, window_left, window_right;  // the band (Bounds)
  int seqlen_q, seqlen_k;
#if HAS_EXTRAS
  BoolMask bmask;
#endif
#if FLOAT_MASK
  FloatMask fmask;
#endif

  // Whether any score of queries [i0, i1] x keys [j0, j1] may be hidden; past_end: the block runs past the
  // last key (the query-side kernels' key blocks; the key-side kernels' query rows past the end carry
  // lse = +inf instead).
  MHATTN_DEVICE bool block_needs_mask(bool past_end, int i0, int i1, int j0, int j1) const {
    bool need = past_end;
#if HAS_BOUNDS
    need = need || !Bounds{diag_offset, window_left, window_right}.block_inside(i0, i1, j0, j1);
#endif
#if HAS_EXTRAS
    need = need || bmask.ptr != nullptr;
#endif
#if FLOAT_MASK
    need = true;
#endif
    return need;
  }

  // The keys query i sees (every key of the sequence without HAS_BOUNDS), relative to column `first`; the
  // window bounds fit in 32 bits (see ops.py).
  MHATTN_DEVICE VisibleColumns keys_of_query(int i, int first) const {
    const int lo = HAS_BOUNDS ? max_of(0, i + diag_offset - window_left) : 0;
    const int hi = HAS_BOUNDS ? min_of(seqlen_k - 1, i + diag_offset + window_right) : seqlen_k - 1;
    return VisibleColumns{lo - first, hi - first};
  }
  // The queries that see key j, relative to column `first`.
  MHATTN_DEVICE VisibleColumns queries_of_key(int j, int first) const {
    const int lo = HAS_BOUNDS ? max_of(0, j - diag_offset - window_right) : 0;
    const int hi = HAS_BOUNDS ? min_of(seqlen_q - 1, j - diag_offset + window_left) : seqlen_q - 1;
    return VisibleColumns{lo - first, hi - first};
  }

  // The score x (log2 units) of query i, key j: -inf where hidden, else x (plus the float mask's value).
  // in_band: the pair is inside the band's visible columns of its row (VisibleColumns::contains); the boolean
  // mask is read only inside both sequences.
  MHATTN_DEVICE float apply(float x, bool in_band, int i, int j) const {
    bool ok = in_band;
#if HAS_EXTRAS
    if (bmask.ptr != nullptr) ok = ok && i < seqlen_q && j < seqlen_k && bmask.allows(i, j);
#endif
#if FLOAT_MASK
    return fmask.apply(x, ok, i, j, seqlen_q, seqlen_k);
#else
    return ok ? x : -MHATTN_INF;
#endif
  }
};

// The ScoreMask of batch b, query head h: the masks' pointers move to (b, h) (a null boolean mask stays null).
MHATTN_DEVICE ScoreMask score_mask(int b, int h, int seqlen_q, int seqlen_k, int diag_offset, int window_left,
                                   int window_right, const unsigned char* mask, i64 m_sb, i64 m_sh, i64 m_sq,
                                   i64 m_sk, const float* float_mask, i64 fm_sb, i64 fm_sh, i64 fm_sq, i64 fm_sk) {
  ScoreMask sm;
  sm.diag_offset = diag_offset;
  sm.window_left = window_left;
  sm.window_right = window_right;
  sm.seqlen_q = seqlen_q;
  sm.seqlen_k = seqlen_k;
#if HAS_EXTRAS
  sm.bmask = BoolMask{mask != nullptr ? mask + b * m_sb + h * m_sh : nullptr, m_sq, m_sk};
#endif
#if FLOAT_MASK
  sm.fmask = FloatMask{float_mask + b * fm_sb + h * fm_sh, fm_sq, fm_sk};
#endif
  return sm;
}

// The key blocks [nb_lo, nb_hi) of BLOCK_N keys that hold a key some query of [m0, m_last] sees.
struct KeyBlockRange {
  int lo, hi;
};
MHATTN_DEVICE KeyBlockRange key_block_range(int m0, int m_last, int seqlen_k, int diag_offset, int window_left,
                                   int window_right) {
  int n_lo = 0, n_hi = seqlen_k;
#if HAS_BOUNDS
  n_lo = (int)max_of((i64)0, (i64)m0 + diag_offset - window_left);
  n_hi = (int)min_of((i64)seqlen_k, (i64)m_last + diag_offset + window_right + 1);
#endif
  const int nb_lo = n_lo / BLOCK_N;
  return KeyBlockRange{nb_lo, n_hi > n_lo ? (n_hi + BLOCK_N - 1) / BLOCK_N : nb_lo};
}
