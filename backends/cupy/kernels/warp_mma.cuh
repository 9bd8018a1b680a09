// The warp-level matrix products the attention kernels are made of: each warp multiplies MT m16 tiles of A
// with NT n8 tiles of B on tensor cores (mma.sync m16n8k16, float32 accumulators), every B fragment it
// loads feeding all MT tiles. One k16 loop (mma_k_loop) serves three kinds, by where the A operand comes from:
//   mma_abt      acc = A B^T over the head dim, A and B row-major [row][head dim] shared tiles, A optionally
//                held in registers (Q K^T, dO V^T, K Q^T, V dO^T);
//   mma_regs_ab  acc += A B with A an accumulator block of an earlier product, converted to 16-bit in
//                registers (P V, dS K, P^T dO, dS^T Q), B a [k][n] head-dim tile;
//   mma_smem_ab  acc += A B with A read from a shared tile (row-major or transposed), B a [k][n] head-dim tile.
// Needs the definitions of common.cuh.
#pragma once
#include "common.cuh"

constexpr int KD = HEAD_DIM / 16;  // k16 steps across the head dim

// acc = 0 for the accumulators of one m16 tile (NT n8 tiles), or of MT of them.
template <int NT>
MHATTN_DEVICE void zero_acc(float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
}
template <int MT, int NT>
MHATTN_DEVICE void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) zero_acc(acc[mt]);
}

// The A fragments of rows r0..r0 + 16 MT - 1 of a head-dim tile over the whole head dim, to keep in registers.
template <int MT>
MHATTN_DEVICE void load_a_frags(u32 (&frag)[MT][KD][4], u32 s_tile, int r0, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) load_a_frag(frag[mt][kk], s_tile, r0 + mt * 16, kk * 16, lane);
}

// The same for the same rows of two head-dim tiles (K and V, Q and dO), their loads interleaved.
template <int MT>
MHATTN_DEVICE void load_a_frags(u32 (&frag_a)[MT][KD][4], u32 s_a, u32 (&frag_b)[MT][KD][4], u32 s_b, int r0,
                                int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      load_a_frag(frag_a[mt][kk], s_a, r0 + mt * 16, kk * 16, lane);
      load_a_frag(frag_b[mt][kk], s_b, r0 + mt * 16, kk * 16, lane);
    }
}

// The k16 loop every product shares: per k16 step kk, the A fragments of the MT m16 tiles (load_a(a, mt, kk)),
// then per pair np of n8 tiles one B fragment pair (load_b(b, np, kk): b[0], b[1] serve n8 tile 2 np, b[2], b[3]
// tile 2 np + 1) that feeds all MT tiles: acc[mt][2 np + i] += a[mt] b_i.
template <int MT, int NT, int KSTEPS, class LoadA, class LoadB>
MHATTN_DEVICE void mma_k_loop(float (&acc)[MT][NT][4], const LoadA& load_a, const LoadB& load_b) {
  static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_a(a[mt], mt, kk);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      load_b(b, np, kk);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// acc = A B^T over the head dim: A = rows a_r0.. (MT m16 tiles) of the head-dim tile s_a, or, with A_IN_REGS,
// their fragments a_regs[mt][kk] of load_a_frags (s_a and a_r0 unused); B = rows b_r0.. (NT n8 tiles) of the
// head-dim tile s_b. a_regs may be null without A_IN_REGS.
template <int MT, int NT, bool A_IN_REGS>
MHATTN_DEVICE void mma_abt(float (&acc)[MT][NT][4], u32 (*a_regs)[KD][4], u32 s_a, int a_r0, u32 s_b, int b_r0,
                           int lane) {
  zero_acc(acc);
  mma_k_loop<MT, NT, KD>(
      acc,
      [&](u32 (&a)[4], int mt, int kk) {
        if (A_IN_REGS) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] = a_regs[mt][kk][r];
        } else {
          load_a_frag(a, s_a, a_r0 + mt * 16, kk * 16, lane);
        }
      },
      [&](u32 (&b)[4], int np, int kk) { load_b_frag_nk(b, s_b, b_r0 + np * 16, kk * 16, lane); });
}

// acc += A B: A = the accumulator block a_acc of an earlier product (MT m16 tiles x KT n8 tiles, its columns
// the k dimension here), packed to 16-bit in registers; B = rows 0..8 KT - 1, columns 0..8 NT - 1 of the [k][n]
// head-dim tile s_b (read transposed by ldmatrix).
template <int MT, int KT, int NT>
MHATTN_DEVICE void mma_regs_ab(float (&acc)[MT][NT][4], const float (&a_acc)[MT][KT][4], u32 s_b, int lane) {
  static_assert(KT % 2 == 0, "k16 steps of two n8 tiles");
  mma_k_loop<MT, NT, KT / 2>(
      acc, [&](u32 (&a)[4], int mt, int kk) { acc_to_a_frag(a, a_acc[mt][2 * kk], a_acc[mt][2 * kk + 1]); },
      [&](u32 (&b)[4], int np, int kk) { load_b_frag_kn(b, s_b, kk * 16, np * 16, lane); });
}

// acc += A B over KSTEPS k16 steps: A (MT m16 tiles) from a shared tile with `a_row` elements per row, rows
// a_r0.. and k columns (row-major), or with A_TRANS stored transposed, [k][m]; B (NT n8 tiles) = columns
// b_c0.. of the [k][n] head-dim tile s_b (rows = k, read transposed by ldmatrix).
template <int MT, int NT, int KSTEPS, bool A_TRANS>
MHATTN_DEVICE void mma_smem_ab(float (&acc)[MT][NT][4], u32 s_a, int a_row, int a_r0, u32 s_b, int b_c0, int lane) {
  mma_k_loop<MT, NT, KSTEPS>(
      acc,
      [&](u32 (&a)[4], int mt, int kk) {
        if (A_TRANS) {
          load_a_frag_trans(a, s_a, a_row, a_r0 + mt * 16, kk * 16, lane);
        } else {
          load_a_frag_rows(a, s_a, a_row, a_r0 + mt * 16, kk * 16, lane);
        }
      },
      [&](u32 (&b)[4], int np, int kk) { load_b_frag_kn(b, s_b, kk * 16, b_c0 + np * 16, lane); });
}
