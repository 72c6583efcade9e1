// Small device helpers shared by every splitkv kernel. Header-free on purpose: no CUDA
// headers are needed, so NVRTC compiles these sources on any machine, GPU or not.
//
// The storage type of q/k/v/out is a 16-bit pattern (u16); SPLITKV_BF16 selects whether it
// holds bfloat16 (1) or float16 (0). All arithmetic is fp32.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#ifndef SPLITKV_BF16
#error "SPLITKV_BF16 must be defined (1 = bfloat16, 0 = float16)"
#endif

#define SPLITKV_NEG_INF (-__int_as_float(0x7f800000))
#define SPLITKV_LN2 0.6931471805599453f
#define SPLITKV_LOG2E 1.4426950408889634f

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats to a packed pair of 16-bit values, bfloat16 or float16; `lo` lands in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2_as(float lo, float hi) {
  u32 r;
  if constexpr (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// The tensor cores' input type: the storage type, unless a kernel says otherwise before this
// header (the fp8-KV kernels compute in float16, where every fp8 value is exact).
#ifndef SPLITKV_MMA_BF16
#define SPLITKV_MMA_BF16 SPLITKV_BF16
#endif
// Two floats as a pair of the storage type, and as a pair of MMA inputs.
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack2_as<SPLITKV_BF16>(lo, hi); }
__device__ __forceinline__ u32 pack2_mma(float lo, float hi) {
  return pack2_as<SPLITKV_MMA_BF16>(lo, hi);
}

// a * b as a 64-bit product of two 32-bit ints, in one instruction (NVVM does not always see
// that a product of two sign-extended ints needs no 64 x 64 multiply).
__device__ __forceinline__ i64 mul_wide(int a, int b) {
  i64 r;
  asm("mul.wide.s32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global -> shared copy that bypasses L1; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// c (16x8, fp32) += a (16x16, row-major) * b (16x8, column-major), tensor cores. This lane's
// accumulators of c: two of row g (lane / 4) in `row_g`, two of row g + 8 in `row_g8`.
__device__ __forceinline__ void mma_16816(float* row_g, float* row_g8, const u32 a[4], u32 b0,
                                          u32 b1) {
#if SPLITKV_MMA_BF16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(row_g[0]), "+f"(row_g[1]), "+f"(row_g8[0]), "+f"(row_g8[1])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(row_g[0]), "+f"(row_g[1]), "+f"(row_g8[0]), "+f"(row_g8[1])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// The same with c as one fragment: c[0], c[1] of row g, c[2], c[3] of row g + 8.
__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
  mma_16816(c, c + 2, a, b0, b1);
}

// Loads that go to L2, never to a possibly stale L1 line: used for data other CTAs wrote
// during this same launch (the fused merge).
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// bar.sync on barrier `id` (1..4; 0 is __syncthreads') for THREADS threads. The id goes in as an
// immediate so that ptxas reserves only the barriers used, not all 16.
template <int THREADS>
__device__ __forceinline__ void named_barrier_sync(int id) {
  switch (id) {
    case 1: asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory"); break;
    case 2: asm volatile("bar.sync 2, %0;" ::"n"(THREADS) : "memory"); break;
    case 3: asm volatile("bar.sync 3, %0;" ::"n"(THREADS) : "memory"); break;
    default: asm volatile("bar.sync 4, %0;" ::"n"(THREADS) : "memory"); break;
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Four fp32 values written as four 16-bit outputs (one 8-byte store).
__device__ __forceinline__ void store4(u16* dst, float a, float b, float c, float d) {
  uint2 v;
  v.x = pack2(a, b);
  v.y = pack2(c, d);
  *reinterpret_cast<uint2*>(dst) = v;
}

// Thread-block clusters (sm_90+): partial states are exchanged through distributed shared memory.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Every thread of every CTA in the cluster arrives and waits; release/acquire order the shared
// memory each CTA wrote before the barrier with the reads of the others after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The address of `smem_addr` (a shared-memory address of this CTA) in CTA `rank` of the cluster.
__device__ __forceinline__ u32 cluster_map(u32 smem_addr, int rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_cluster(u32 addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_cluster4(u32 addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}
#else
// Declared only: a build without clusters never calls them (`if constexpr`).
__device__ void cluster_sync();
__device__ u32 cluster_map(u32 smem_addr, int rank);
__device__ float ld_cluster(u32 addr);
__device__ float4 ld_cluster4(u32 addr);
#endif

// Programmatic dependent launch (sm_90+). A kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it in the stream still runs; it
// must not read what that kernel (or anything before it) writes until wait_for_prior_grid()
// returns, which is once the prior grid has completed and its memory is visible. Launched
// without the attribute, both are no-ops.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// A 4-byte global load kept after wait_for_prior_grid(): the compiler may move a plain load
// through a `const __restrict__` pointer above the wait (it takes such data as unchanging during
// the kernel), but never one asm volatile above another.
__device__ __forceinline__ u32 ld_after_wait_u32(const void* p) {
  u32 v;
  asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// Lets the next kernel in the stream launch early (once every CTA of this grid has called it
// or exited); it still waits for this grid's completion before reading anything.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
