// Host-side emulator of the PTX layer of the attention kernels (kernels/ptx.cuh), for checking the
// kernels' index arithmetic, masking, pipelining and fragment bookkeeping on a machine without a GPU.
//
// Every CUDA thread of a block runs as a fiber (ucontext) on one host thread. Warp-collective
// instructions (ldmatrix, mma.sync, shfl) and __syncthreads are rendezvous points: a fiber deposits its
// operands and yields until the whole warp (block) has arrived; the last arrival computes every lane's
// result with the per-lane semantics of the PTX ISA. cp.async copies are queued per thread and land only
// at cp.async.wait_group, so a missing wait or barrier reads stale (0xFF-poisoned) shared memory.
// Divergent collectives and deadlocks are reported as errors, as are shared-memory accesses out of range.
#pragma once
#define MHATTN_EMULATE 1

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short elem_t;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define MHATTN_DEVICE inline
#define MHATTN_DYNAMIC_SMEM(name) unsigned char* name = emu::g_smem.data()
#define MHATTN_INF INFINITY

struct EmuDim3 {
  unsigned x, y, z;
};

namespace emu {

constexpr int MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 512 * 1024;

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};

struct Copy {
  u32 dst;
  const void* src;
  u32 bytes;
};

enum Op { OP_SHFL = 1, OP_LDSM, OP_LDSM_T, OP_MMA };

struct WarpState {
  int arrived = 0;
  unsigned gen = 0;
  int op = 0;
  u32 in_u[32][6];
  float in_f[32][4];
  u32 out_u[32][4];
  float out_f[32][4];
};

inline EmuDim3 g_block_idx, g_grid_dim, g_block_dim;
inline EmuDim3 g_thread_idx[MAX_THREADS];
inline int g_cur = 0;
inline int g_nthreads = 0;
inline std::vector<unsigned char> g_smem;
inline std::vector<Fiber> g_fibers;
inline ucontext_t g_main_ctx;
inline long long g_progress = 0;
inline char g_error[1024];
inline bool g_failed = false;
inline WarpState g_warps[MAX_THREADS / 32];
inline int g_bar_arrived = 0;
inline unsigned g_bar_gen = 0;
inline std::vector<Copy> g_pending[MAX_THREADS];
inline std::vector<size_t> g_group_ends[MAX_THREADS];
inline void (*g_thunk)() = nullptr;

inline void yield_to_scheduler() { swapcontext(&g_fibers[g_cur].ctx, &g_main_ctx); }

// Records the first error and parks the fiber for good; the scheduler stops the launch.
inline void fail(const char* what) {
  if (!g_failed) {
    g_failed = true;
    snprintf(g_error, sizeof g_error, "block (%u,%u,%u) thread %d: %s", g_block_idx.x, g_block_idx.y, g_block_idx.z,
             g_cur, what);
  }
  for (;;) yield_to_scheduler();
}

inline void check_smem(u32 addr, u32 bytes, u32 align) {
  if ((size_t)addr + bytes > g_smem.size()) fail("shared memory access out of range");
  if (addr % align) fail("misaligned shared memory access");
}

template <class F>
inline void warp_collective(int op, F&& compute) {
  WarpState& w = g_warps[g_cur >> 5];
  if (w.arrived == 0) {
    w.op = op;
  } else if (w.op != op) {
    fail("lanes of one warp reached different collective instructions");
  }
  ++w.arrived;
  ++g_progress;
  const unsigned my_gen = w.gen;
  if (w.arrived == 32) {
    compute(w);
    w.arrived = 0;
    ++w.gen;
    ++g_progress;
  } else {
    while (w.gen == my_gen) yield_to_scheduler();
  }
}

// ---- numbers ------------------------------------------------------------------------------------------

