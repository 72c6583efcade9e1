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
    from ..runtime.timing import cupy_timer, median_us_per_call

    buf = cupy.empty(num_bytes // 4, dtype=cupy.uint32)
    buf.fill(1)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    kernel = cupy.RawKernel(_READ_KERNEL, "stream_read")
    n = np.int64(num_bytes // 16)
    grid = (device_info()["num_sms"] * ctas_per_sm,)
    stream = cupy.cuda.get_current_stream()
    kernel(grid, (512,), (buf, n, sink))                 # warm-up
    us = median_us_per_call(cupy_timer(lambda: kernel(grid, (512,), (buf, n, sink)), stream),
                            trials=trials, min_trial_ms=20.0)
    return num_bytes / (us * 1e-6) / 1e9
