"""The one timing routine, shared by the benchmark, the calibration sweep and the first-use
probes.

Method: L layers of distinct KV buffers, together at least 1 GiB so
each layer's KV comes from HBM and not L2; one CUDA graph runs one decode call per layer; the
graph is replayed many times; time per call = elapsed / (replays x L), the median of 7 trials
of at least 30 ms each, timed with CUDA events. The CuPy calls (the events, the capture, the
random arrays) are the runtime's (``runtime.cupy_timers``, ``runtime.cupy_arrays``); what is
timed, how often and which statistic is kept is here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.plan import Plan
from ..core.problem import PageTable
from ..runtime.cupy_timers import capture_layers, cupy_timer, synchronize_device


TRIALS = 7
MIN_TRIAL_MS = 30.0
# Replays before the trials: after an idle gap (a kernel compiling, the previous case's set-up)
# the GPU's clocks are down and take a moment to rise: one H200 run timed its first case at
# 9.8 us against 6.75 us warm (docs/design/short-calls.md).
WARMUP_MS = 50.0


def median_us_per_call(run_timed: Callable[[int], float], calls_per_repeat: int = 1, *,
                       trials: int = TRIALS, min_trial_ms: float = MIN_TRIAL_MS) -> float:
    """The benchmark's statistic (the method above) for anything timed with device events.

    ``run_timed(n)`` repeats the timed work n times between two device events and returns the
    elapsed milliseconds; each repeat makes ``calls_per_repeat`` calls (the layers of a graph).
    Each trial repeats enough to last ``min_trial_ms``; the median over ``trials`` is returned in
    microseconds per call. Framework-free, so PyTorch peers are timed the same way.
    """
    one_ms = max(run_timed(1), 1e-3)
    repeats = max(1, math.ceil(min_trial_ms / one_ms))
    samples = [run_timed(repeats) * 1e3 / (repeats * calls_per_repeat) for _ in range(trials)]
    return float(np.median(samples))


def median_host_us(fn: Callable[[], object], repeats: int, *, warmup: int = 0,
                   idle_device: bool = False) -> float:
    """Median host microseconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed
    ones. ``idle_device``: synchronize the GPU (untimed) before each call, as in a decode loop
    where the previous step's copies finished long ago."""
    for _ in range(warmup):
        fn()
    samples = np.empty(repeats)
    for i in range(repeats):
        if idle_device:
            synchronize_device()
        t0 = time.perf_counter_ns()
        fn()
        samples[i] = time.perf_counter_ns() - t0
    return float(np.median(samples)) / 1e3


def time_graph_us(launch_layer: Callable[[int, object], None], num_layers: int, *,
                  trials: int = TRIALS, min_trial_ms: float = MIN_TRIAL_MS, stream=None) -> float:
    """Median microseconds per layer call of ``launch_layer(layer, stream)`` over replays of a
    CUDA graph of all the layers (``runtime.cupy_timers.capture_layers``: each layer launched
    once first), after ``WARMUP_MS`` of replays."""
    replay, stream = capture_layers(launch_layer, num_layers, stream)
    run_timed = cupy_timer(replay, stream)
    one_ms = max(run_timed(1), 1e-3)
    run_timed(math.ceil(WARMUP_MS / one_ms))
    return median_us_per_call(run_timed, num_layers, trials=trials, min_trial_ms=min_trial_ms)


def layers_for(bytes_per_layer: int, min_total_bytes: int = 1 << 30) -> int:
    """Enough layers that together they hold ``min_total_bytes`` (2..64)."""
    return int(min(64, max(2, math.ceil(min_total_bytes / max(1, bytes_per_layer)))))


@dataclass
class LayeredKV:
    """Random q and L layers of K/V pools for one page table, on the device."""

    q: object
    k_layers: list
    v_layers: list
    out: object
    num_pages: int

    @property
    def num_layers(self) -> int:
        return len(self.k_layers)

    def non_finite(self, kv_dtype: str | None = None) -> dict:
        """{array name: (non-finite elements, the first one's flat index)} over q and every K/V
        layer (fp8 codes: the format's NaN and Inf codes); empty where all are finite. The
        data is random and finite when made, so anything here was written by a kernel since
        (the bench checks this before its error check, so that an error that comes from data a
        kernel overwrote is reported as such)."""

        def bad_16bit(a):                   # bfloat16 as uint16 bits, or float16
            if a.dtype == np.float16:        # exponent all ones: Inf or NaN
                return (a.view(np.uint16) & 0x7C00) == 0x7C00
            return (a & 0x7F80) == 0x7F80

        def bad_codes(a):
            if kv_dtype == "float8_e4m3fn":  # no infinities; NaN is S.1111.111
                return (a & 0x7F) == 0x7F
            return (a & 0x7C) == 0x7C        # e5m2: exponent all ones (Inf and NaN)

        bad = bad_codes if kv_dtype else bad_16bit
        found = {}
        arrays = [("q", bad_16bit(self.q))]
        arrays += [(f"k[{i}]", bad(a)) for i, a in enumerate(self.k_layers)]
        arrays += [(f"v[{i}]", bad(a)) for i, a in enumerate(self.v_layers)]
        for name, mask in arrays:
            n = int(mask.sum())
            if n:
                found[name] = (n, int(mask.ravel().nonzero()[0][0]))
        return found


