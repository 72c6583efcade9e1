"""Launches and times the streaming-read probe (``kernels_cu/read_probe.cu``): how fast a plain
read of device memory goes with a given launch shape. Which shapes to try, and why, is the
bench's business (``splitkv.bench.bandwidth``)."""

from __future__ import annotations

import numpy as np

from .kernel_source import read_source


def read_kernel_source(loads: int) -> str:
    """The probe's CUDA source with ``loads`` 16-byte loads in flight per thread."""
    return f"#define LOADS {int(loads)}\n" + read_source("read_probe.cu")


def read_gbps_by_shape(num_bytes: int, trials: int, shapes) -> dict[str, float]:
    """GB/s of the probe over ``num_bytes`` (median of ``trials``) for each launch shape
    ``(grid CTAs per SM, threads per CTA, loads in flight per thread)``, keyed
    'ctas_per_sm x threads x loads'."""
    import cupy

    from . import device_info
    from .timing import cupy_timer, median_us_per_call

    buf = cupy.empty(num_bytes // 4, dtype=cupy.uint32)
    buf.fill(1)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    n = np.int64(num_bytes // 16)
    num_sms = device_info()["num_sms"]
    stream = cupy.cuda.get_current_stream()
    kernels = {loads: cupy.RawKernel(read_kernel_source(loads), "stream_read")
               for loads in sorted({s[2] for s in shapes})}
    out = {}
    for ctas_per_sm, threads, loads in shapes:
        kernel, grid, block = kernels[loads], (num_sms * ctas_per_sm,), (threads,)

        def launch():
            kernel(grid, block, (buf, n, sink))

        launch()                                             # warm-up (and compile)
        us = median_us_per_call(cupy_timer(launch, stream), trials=trials, min_trial_ms=20.0)
        out[f"{ctas_per_sm}x{threads}x{loads}"] = round(num_bytes / (us * 1e-6) / 1e9, 1)
    return out