inline float bits_to_float(u32 u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline u32 float_to_bits(float f) {
  u32 u;
  memcpy(&u, &f, 4);
  return u;
}
inline float elem_to_float_impl(elem_t x) {
#if MHATTN_BF16
  return bits_to_float(((u32)x) << 16);
#else
  _Float16 h;
  memcpy(&h, &x, 2);
  return (float)h;
#endif
}
inline elem_t float_to_elem(float f) {
#if MHATTN_BF16
  u32 u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (elem_t)(u >> 16);
#else
  _Float16 h = (_Float16)f;
  elem_t x;
  memcpy(&x, &h, 2);
  return x;
#endif
}

// ---- the scheduler ------------------------------------------------------------------------------------

inline void fiber_entry() {
  g_thunk();
  g_fibers[g_cur].done = true;
  ++g_progress;
}

inline int run_block(int nthreads) {
  for (int w = 0; w < nthreads / 32; ++w) g_warps[w] = WarpState();
  g_bar_arrived = 0;
  g_bar_gen = 0;
  for (int i = 0; i < nthreads; ++i) {
    Fiber& f = g_fibers[i];
    f.done = false;
    g_pending[i].clear();
    g_group_ends[i].clear();
    g_thread_idx[i] = EmuDim3{(unsigned)i, 0, 0};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &g_main_ctx;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  for (;;) {
    const long long before = g_progress;
    int running = 0;
    for (int i = 0; i < nthreads; ++i) {
      if (g_fibers[i].done) continue;
      g_cur = i;
      swapcontext(&g_main_ctx, &g_fibers[i].ctx);
      if (g_failed) return 1;
      running += !g_fibers[i].done;
    }
    if (running == 0) break;
    if (g_progress == before) {
      snprintf(g_error, sizeof g_error, "block (%u,%u,%u): deadlock (%d threads wait at a barrier or collective "
               "that the others never reach)", g_block_idx.x, g_block_idx.y, g_block_idx.z, running);
      return 2;
    }
  }
  for (int i = 0; i < nthreads; ++i) {
    if (!g_pending[i].empty()) {
      snprintf(g_error, sizeof g_error, "block (%u,%u,%u) thread %d: exited with cp.async copies never waited for",
               g_block_idx.x, g_block_idx.y, g_block_idx.z, i);
      return 3;
    }
  }
  return 0;
}

inline int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned nthreads, unsigned smem_bytes, char* err,
                    int errlen) {
  if (nthreads == 0 || nthreads % 32 || nthreads > MAX_THREADS) {
    snprintf(err, errlen, "block size %u is not a multiple of 32 in 32..%d", nthreads, MAX_THREADS);
    return 4;
  }
  g_failed = false;
  g_error[0] = 0;
  g_nthreads = (int)nthreads;
  g_grid_dim = EmuDim3{gx, gy, gz};
  g_block_dim = EmuDim3{nthreads, 1, 1};
  g_fibers.resize(nthreads);
  for (auto& f : g_fibers) f.stack.resize(STACK_BYTES);
  g_smem.assign(smem_bytes ? smem_bytes : 16, 0);
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        g_block_idx = EmuDim3{x, y, z};
        std::fill(g_smem.begin(), g_smem.end(), 0xFF);  // stale shared memory reads as NaN
        const int rc = run_block((int)nthreads);
        if (rc) {
          snprintf(err, errlen, "%s", g_error);
          return rc;
        }
      }
  return 0;
}

}  // namespace emu

#define threadIdx (emu::g_thread_idx[emu::g_cur])
#define blockIdx (emu::g_block_idx)
#define gridDim (emu::g_grid_dim)
#define blockDim (emu::g_block_dim)

// ---- the PTX layer (same names and semantics as kernels/ptx.cuh) ----------------------------------------

inline u32 smem_u32(const void* p) {
  return (u32)(static_cast<const unsigned char*>(p) - emu::g_smem.data());
}

inline void cp_async_16(u32 dst, const void* src, u32 src_bytes) {
  emu::check_smem(dst, 16, 16);
  if (src_bytes && (((uintptr_t)src) & 15)) emu::fail("cp.async source not 16-byte aligned");
  emu::g_pending[emu::g_cur].push_back(emu::Copy{dst, src, src_bytes});
}
inline void st_shared_v4(u32 addr, const u32 (&w)[4]) {
  emu::check_smem(addr, 16, 16);
  memcpy(emu::g_smem.data() + addr, w, 16);
}
inline void cp_async_commit() { emu::g_group_ends[emu::g_cur].push_back(emu::g_pending[emu::g_cur].size()); }
template <int N>
inline void cp_async_wait() {
  auto& pending = emu::g_pending[emu::g_cur];
  auto& ends = emu::g_group_ends[emu::g_cur];
  if ((int)ends.size() <= N) return;
  const size_t upto = ends[ends.size() - 1 - N];
  for (size_t c = 0; c < upto; ++c) {
    const emu::Copy& cp = pending[c];
    if (cp.bytes) {
      memcpy(emu::g_smem.data() + cp.dst, cp.src, 16);
    } else {
      memset(emu::g_smem.data() + cp.dst, 0, 16);
    }
  }
  pending.erase(pending.begin(), pending.begin() + upto);
  std::vector<size_t> rest;
  for (size_t g = ends.size() - N; g < ends.size(); ++g) rest.push_back(ends[g] - upto);
  ends = rest;
}

