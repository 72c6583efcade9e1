"""Random decode batches on the GPU, shared by the GPU tests, the demo, the benchmark and the
calibration sweep: pages scattered at random through a pool, fresh random values each time."""

from __future__ import annotations

import numpy as np

from ..problem import PageTable


def float_to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """Host float array -> 16-bit storage: float16 array, or bfloat16 bits as uint16
    (round to nearest even)."""
    if dtype == "float16":
        return x.astype(np.float16)
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def scattered_page_table(kv_lens, page_size: int, rng: np.random.Generator,
                         extra_pages: int = 3) -> tuple[PageTable, int]:
    """Pages of every request drawn without replacement from a shuffled pool. Returns the
    table and the pool size (a few unused pages are left so out-of-range reads would show)."""
    lens = np.asarray(kv_lens, dtype=np.int64)
    pages = -(-lens // page_size)
    num_pages = int(pages.sum()) + extra_pages
    perm = rng.permutation(num_pages)[: int(pages.sum())]
    indptr = np.concatenate([[0], np.cumsum(pages)])
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0)
    return PageTable.from_flashinfer(indptr, perm, last, page_size, num_pages), num_pages


def random_device_array(shape, dtype: str, rng: np.random.Generator, scale: float = 1.0):
    """A CuPy array of random normal values in 16-bit storage (bfloat16 as uint16 bits)."""
    import cupy

    host = float_to_bits(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)
    return cupy.asarray(host)


def random_device_array_fast(shape, dtype: str, seed: int):
    """Large random arrays generated on the device (benchmark-sized KV pools)."""
    import cupy

    gen = cupy.random.default_rng(seed)
    x = gen.standard_normal(shape, dtype=cupy.float32)
    if dtype == "float16":
        return x.astype(cupy.float16)
    return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)
