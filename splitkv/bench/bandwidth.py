"""Streaming-read bandwidth of the GPU, measured in the same run as the decode cases."""

from __future__ import annotations

import numpy as np

_READ_KERNEL = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ src, long long n, unsigned* sink) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    uint4 v = src[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;   // keeps the loads alive; practically never stores
}
"""


def read_bandwidth_gbps(num_bytes: int = 4 << 30, ctas_per_sm: int = 8, trials: int = 7) -> float:
    """GB/s of a grid-stride 16-byte-load read over ``num_bytes`` (median of trials)."""
    import cupy

    from ..runtime import device_info

    buf = cupy.empty(num_bytes // 4, dtype=cupy.uint32)
    buf.fill(1)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    kernel = cupy.RawKernel(_READ_KERNEL, "stream_read")
    n = np.int64(num_bytes // 16)
    grid = (device_info()["num_sms"] * ctas_per_sm,)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    kernel(grid, (512,), (buf, n, sink))
    times = []
    for _ in range(trials):
        start.record()
        kernel(grid, (512,), (buf, n, sink))
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e-3)
    del buf
    return num_bytes / float(np.median(times)) / 1e9
