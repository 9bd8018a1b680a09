// Thin wrappers over the PTX instructions the attention kernels use (sm_80 and newer).
//
// No CUDA header is included anywhere: NVRTC compiles these builtins as they are, so a build needs
// neither a CUDA toolkit nor a GPU. Element tiles hold raw 16-bit patterns (elem_t); MHATTN_BF16
// selects whether they are bfloat16 (1) or float16 (0).
//
// Under MHATTN_EMULATE (the host-side emulator used by the tests) these functions come from the
// emulator instead, with the same names and the same per-lane semantics.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short elem_t;

#ifndef MHATTN_BF16
#error "define MHATTN_BF16 to 1 (bfloat16) or 0 (float16)"
#endif

struct alignas(16) U128 {
  u32 x, y, z, w;
};

#ifndef MHATTN_EMULATE

#define MHATTN_DEVICE __device__ __forceinline__
#define MHATTN_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]

// Shared-memory byte address (the 32-bit form ldmatrix and cp.async take).
MHATTN_DEVICE u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte global -> shared copy that bypasses L1; src_bytes = 0 writes 16 zero bytes (out-of-range rows
// and padded head-dim columns) without reading global memory.
MHATTN_DEVICE void cp_async_16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// Plain 16-byte store to shared memory (addr 16-byte aligned).
MHATTN_DEVICE void st_shared_v4(u32 addr, const u32 (&w)[4]) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}
MHATTN_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N committed groups of this thread are still in flight (a __syncthreads must
// follow before other threads read the data).
template <int N>
MHATTN_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i; lane l receives row l/4,
// columns 2(l%4), 2(l%4)+1 of each matrix (with .trans: of each transposed matrix).
MHATTN_DEVICE void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
MHATTN_DEVICE void ldsm_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b on tensor cores: a 16x16 (row major), b 16x8 (column major), d 16x8 float32.
MHATTN_DEVICE void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if MHATTN_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats rounded to nearest-even into one 32-bit register: lo in bits 0..15, hi in bits 16..31.
MHATTN_DEVICE u32 pack2(float lo, float hi) {
  u32 r;
#if MHATTN_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

MHATTN_DEVICE float elem_to_float(elem_t x) {
#if MHATTN_BF16
  return __uint_as_float(((u32)x) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
  return f;
#endif
}

// 2^x (exp2(-inf) = 0) and log2(x); the approximate forms are accurate to ~2 ulp, far below bf16/fp16 rounding.
MHATTN_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
MHATTN_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// 1 / x to ~1 ulp (1 / inf = 0): one instruction where a division compiles to a dozen.
MHATTN_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Fire-and-forget float add to global memory (the result is not returned, so no round trip).
MHATTN_DEVICE void atomic_add_f32(float* p, float x) { asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(x) : "memory"); }
// The same for two consecutive floats (p 8-byte aligned): one vector reduction on sm_90 and newer.
MHATTN_DEVICE void atomic_add2_f32(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
  atomic_add_f32(p, x);
  atomic_add_f32(p + 1, y);
#endif
}

MHATTN_DEVICE float shfl_xor(float x, int lane_mask) { return __shfl_xor_sync(0xffffffffu, x, lane_mask); }
MHATTN_DEVICE void block_sync() { __syncthreads(); }

#define MHATTN_INF __int_as_float(0x7f800000)

#endif  // MHATTN_EMULATE
