"""How fast can 16-byte copies stream 1 GiB into shared memory on this GPU, by instruction?

The decode kernel streams K/V with cp.async and stops near 83% of the read bandwidth, with an
L2 hit rate of 50% where a plain load kernel has 1% (Nsight Compute). This times the same
bytes, contiguous or in scattered 256-byte rows, read by: plain 16-byte loads (LDG), cp.async
.cg (L2 only), cp.async .ca, and cp.async with an L2 prefetch hint; 4 warps per CTA, a
3-deep pipeline of 64 rows x 256 B per warp group, like the decode kernel.

    python3 benchmarks/copy_probe.py
"""

import cupy
import numpy as np

from splitkv.runtime.timing import cupy_timer, median_us_per_call

SOURCE = r"""
typedef unsigned int u32;
__device__ __forceinline__ u32 smem_u32(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}
// One CTA streams `rows` rows of 256 B starting at row_index[cta * rows_per_cta + i] (a scattered
// or contiguous order) through a STAGES-deep shared-memory ring of 64-row tiles.
template <int MODE>
__device__ __forceinline__ void copy16(u32 dst, const uint4* src, uint4& reg) {
  if (MODE == 0) {
    reg = __ldcg(src);
  } else if (MODE == 1) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
  } else if (MODE == 2) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
  } else {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src));
  }
}

// PT: also load one word of a small, L2-resident table per copied row, as the decode kernel
// loads a page-table entry per row.
// KV: copy the same rows from a second buffer too (K and V), into a second ring.
template <int MODE, bool PT = false, bool KV = false>
__device__ void stream(const uint4* __restrict__ src, const int* __restrict__ row_index,
                       int tiles_per_cta, unsigned* sink, const uint4* __restrict__ src2 = nullptr) {
  constexpr int STAGES = 3, ROWS = 64, CHUNKS = 16;   // 64 rows x 16 x 16 B = 16 KiB per tile
  extern __shared__ uint4 ring[];
  const int tid = threadIdx.x;
  const int chunk = tid % CHUNKS, row0 = tid / CHUNKS;   // 8 rows per pass of 128 threads
  u32 acc = 0;
  uint4 reg[ROWS / 8];
  auto issue = [&](int tile) {
    if (tile >= tiles_per_cta) return;
    const int stage = tile % STAGES;
#pragma unroll
    for (int i = 0; i < ROWS / 8; ++i) {
      const int row = row0 + 8 * i;
      const long long r = row_index[((long long)blockIdx.x * tiles_per_cta + tile) * ROWS + row];
      uint4* dst = ring + (stage * ROWS + row) * CHUNKS + (chunk ^ (row & 7));
      copy16<MODE>(smem_u32(dst), src + r * CHUNKS + chunk, reg[i]);
      if (KV) copy16<MODE>(smem_u32(dst + STAGES * ROWS * CHUNKS), src2 + r * CHUNKS + chunk, reg[i]);
      if (PT) acc += row_index[(row + tile * ROWS) >> 4];
    }
    if (MODE == 0) {   // all loads in flight first, then the stores
#pragma unroll
      for (int i = 0; i < ROWS / 8; ++i) {
        const int row = row0 + 8 * i;
        ring[(stage * ROWS + row) * CHUNKS + (chunk ^ (row & 7))] = reg[i];
      }
    }
  };
  for (int s = 0; s < STAGES - 1; ++s) { issue(s); asm volatile("cp.async.commit_group;"); }
  for (int t = 0; t < tiles_per_cta; ++t) {
    asm volatile("cp.async.wait_group 1;");
    __syncthreads();
    issue(t + STAGES - 1);
    asm volatile("cp.async.commit_group;");
    const uint4 v = ring[((t % STAGES) * ROWS + row0) * CHUNKS + chunk];
    acc ^= v.x ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
extern "C" __global__ void __launch_bounds__(128) stream_ldg(const uint4* s, const int* r, int t, unsigned* k) { stream<0>(s, r, t, k); }
extern "C" __global__ void __launch_bounds__(128) stream_cg(const uint4* s, const int* r, int t, unsigned* k) { stream<1>(s, r, t, k); }
extern "C" __global__ void __launch_bounds__(128) stream_ca(const uint4* s, const int* r, int t, unsigned* k) { stream<2>(s, r, t, k); }
extern "C" __global__ void __launch_bounds__(128) stream_cg_pt(const uint4* s, const int* r, int t, unsigned* k) { stream<1, true>(s, r, t, k); }
extern "C" __global__ void __launch_bounds__(128) stream_cg_kv(const uint4* s, const int* r, int t, unsigned* k, const uint4* s2) { stream<1, false, true>(s, r, t, k, s2); }
extern "C" __global__ void __launch_bounds__(128) stream_cg_l2pf(const uint4* s, const int* r, int t, unsigned* k) { stream<3>(s, r, t, k); }
"""


def main():
    nbytes = 1 << 30
    rows = nbytes // 256
    buf = cupy.ones(nbytes // 4, dtype=cupy.uint32)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    mod = cupy.RawModule(code=SOURCE, options=("--std=c++17",))
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    rng = np.random.default_rng(0)
    # contiguous; pages of 16 rows scattered; 16-row pages scattered with 8 rows between
    # neighbouring rows of a page (the NHD layout with 8 kv heads: 256 B every 2 KiB)
    contiguous = np.arange(rows, dtype=np.int32)
    pages = rng.permutation(rows // 16).astype(np.int32)
    scattered = (pages[:, None] * 16 + np.arange(16, dtype=np.int32)).reshape(-1)
    heads = (rng.permutation(rows // 128)[:, None, None] * 128 + np.arange(16)[None, :, None] * 8
             + np.arange(8)[None, None, :]).transpose(0, 2, 1).reshape(-1).astype(np.int32)
    stream = cupy.cuda.get_current_stream()
    print(f"{'order':>12} {'kernel':>15} {'ctas/SM':>8} {'GB/s':>8}")
    half = cupy.ones(nbytes // 8, dtype=cupy.uint32)     # K and V halves for the KV variant
    half2 = cupy.ones(nbytes // 8, dtype=cupy.uint32)
    for order_name, order in (("contiguous", contiguous), ("pages", scattered), ("nhd_heads", heads)):
        index = cupy.asarray(order)
        index_half = cupy.asarray(order[order < rows // 2])   # rows of a half-size K or V buffer
        for name in ("stream_ldg", "stream_cg", "stream_cg_pt", "stream_cg_kv", "stream_ca", "stream_cg_l2pf"):
            kern = mod.get_function(name)
            kv = name.endswith("_kv")
            smem = 3 * 64 * 256 * (2 if kv else 1)
            kern.max_dynamic_shared_size_bytes = smem
            for per_sm in (2, 4):
                ctas = sms * per_sm
                tiles = rows // 64 // ctas // (2 if kv else 1)
                args = (half, index_half, np.int32(tiles), sink, half2) if kv else (buf, index, np.int32(tiles), sink)
                launch = lambda: kern((ctas,), (128,), args, shared_mem=smem)
                launch()
                us = median_us_per_call(cupy_timer(launch, stream), trials=5, min_trial_ms=20.0)
                gbps = ctas * tiles * 64 * 256 * (2 if kv else 1) / (us * 1e-6) / 1e9
                print(f"{order_name:>12} {name:>15} {per_sm:>8} {gbps:8.0f}", flush=True)

if __name__ == "__main__":
    main()
