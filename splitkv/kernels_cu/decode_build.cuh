// The decode kernels' build inputs: the -D macros KernelBuild.defines passes
// (runtime/kernel_source.py), their defaults, and the checks on them, turned once into
// compile-time values (Build). decode.cu reads the features only through Build, with
// `if constexpr`; the shape macros (HEAD_DIM, ROW_TILES, STAGES, NUM_WARPS, WARPS_D, TILE_N,
// RECORD_PAGES) it reads as the integers they are.
#pragma once

#if !defined(HEAD_DIM) || !defined(ROW_TILES) || !defined(STAGES) || !defined(NUM_WARPS)
#error "HEAD_DIM, ROW_TILES, STAGES and NUM_WARPS must be defined"
#endif

// Features, off unless defined (decode.cu's head comment says what each does).
#ifndef KV_FP8
#define KV_FP8 0          // 1: K/V are e4m3fn codes, 2: e5m2
#endif
#ifndef SOFT_CAP
#define SOFT_CAP 0
#endif
#ifndef MULTI_TOKEN
#define MULTI_TOKEN 0
#endif
#ifndef UNIFIED_MAX
#define UNIFIED_MAX 0
#endif
#ifndef ALIBI
#define ALIBI 0           // 1: ALiBi's per-head linear bias on the scaled scores
#endif
#ifndef Q_SMEM
#define Q_SMEM 0
#endif
#ifndef POW2_PAGES
#define POW2_PAGES 0
#endif
#ifndef CLUSTER
#define CLUSTER 0         // S > 1: the S chunks of a request are one thread-block cluster
#endif
#ifndef MAX_REGISTERS
#define MAX_REGISTERS 0   // 0: the compiler's choice
#endif
#ifndef DISSECT
#define DISSECT 0         // the latency dissection's cuts (Cut below); 0 in every real build
#endif
#ifndef WARPS_D
#define WARPS_D 1         // warps that split O's head dim (an experiment)
#endif
#ifndef TILE_N
#define TILE_N (16 * NUM_WARPS / WARPS_D)   // tokens per pipeline stage (32 x: an experiment)
#endif

// fp8 K/V run float16 MMAs (every fp8 value is exact there); common.cuh reads this.
#define SPLITKV_MMA_BF16 (SPLITKV_BF16 && !KV_FP8)

// Kernel attributes cannot be chosen by `if constexpr`. MAX_REGISTERS > 0 caps the registers
// per thread (so that more CTAs fit on an SM; ptxas did not honour __launch_bounds__'s
// minimum-CTA hint). A cluster's size is the kernel's own, so the driver refuses any other
// launch of it.
#if MAX_REGISTERS > 0
#define PARTIAL_BOUNDS __maxnreg__(MAX_REGISTERS)
#else
#define PARTIAL_BOUNDS __launch_bounds__(NUM_WARPS * 32, 1)
#endif
#if CLUSTER > 1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "CLUSTER needs sm_90 or newer"
#endif
#define PARTIAL_CLUSTER __cluster_dims__(CLUSTER, 1, 1)
#else
#define PARTIAL_CLUSTER
#endif

// What the latency dissection (benchmarks/dissect_latency.py) cuts out of a build, as bits of
// DISSECT: the cut kernels compute wrong answers on purpose, only their times mean anything.
enum Cut : int {
  CUT_TICKET_MERGE = 1,    // no fence, ticket or fused merge after the partials
  CUT_PAGE_LOOKUP = 2,     // page index pidx of the pool instead of the page table's entry
  CUT_KV_READS = 4,        // the K/V copies read nothing (zero-fill)
  CUT_ALL = 8,             // decode_partial returns at once
  CUT_MERGE_KERNEL = 16,   // merge_partials returns after its wait
};

// The build's features as compile-time values (enumerators: NVRTC's -default-device would
// emit a constexpr variable into every module as a device global).
struct Build {
  enum : int {
    fp8 = KV_FP8 != 0,
    bf16 = SPLITKV_BF16 != 0,   // q and the output are bfloat16
    soft_cap = SOFT_CAP != 0,
    multi_token = MULTI_TOKEN != 0,
    unified_max = UNIFIED_MAX != 0,
    alibi = ALIBI != 0,
    q_in_smem = Q_SMEM != 0,
    pow2_pages = POW2_PAGES != 0,
    cluster = CLUSTER > 1 ? CLUSTER : 1,   // CTAs a cluster (1: no cluster)
  };
  static constexpr bool cuts(Cut c) { return (DISSECT & c) != 0; }
};

// NVRTC has no standard headers: the one type trait the kernels need.
template <bool B, class T, class F>
struct conditional { using type = T; };
template <class T, class F>
struct conditional<false, T, F> { using type = F; };
