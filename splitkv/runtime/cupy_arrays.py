"""The CuPy array calls that code outside the runtime makes (the merge, the demo, the bench,
the measuring code's random data, context parallelism), so that only ``splitkv.runtime``
imports CuPy. CuPy is imported when a function runs, never at import: host code that only ever
sees NumPy arrays works without it."""

from __future__ import annotations

import numpy as np


def to_device(host):
    """A CuPy copy of a host array, on the current stream."""
    import cupy

    return cupy.asarray(host)


def to_host(arr) -> np.ndarray:
    """A NumPy copy of a CuPy array."""
    import cupy

    return cupy.asnumpy(arr)


def empty(shape, dtype):
    """An uninitialised CuPy array, from the current allocator."""
    import cupy

    return cupy.empty(shape, dtype=dtype)


def full(shape, value, dtype):
    """A CuPy array of ``shape`` filled with ``value``."""
    import cupy

    return cupy.full(shape, value, dtype)


def random_device_array_fast(shape, dtype: str, seed: int):
    """Random normal values generated on the device, in 16-bit storage (float16, or bfloat16
    as uint16 bits by truncation): benchmark-sized KV pools."""
    import cupy

    gen = cupy.random.default_rng(seed)
    x = gen.standard_normal(shape, dtype=cupy.float32)
    if dtype == "float16":
        return x.astype(cupy.float16)
    return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)


# The largest code of magnitude <= 8 in each fp8 format (8 = 2**3: exponent field 3 + bias).
_FP8_CODE_OF_8 = {"float8_e4m3fn": 0x50, "float8_e5m2": 0x48}


def random_fp8_codes(shape, kv_dtype: str, seed: int):
    """Random finite fp8 codes of magnitude <= 8 (uint8, on the device): every code from 0 up
    to that of 8, either sign, uniformly (so values spread over the format's exponents)."""
    import cupy

    gen = cupy.random.default_rng(seed)
    codes = gen.integers(0, _FP8_CODE_OF_8[kv_dtype] + 1, shape, dtype=cupy.uint8)
    signs = gen.integers(0, 2, shape, dtype=cupy.uint8) << 7
    return codes | signs


def zero_padded_rows(arr, rows: int):
    """A CuPy copy of ``arr`` with ``rows`` rows along axis 0: its own, then zeros."""
    import cupy

    out = cupy.zeros((rows, *arr.shape[1:]), dtype=arr.dtype)
    out[:arr.shape[0]] = arr
    return out


def check_cupy_array(name: str, arr) -> None:
    """Raise TypeError unless ``arr`` is a CuPy array."""
    import cupy

    if not isinstance(arr, cupy.ndarray):
        raise TypeError(f"{name}: expected a CuPy array, got {type(arr).__name__}")


def new_memory_pool():
    """A CuPy memory pool of its own, for ``allocating_from``."""
    import cupy

    return cupy.cuda.MemoryPool()


def allocating_from(pool):
    """Context manager: CuPy allocations inside it come from ``pool``."""
    import cupy

    return cupy.cuda.using_allocator(pool.malloc)


def free_cached_blocks() -> None:
    """Give the blocks CuPy's default pool keeps for reuse back to the device."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
