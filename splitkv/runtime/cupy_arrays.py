"""The CuPy array calls that code outside the runtime makes (the merge, the demo, the bench,
context parallelism), so that only ``splitkv.runtime`` imports CuPy. CuPy is imported when a
function runs, never at import: host code that only ever sees NumPy arrays works without it."""

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
