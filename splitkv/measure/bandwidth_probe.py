"""Times the streaming-read probe (``kernels_cu/read_probe.cu``, launched by
``runtime.probe_kernels``): how fast a plain read of device memory goes with a given launch
shape. Which shapes to try, and why, is the bench's business (``splitkv.bench.bandwidth``) and
the first-use probes' (``measure.first_use_probes``)."""

from __future__ import annotations

from ..runtime.cupy_timers import cupy_timer, current_stream
from ..runtime.probe_kernels import read_probe_launches
from .timing import median_us_per_call


def read_gbps_by_shape(num_bytes: int, trials: int, shapes) -> dict[str, float]:
    """GB/s of the probe over ``num_bytes`` (median of ``trials``) for each launch shape
    ``(grid CTAs per SM, threads per CTA, loads in flight per thread)``, keyed
    'ctas_per_sm x threads x loads'."""
    launches = read_probe_launches(num_bytes, shapes)
    stream = current_stream()
    out = {}
    for ctas_per_sm, threads, loads in shapes:
        launch = launches[(ctas_per_sm, threads, loads)]
        launch()                                             # warm-up (and compile)
        us = median_us_per_call(cupy_timer(launch, stream), trials=trials, min_trial_ms=20.0)
        out[f"{ctas_per_sm}x{threads}x{loads}"] = round(num_bytes / (us * 1e-6) / 1e9, 1)
    return out
