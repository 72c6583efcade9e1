"""Compiled kernels, cached per (device, build) in this process and shared by every wrapper:
nothing about them changes after they are loaded. A module comes from splitkv's cache of
precompiled CUBINs where ``splitkv precompile`` put it there (``cubin_cache``), else from NVRTC
through CuPy (whose own disk cache may hold it); ``module_origins`` counts each, so a test can
say that a process compiled nothing."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from .kernel_source import NVRTC_OPTIONS, KernelBuild

CUBIN, NVRTC = "cubin", "nvrtc"      # where a module came from
PLANNER_LABEL = "device_plan"        # the planning kernel's name in the cubin cache


@dataclass(frozen=True)
class DecodeKernels:
    build: KernelBuild
    partial: object      # cupy.RawKernel decode_partial
    merge: object        # cupy.RawKernel merge_partials
    one_per_sm_shared_bytes: int   # dynamic shared memory that places one partial CTA per SM
    compile_seconds: float         # NVRTC (or loading the precompiled CUBIN) and the setup here
    origin: str = NVRTC            # CUBIN: splitkv's precompiled file; NVRTC: compiled by CuPy


_CACHE: dict[tuple[int, KernelBuild], DecodeKernels] = {}
_ORIGINS: Counter = Counter()
_ORIGINS_LOCK = threading.Lock()


def current_arch() -> str:
    """NVRTC's ``-arch`` of a CUBIN for the current device: ``sm_<major><minor>``."""
    from . import device_info

    return f"sm_{device_info()['cc']}"


def load_module(source: str, options, label: str):
    """``(cupy.RawModule, origin)`` of ``source`` compiled with NVRTC ``options`` for the
    current device, loaded: splitkv's precompiled CUBIN of exactly this source, options,
    architecture and NVRTC where the cache holds a whole one (``cubin_cache.cached_cubin``;
    one the driver refuses is skipped with a notice), else compiled by CuPy. ``label``:
    the module's name in the cache (letters, digits, underscores)."""
    import cupy

    from .cubin_cache import cached_cubin, skip_cubin

    path = cached_cubin(label, source, options, current_arch())
    module = origin = None
    if path is not None:
        module = cupy.RawModule(path=str(path))
        try:
            module.compile()                 # loads the file: the driver checks the image
            origin = CUBIN
        except Exception as exc:             # a damaged image the ELF check let through
            skip_cubin(path, f"the CUDA driver refused it: {type(exc).__name__}: {exc}")
    if origin is None:
        module = cupy.RawModule(code=source, options=tuple(options))
        module.compile()
        origin = NVRTC
    with _ORIGINS_LOCK:
        _ORIGINS[origin] += 1
    return module, origin


def get_decode_kernels(build: KernelBuild) -> DecodeKernels:
    import cupy

    from .device_features import one_per_sm_shared_bytes

    device = cupy.cuda.runtime.getDevice()
    key = (device, build)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    module, origin = load_module(build.source(), NVRTC_OPTIONS, build.name)
    partial = module.get_function("decode_partial")
    merge = module.get_function("merge_partials")
    # The opt-in covers both sizes a launch may ask for, set once here: a launch never changes
    # an attribute of the kernel every wrapper shares.
    spread = one_per_sm_shared_bytes(build.shared_bytes)
    limit = cupy.cuda.runtime.deviceGetAttribute(
        cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
    if build.shared_bytes + partial.shared_size_bytes > limit:
        raise RuntimeError(f"{build.name}: needs {build.shared_bytes:,} bytes of shared "
                           f"memory per block, this GPU allows {limit:,} (e.g. fp8 K/V at "
                           f"head_dim 256 fits an H100/H200, not an A100)")
    partial.max_dynamic_shared_size_bytes = min(max(build.shared_bytes, spread),
                                                limit - partial.shared_size_bytes)
    kernels = DecodeKernels(build, partial, merge, spread, time.perf_counter() - t0, origin)
    _CACHE[key] = kernels
    return kernels


def compile_seconds_so_far() -> float:
    """Total NVRTC + module load time spent in this process (the first-call cost)."""
    return sum(k.compile_seconds for k in _CACHE.values())


def module_origins() -> dict[str, int]:
    """Modules loaded in this process (by ``load_module``), by where each came from:
    {"cubin": precompiled, "nvrtc": compiled by CuPy}."""
    with _ORIGINS_LOCK:
        return {CUBIN: _ORIGINS[CUBIN], NVRTC: _ORIGINS[NVRTC]}


def nvrtc_compiles() -> int:
    """Modules this process compiled through CuPy rather than loaded precompiled (CuPy's own
    disk cache may have spared NVRTC some of them): 0 after ``splitkv precompile`` covered
    everything it ran."""
    return module_origins()[NVRTC]
