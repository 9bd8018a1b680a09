// The PTX layer of the Hopper kernel family (sm_90a): mbarriers, TMA tensor loads, wgmma, setmaxnreg,
// named barriers. Like ptx.cuh it includes no CUDA header, so NVRTC alone compiles it; the family is
// compiled for the architecture-specific target sm_90a (wgmma and setmaxnreg exist only there).
//
// Shared-memory tiles are written by TMA in the 128-byte swizzled layout: a tile of R rows x 64 columns of
// 16-bit elements is R rows of 128 bytes, whose 16-byte chunks are permuted by XOR with (row % 8); a head dim
// of 64c columns is c such tiles one after the other ("column chunks"). wgmma reads the same layout through a
// matrix descriptor (smem_desc).
#pragma once
#include "ptx.cuh"

#if MHATTN_BF16
#define WGMMA_TYPE "bf16"
#else
#define WGMMA_TYPE "f16"
#endif

// A CUtensorMap as the driver encodes it on the host (cuTensorMapEncodeTiled): 128 opaque bytes, passed by value
// as a __grid_constant__ kernel parameter so TMA reads it from parameter space.
struct alignas(64) TensorMap {
  u64 opaque[16];
};

// ---- mbarriers ----------------------------------------------------------------------------------------

MHATTN_DEVICE void mbar_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Orders the barriers' initialisation before their use by the copy engine and by the other threads (a
// __syncthreads must follow).
MHATTN_DEVICE void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` of TMA traffic the current phase waits for.
MHATTN_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
MHATTN_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival of this warp (after its lanes are done: a slot's readers release it once per warp).
MHATTN_DEVICE void release_slot(u32 empty_bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(empty_bar);
}
// Waits until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so waiting for
// parity 1 returns at once: a producer's first wait on an "empty" barrier passes.
MHATTN_DEVICE void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- TMA -------------------------------------------------------------------------------------------------

// Copies the box at coordinates (c0, c1, c2, c3) (innermost first) of `map`'s tensor into shared memory at
// `dst` (1024-byte aligned for the 128-byte swizzle); completion is counted in bytes on `bar`. Rows past the
// tensor's end are zero-filled.
MHATTN_DEVICE void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// N pairs of mbarriers side by side: full[0..N) then empty[0..N), 8 bytes each (a ring of N slots or buffers:
// full = its data landed, empty = its readers are done with it).
template <int N>
struct BarrierPairs {
  u32 bars;  // full[0]
  MHATTN_DEVICE u32 full(int i) const { return bars + 8u * i; }
  MHATTN_DEVICE u32 empty(int i) const { return bars + 8u * (N + i); }
};

// Copies the box at shared address `src` (1024-byte aligned, 128-byte swizzled) to coordinates (c0, c1, c2, c3) of
// `map`'s tensor, in this thread's bulk async-group; coordinates past the tensor's end are not written.
MHATTN_DEVICE void tma_store_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<u64>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}
// Copies `bytes` (a multiple of 16; both ends 16-byte aligned) from global to shared memory; completion counted in
// bytes on `bar`.
MHATTN_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Adds `bytes` (a multiple of 16; both ends 16-byte aligned) of float32 at shared address `src` into global `dst`
// by the copy engine, in this thread's bulk async-group (bulk_commit, then bulk_wait_read before `src` is reused).
MHATTN_DEVICE void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
MHATTN_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until the copy engine has read the shared memory of every bulk group this thread committed.
MHATTN_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until every bulk group this thread committed has completed (its global writes done).
MHATTN_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Makes this thread's plain shared-memory stores visible to the asynchronous proxy (wgmma, TMA) that reads them
// next (a barrier among the writers must follow before the reads are issued).
MHATTN_DEVICE void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Orders this thread's global-memory operations through the asynchronous proxy (bulk reduce-adds) with its plain
// ones, both ways: after bulk_wait_all, before a release that others read; after an acquire, before the next bulk ops.
MHATTN_DEVICE void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// A counter in global memory that CTAs of one grid pass on to each other (gpu scope): read with acquire semantics,
// raised by one with release semantics.
MHATTN_DEVICE int load_acquire_gpu(const int* p) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(p) : "memory");
  return value;
}
MHATTN_DEVICE void add_release_gpu(int* p, int x) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(x) : "memory");
}
MHATTN_DEVICE void fence_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
MHATTN_DEVICE void tma_prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// ---- scores ------------------------------------------------------------------------------------------------

#ifndef BOOL_MASK
#define BOOL_MASK 0
#endif
constexpr float LOG2E = 1.4426950408889634f;

// SOFTCAP: raw dot products -> softcap * tanh(s scale / softcap) in log2 units (common.cuh's log2_score), in place;
// before the mask, and the softmax then takes them with a scale of 1 (softmax_scale_log2).
template <int R>
MHATTN_DEVICE void cap_scores(float (&s)[R], const Softcap& softcap) {
#if SOFTCAP
  float th;
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = log2_score(s[i], 0.f, softcap, th);
#endif
}
// Calls f(k, query, key) for each of this thread's scores s[k] whose pair lies inside both sequences: s[4i + 2r + e]
// is row row0 + 8r, column col0 + 8i + e (col0 with the lane's 2t in it); rows are queries and columns keys
// (ROWS_ARE_QUERIES, the forward's S) or the other way round (the backward's S^T).
template <int R, bool ROWS_ARE_QUERIES, class F>
MHATTN_DEVICE void for_each_pair(int row0, int col0, int rows_end, int cols_end, F f) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= rows_end) continue;
#pragma unroll
    for (int i = 0; i < R / 4; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = col0 + 8 * i + e;
        if (col < cols_end) f(4 * i + 2 * r + e, ROWS_ARE_QUERIES ? row : col, ROWS_ARE_QUERIES ? col : row);
      }
    }
  }
}

// BOOL_MASK: hides the scores of (query, key) pairs a boolean attn_mask forbids (common.cuh's BoolMask, at the call's
// (batch, head)), in for_each_pair's layout. Only pairs inside both sequences are read; the others are hidden by the
// band's masking or carry no weight. A mask
// broadcast over the queries (key padding: query stride 0) is read once a key. (Reading the mask before the scores'
// wait, to overlap its loads with the products, measured 0.5-0.8x of this: NOTES.md, H14.)
template <int R, bool ROWS_ARE_QUERIES>
MHATTN_DEVICE void hide_forbidden(float (&s)[R], const BoolMask& mask, int row0, int col0, int rows_end, int cols_end) {
  if (mask.stride_q == 0) {  // key padding: hiding the rows or columns past a sequence's end changes nothing
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      if (ROWS_ARE_QUERIES ? r > 0 : row >= rows_end || mask.allows(0, row)) continue;  // rows are keys: one read
#pragma unroll
      for (int i = 0; i < R / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = col0 + 8 * i + e;
          if (!ROWS_ARE_QUERIES) {
            s[4 * i + 2 * r + e] = -MHATTN_INF;
          } else if (col < cols_end && !mask.allows(0, col)) {  // columns are keys: one read for both rows
            s[4 * i + e] = -MHATTN_INF;
            s[4 * i + 2 + e] = -MHATTN_INF;
          }
        }
      }
    }
    return;
  }
  for_each_pair<R, ROWS_ARE_QUERIES>(row0, col0, rows_end, cols_end, [&](int k, int query, int key) {
    if (!mask.allows(query, key)) s[k] = -MHATTN_INF;
  });
}

// FLOAT_MASK: adds an additive float attn_mask (common.cuh's FloatMask, float32, at the call's (batch, head)) to this
// thread's scores, in the softmax's units: the mask times `unit` = log2(e) / the factor the softmax then multiplies
// the scores by (so a score x becomes x factor + mask log2(e) there); -inf in the mask hides the pair. The layout is
// hide_forbidden's; pairs outside the sequences are not read (the band's masking or P = 0 takes care of them), and a
// mask broadcast over the queries (query stride 0) is read once a key.
template <int R, bool ROWS_ARE_QUERIES>
MHATTN_DEVICE void add_float_mask(float (&s)[R], const FloatMask& mask, int row0, int col0, int rows_end, int cols_end,
                                  float unit) {
  if (mask.stride_q == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      if (ROWS_ARE_QUERIES ? r > 0 : row >= rows_end) continue;  // columns are keys: one pass serves both rows
      const float row_value = ROWS_ARE_QUERIES ? 0.f : mask.ptr[(i64)row * mask.stride_k] * unit;
#pragma unroll
      for (int i = 0; i < R / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = col0 + 8 * i + e;
          if (col >= cols_end) continue;
          if (!ROWS_ARE_QUERIES) {
            s[4 * i + 2 * r + e] += row_value;
          } else {
            const float value = mask.ptr[(i64)col * mask.stride_k] * unit;
            s[4 * i + e] += value;
            s[4 * i + 2 + e] += value;
          }
        }
      }
    }
    return;
  }
  for_each_pair<R, ROWS_ARE_QUERIES>(row0, col0, rows_end, cols_end, [&](int k, int query, int key) {
    s[k] += mask.ptr[(i64)query * mask.stride_q + (i64)key * mask.stride_k] * unit;
  });
}

// The factor from a block's scores to log2 units: scale log2(e), or 1 where cap_scores has put them there.
MHATTN_DEVICE float softmax_scale_log2(float scale_log2) { return SOFTCAP ? 1.f : scale_log2; }

// ---- shared-memory stores of fragments ------------------------------------------------------------------------

// Stores four 8x8 matrices of 16-bit elements, one instruction for the warp (the inverse of ldmatrix): lane l gives
// the shared address of row l % 8 of matrix l / 8, and register j of every lane holds its two elements of matrix j
// (row lane / 4, columns 2 (lane % 4) and + 1: the mma fragment layout).
MHATTN_DEVICE void stmatrix_x4(u32 addr, u32 m0, u32 m1, u32 m2, u32 m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(m0), "r"(m1),
               "r"(m2), "r"(m3)
               : "memory");
}

// ---- register budgets and named barriers ------------------------------------------------------------------

// Gives registers back (the producer warpgroup) or takes them (the consumers); every warp of a warpgroup runs it.
template <int REGS>
MHATTN_DEVICE void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
MHATTN_DEVICE void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
MHATTN_DEVICE void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
MHATTN_DEVICE void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The budgets share what the CTA got at launch (65536 / threads a thread, rounded down to a multiple of 8): a
// setmaxnreg.inc that asks for more than the others gave back waits for ever.
__host__ __device__ constexpr bool budgets_fit_launch(int threads, int producer_regs, int consumer_threads, int consumer_regs) {
  return 128 * producer_regs + consumer_threads * consumer_regs <= ((65536 / threads) & ~7) * threads;
}

// ---- accumulator fragments ------------------------------------------------------------------------------------
// A 64 x N wgmma accumulator as a thread holds it (see the wgmma overloads below): element 4i + 2r + e is row
// (thread's row) + 8r, column 8i + 2(lane % 4) + e.

// The accumulator as the A operand of the next product over its columns: the m16n8k16 A fragment of k16 step kk
// is n8 tiles 2kk and 2kk + 1.
template <int R>
MHATTN_DEVICE void pack_a_fragments(u32 (&a)[R / 8][4], const float (&s)[R]) {
#pragma unroll
  for (int kk = 0; kk < R / 8; ++kk) {
    const float* lo = s + 8 * kk;  // n8 tile 2kk
    const float* hi = lo + 4;      // n8 tile 2kk + 1
    a[kk][0] = pack2(lo[0], lo[1]);
    a[kk][1] = pack2(lo[2], lo[3]);
    a[kk][2] = pack2(hi[0], hi[1]);
    a[kk][3] = pack2(hi[2], hi[3]);
  }
}

// A column bound of a COLS-column accumulator clamped to [-1, COLS] (the same tests on columns 0..COLS-1, no
// overflow in the conversion to 32 bits).
template <int COLS>
MHATTN_DEVICE int clamp_column(i64 x) { return x < -1 ? -1 : x > COLS ? COLS : (int)x; }

// -inf into the elements of accumulator row r (0: the thread's row, 1: 8 below) whose column 8i + e (relative to
// the thread's first column, 2(lane % 4)) is outside [lo, hi].
template <int R>
MHATTN_DEVICE void hide_outside(float (&s)[R], int r, int lo, int hi) {
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * i + e;
      if (col < lo || col > hi) s[4 * i + 2 * r + e] = -MHATTN_INF;
    }
  }
}

// ---- wgmma -----------------------------------------------------------------------------------------------

// The descriptor of a matrix operand in shared memory in the 128-byte swizzled layout (bits: start address / 16,
// leading-dimension byte offset / 16, stride-dimension byte offset / 16, layout type 1 = 128-byte swizzle), for the
// operand `offset` bytes past `base` (both multiples of 16). K-major operands (rows contiguous along the reduction, as
// Q and K): stride = 1024 bytes between groups of 8 rows, the leading offset unused. MN-major operands (V: rows along
// the reduction): stride = 1024 bytes between groups of 8 rows of the reduction, leading offset = bytes between column
// chunks of 64 elements. A shared address is below 256 KB, so address / 16 fills the 14-bit field without carrying
// out of it: the descriptors of a tile's k16 steps are then one base and a constant added per step (not a mask, a
// shift and an or per wgmma).
MHATTN_DEVICE u64 smem_desc(u32 base, u32 offset, u32 leading_bytes, u32 stride_bytes) {
  const u32 lo = ((base >> 4) | (((leading_bytes >> 4) & 0x3FFFu) << 16)) + (offset >> 4);
  const u32 hi = ((stride_bytes >> 4) & 0x3FFFu) | (1u << 30);  // (bit 62: the swizzle mode)
  return ((u64)hi << 32) | lo;
}

// A shared address that is the same in every lane, as lane 0 has it: ptxas then forms the descriptors from it in
// uniform registers (the wgmma operands' home) instead of in each lane's registers with a move per wgmma.
MHATTN_DEVICE u32 warp_uniform(u32 x) { return __shfl_sync(0xffffffffu, x, 0); }

// Orders this warpgroup's register writes before the wgmma that read them (accumulators, register A operands).
MHATTN_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the group of wgmma issued since the last commit.
MHATTN_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups are in flight.
template <int N>
MHATTN_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Tells the compiler the registers change here (an asynchronous wgmma writes them): no read of them moves
// above the wait that precedes this, no write below the issue that follows.
template <int R>
MHATTN_DEVICE void touch_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma.mma_async m64nNk16 with float32 accumulation, one overload per accumulator size (N / 2 floats a
// thread; thread l of warp w of the warpgroup holds rows 16w + l/4 and 16w + l/4 + 8, columns 8i + 2(l%4) and
// 8i + 2(l%4) + 1 of every n8 tile i: the m16n8 accumulator layout of mma.sync, tiled).
//   wgmma_ss: d (64 x N) += A (64 x 16) B (16 x N), both from shared memory (N = 64, 128), K-major or, with
//             TRANS_A / TRANS_B = 1, MN-major (rows of A along the reduction, contiguous along M; B as in wgmma_rs);
//   wgmma_rs: the same with A from registers (the m16n8k16 A fragment of each warp's 16 rows) and B MN-major
//             (N = 64, 128, 256).
// `accumulate` 0 overwrites d.
template <int TRANS_A = 0, int TRANS_B = 0>
MHATTN_DEVICE void wgmma_ss(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." WGMMA_TYPE "." WGMMA_TYPE "\n"
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},\n"
      "%32, %33, p, 1, 1, %35, %36;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}
template <int TRANS_A = 0, int TRANS_B = 0>
MHATTN_DEVICE void wgmma_ss(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." WGMMA_TYPE "." WGMMA_TYPE "\n"
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
      "%64, %65, p, 1, 1, %67, %68;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}
MHATTN_DEVICE void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." WGMMA_TYPE "." WGMMA_TYPE "\n"
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},\n"
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
MHATTN_DEVICE void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." WGMMA_TYPE "." WGMMA_TYPE "\n"
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
MHATTN_DEVICE void wgmma_rs(float (&d)[128], const u32 (&a)[4], u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." WGMMA_TYPE "." WGMMA_TYPE "\n"
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},\n"
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