inline void ldsm_x4_impl(u32 (&r)[4], u32 addr, bool trans) {
  emu::check_smem(addr, 16, 16);
  const int lane = emu::g_cur & 31;
  emu::WarpState& w = emu::g_warps[emu::g_cur >> 5];
  w.in_u[lane][0] = addr;
  emu::warp_collective(trans ? emu::OP_LDSM_T : emu::OP_LDSM, [](emu::WarpState& ws) {
    const unsigned char* s = emu::g_smem.data();
    for (int l = 0; l < 32; ++l)
      for (int m = 0; m < 4; ++m) {
        if (ws.op == emu::OP_LDSM) {
          // lane l gets row l/4, elements 2(l%4), 2(l%4)+1 of matrix m
          memcpy(&ws.out_u[l][m], s + ws.in_u[8 * m + l / 4][0] + (l % 4) * 4, 4);
        } else {
          // transposed: elements (row 2(l%4), col l/4) and (row 2(l%4)+1, col l/4)
          elem_t lo, hi;
          memcpy(&lo, s + ws.in_u[8 * m + 2 * (l % 4)][0] + (l / 4) * 2, 2);
          memcpy(&hi, s + ws.in_u[8 * m + 2 * (l % 4) + 1][0] + (l / 4) * 2, 2);
          ws.out_u[l][m] = (u32)lo | ((u32)hi << 16);
        }
      }
  });
  for (int m = 0; m < 4; ++m) r[m] = w.out_u[lane][m];
}
inline void ldsm_x4(u32 (&r)[4], u32 addr) { ldsm_x4_impl(r, addr, false); }
inline void ldsm_x4_trans(u32 (&r)[4], u32 addr) { ldsm_x4_impl(r, addr, true); }

inline void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  const int lane = emu::g_cur & 31;
  emu::WarpState& w = emu::g_warps[emu::g_cur >> 5];
  for (int i = 0; i < 4; ++i) {
    w.in_u[lane][i] = a[i];
    w.in_f[lane][i] = d[i];
  }
  w.in_u[lane][4] = b0;
  w.in_u[lane][5] = b1;
  emu::warp_collective(emu::OP_MMA, [](emu::WarpState& ws) {
    float A[16][16], B[16][8], C[16][8];
    auto lo = [](u32 x) { return emu::elem_to_float_impl((elem_t)(x & 0xffffu)); };
    auto hi = [](u32 x) { return emu::elem_to_float_impl((elem_t)(x >> 16)); };
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      const u32* in = ws.in_u[l];
      A[g][2 * t] = lo(in[0]);
      A[g][2 * t + 1] = hi(in[0]);
      A[g + 8][2 * t] = lo(in[1]);
      A[g + 8][2 * t + 1] = hi(in[1]);
      A[g][2 * t + 8] = lo(in[2]);
      A[g][2 * t + 9] = hi(in[2]);
      A[g + 8][2 * t + 8] = lo(in[3]);
      A[g + 8][2 * t + 9] = hi(in[3]);
      B[2 * t][g] = lo(in[4]);
      B[2 * t + 1][g] = hi(in[4]);
      B[2 * t + 8][g] = lo(in[5]);
      B[2 * t + 9][g] = hi(in[5]);
      C[g][2 * t] = ws.in_f[l][0];
      C[g][2 * t + 1] = ws.in_f[l][1];
      C[g + 8][2 * t] = ws.in_f[l][2];
      C[g + 8][2 * t + 1] = ws.in_f[l][3];
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
      for (int e = 0; e < 4; ++e) {
        double acc = C[rows[e]][cols[e]];
        for (int kk = 0; kk < 16; ++kk) acc += (double)A[rows[e]][kk] * (double)B[kk][cols[e]];
        ws.out_f[l][e] = (float)acc;
      }
    }
  });
  for (int i = 0; i < 4; ++i) d[i] = w.out_f[lane][i];
}

inline u32 pack2(float lo, float hi) { return (u32)emu::float_to_elem(lo) | ((u32)emu::float_to_elem(hi) << 16); }
inline float elem_to_float(elem_t x) { return emu::elem_to_float_impl(x); }
inline float fast_exp2(float x) { return exp2f(x); }
inline float fast_log2(float x) { return log2f(x); }
inline float fast_rcp(float x) { return 1.f / x; }

inline void atomic_add_f32(float* p, float x) { *p += x; }  // fibers never run concurrently
inline void atomic_add2_f32(float* p, float x, float y) {
  p[0] += x;
  p[1] += y;
}

inline float shfl_xor(float x, int lane_mask) {
  const int lane = emu::g_cur & 31;
  emu::WarpState& w = emu::g_warps[emu::g_cur >> 5];
  w.in_f[lane][0] = x;
  w.in_u[lane][0] = (u32)lane_mask;
  emu::warp_collective(emu::OP_SHFL, [](emu::WarpState& ws) {
    for (int l = 0; l < 32; ++l) ws.out_f[l][0] = ws.in_f[l ^ (int)ws.in_u[l][0]][0];
  });
  return w.out_f[lane][0];
}

inline void block_sync() {
  ++emu::g_bar_arrived;
  ++emu::g_progress;
  const unsigned my_gen = emu::g_bar_gen;
  if (emu::g_bar_arrived == emu::g_nthreads) {
    emu::g_bar_arrived = 0;
    ++emu::g_bar_gen;
  } else {
    while (emu::g_bar_gen == my_gen) emu::yield_to_scheduler();
  }
}
