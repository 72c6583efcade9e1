"""Compiled kernels, cached per (device, variant) in this process and shared by every wrapper:
nothing about them changes after they are loaded."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .kernel_source import NVRTC_OPTIONS, DecodeVariant


@dataclass(frozen=True)
class DecodeKernels:
    variant: DecodeVariant
    partial: object      # cupy.RawKernel decode_partial
    merge: object        # cupy.RawKernel merge_partials
    one_per_sm_shared_bytes: int   # dynamic shared memory that places one partial CTA per SM
    compile_seconds: float


_CACHE: dict[tuple[int, DecodeVariant], DecodeKernels] = {}


def get_decode_kernels(variant: DecodeVariant) -> DecodeKernels:
    import cupy

    from .features import one_per_sm_shared_bytes

    device = cupy.cuda.runtime.getDevice()
    key = (device, variant)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    module = cupy.RawModule(code=variant.source(), options=NVRTC_OPTIONS, name_expressions=None)
    partial = module.get_function("decode_partial")
    merge = module.get_function("merge_partials")
    # The opt-in covers both sizes a launch may ask for, set once here: a launch never changes
    # an attribute of the kernel every wrapper shares.
    spread = one_per_sm_shared_bytes(variant.shared_bytes)
    limit = cupy.cuda.runtime.deviceGetAttribute(
        cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
    if variant.shared_bytes + partial.shared_size_bytes > limit:
        raise RuntimeError(f"{variant.name}: needs {variant.shared_bytes:,} bytes of shared "
                           f"memory per block, this GPU allows {limit:,} (e.g. fp8 K/V at "
                           f"head_dim 256 fits an H100/H200, not an A100)")
    partial.max_dynamic_shared_size_bytes = min(max(variant.shared_bytes, spread),
                                                limit - partial.shared_size_bytes)
    kernels = DecodeKernels(variant, partial, merge, spread, time.perf_counter() - t0)
    _CACHE[key] = kernels
    return kernels


def compile_seconds_so_far() -> float:
    """Total NVRTC + module load time spent in this process (the first-call cost)."""
    return sum(k.compile_seconds for k in _CACHE.values())
