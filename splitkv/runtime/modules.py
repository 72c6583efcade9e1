"""Compiled kernels, cached per (device, variant) in this process."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .kernel_source import NVRTC_OPTIONS, DecodeVariant


@dataclass
class DecodeKernels:
    variant: DecodeVariant
    partial: object      # cupy.RawKernel decode_partial
    merge: object        # cupy.RawKernel merge_partials
    compile_seconds: float


_CACHE: dict[tuple[int, DecodeVariant], DecodeKernels] = {}


def get_decode_kernels(variant: DecodeVariant) -> DecodeKernels:
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (device, variant)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    module = cupy.RawModule(code=variant.source(), options=NVRTC_OPTIONS, name_expressions=None)
    partial = module.get_function("decode_partial")
    merge = module.get_function("merge_partials")
    partial.max_dynamic_shared_size_bytes = variant.shared_bytes
    kernels = DecodeKernels(variant, partial, merge, time.perf_counter() - t0)
    _CACHE[key] = kernels
    return kernels


def compile_seconds_so_far() -> float:
    """Total NVRTC + module load time spent in this process (the first-call cost)."""
    return sum(k.compile_seconds for k in _CACHE.values())
