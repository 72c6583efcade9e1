"""The two kernels ``splitkv.measure`` times besides the decode kernels, compiled and bound to
their buffers here and timed there: an empty kernel (what a launch costs, in a CUDA graph and
alone) and the streaming-read probe (``kernels_cu/read_probe.cu``: how fast a plain read of
device memory goes with a given launch shape). Which shapes to try, and why, is the bench's
business (``splitkv.bench.bandwidth``) and the first-use probes'
(``measure/first_use_probes.py``)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .kernel_source import read_source

EMPTY_KERNEL = "splitkv_first_use_empty"
EMPTY_SOURCE = f'extern "C" __global__ void {EMPTY_KERNEL}() {{}}'


def empty_kernel_launch() -> Callable[[], None]:
    """A callable that launches an empty kernel of one warp on the current stream."""
    import cupy

    kernel = cupy.RawKernel(EMPTY_SOURCE, EMPTY_KERNEL)

    def launch() -> None:
        kernel((1,), (32,), ())

    return launch


def read_kernel_source(loads: int) -> str:
    """The probe's CUDA source with ``loads`` 16-byte loads in flight per thread."""
    return f"#define LOADS {int(loads)}\n" + read_source("read_probe.cu")


def read_probe_launches(num_bytes: int, shapes) -> dict[tuple, Callable[[], None]]:
    """{shape: a callable that launches the streaming read over ``num_bytes`` of device memory
    on the current stream} for each launch shape ``(grid CTAs per SM, threads per CTA, loads
    in flight per thread)``; the buffer is allocated and filled once, for all of them. A
    kernel compiles at its first launch."""
    import cupy

    from . import device_info

    buf = cupy.empty(num_bytes // 4, dtype=cupy.uint32)
    buf.fill(1)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    n = np.int64(num_bytes // 16)
    num_sms = device_info()["num_sms"]
    kernels = {loads: cupy.RawKernel(read_kernel_source(loads), "stream_read")
               for loads in sorted({s[2] for s in shapes})}

    def launcher(ctas_per_sm: int, threads: int, loads: int) -> Callable[[], None]:
        kernel, grid, block = kernels[loads], (num_sms * ctas_per_sm,), (threads,)

        def launch() -> None:
            kernel(grid, block, (buf, n, sink))

        return launch

    return {tuple(shape): launcher(*shape) for shape in shapes}