def make_layers(page_table: PageTable, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                dtype: str, *, min_total_bytes: int = 1 << 30, seed: int = 0,
                kv_dtype: str | None = None) -> LayeredKV:
    """``kv_dtype`` (an fp8 format): K and V are random fp8 codes of magnitude <= 8
    (``random_fp8_codes``), one byte each, so twice the layers hold the same bytes."""
    from ..runtime.arrays import cupy_storage_dtype
    from ..runtime.cupy_arrays import empty, random_device_array_fast, random_fp8_codes

    num_pages = int(page_table.kv_indices.max()) + 1 if page_table.kv_indices.size else 1
    shape = (num_pages, page_table.page_size, num_kv_heads, head_dim)
    bytes_per_layer = 2 * (1 if kv_dtype else 2) * int(np.prod(shape))
    layers = layers_for(bytes_per_layer, min_total_bytes)
    batch = page_table.batch_size
    q = random_device_array_fast((batch, num_qo_heads, head_dim), dtype, seed)
    if kv_dtype:
        make = lambda i: random_fp8_codes(shape, kv_dtype, i)    # noqa: E731
    else:
        make = lambda i: random_device_array_fast(shape, dtype, i)    # noqa: E731
    ks = [make(seed + 1 + 2 * i) for i in range(layers)]
    vs = [make(seed + 2 + 2 * i) for i in range(layers)]
    out = empty((batch, num_qo_heads, head_dim), cupy_storage_dtype(dtype))
    # filled on the current stream: the timed runs go on others, so the data is there first
    synchronize_device()
    return LayeredKV(q, ks, vs, out, num_pages)


def time_wrapper_us(wrapper, data: LayeredKV, *, trials: int = TRIALS,
                    min_trial_ms: float = MIN_TRIAL_MS, **run_args) -> float:
    """Time ``wrapper.run`` (already planned) over the layers of ``data``; ``run_args`` go to
    every run (``sinks=``, fp8 scales)."""

    def launch(layer, stream):
        wrapper.run(data.q, data.k_layers[layer], data.v_layers[layer], out=data.out, stream=stream,
                    **run_args)

    return time_graph_us(launch, data.num_layers, trials=trials, min_trial_ms=min_trial_ms)


_LAST_LAYERS: dict = {}   # one entry: (page table, shapes) -> LayeredKV


def release_cached_layers() -> None:
    """Free the KV layers ``time_plan_us`` keeps for the last page table it timed."""
    _LAST_LAYERS.clear()


def time_plan_us(plan: Plan, page_table: PageTable, *, min_total_bytes: int = 1 << 30,
                 trials: int = TRIALS, min_trial_ms: float = MIN_TRIAL_MS, data: LayeredKV | None = None,
                 experiments=None, kv_dtype: str | None = None) -> float:
    """Median microseconds per call of ``plan`` on random data, run by a wrapper with
    ``experiments`` (a ``DecodeExperiments``, or a function of the plan's problem giving one;
    None: the shipped kernel), over fp8 K/V codes if ``kv_dtype`` names an fp8 format.

    Without ``data``, the random KV layers (about ``min_total_bytes``) are built for the page
    table and kept for the next call with the same table and shapes, so timing several plans
    of one batch in a row (a calibration sweep) fills the memory once;
    ``release_cached_layers()`` frees them.
    """
    from ..runtime.wrapper import BatchDecodeWrapper

    p = plan.problem
    if callable(experiments):
        experiments = experiments(p)
    if data is None:
        key = (id(page_table), p.num_qo_heads, p.num_kv_heads, p.head_dim, p.dtype, kv_dtype,
               min_total_bytes)
        if key not in _LAST_LAYERS:
            _LAST_LAYERS.clear()
            _LAST_LAYERS[key] = (page_table, make_layers(page_table, p.num_qo_heads, p.num_kv_heads,
                                                         p.head_dim, p.dtype,
                                                         min_total_bytes=min_total_bytes,
                                                         kv_dtype=kv_dtype))
        data = _LAST_LAYERS[key][1]      # the entry holds the table too, so its id stays unique
    w = BatchDecodeWrapper(p.num_qo_heads, p.num_kv_heads, p.head_dim, p.page_size, p.dtype,
                           experiments=experiments, kv_dtype=kv_dtype)
    w.plan(page_table, plan=plan)
    return time_wrapper_us(w, data, trials=trials, min_trial_ms=min_trial_ms)
