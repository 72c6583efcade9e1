"""Random paged batches for tests, the demo, the benchmark and the calibration sweep: each
request's pages drawn from a shuffled pool with a few pages to spare, as a serving engine
leaves them. Pure NumPy (the device-side helpers are in ``splitkv.measure.test_data``)."""

from __future__ import annotations

import numpy as np

from .core.problem import PageTable


def scattered_block_table(kv_lens, page_size: int, rng: np.random.Generator,
                          spare_pages: int = 3) -> tuple[np.ndarray, int]:
    """vLLM-style ``block_table`` (rows padded with -1, never read) whose pages are a random
    permutation of a pool of ``needed + spare_pages`` pages. Returns (table, pool size)."""
    lens = np.asarray(kv_lens, dtype=np.int64)
    pages = -(-lens // page_size)
    num_pages = int(pages.sum()) + spare_pages
    perm = rng.permutation(num_pages)
    table = np.full((lens.size, max(1, int(pages.max()) if pages.size else 1)), -1, dtype=np.int64)
    starts = np.cumsum(pages) - pages
    for b, (lo, n) in enumerate(zip(starts, pages)):
        table[b, :n] = perm[lo:lo + n]
    return table, num_pages


def scattered_page_table(kv_lens, page_size: int, rng: np.random.Generator,
                         extra_pages: int = 3) -> tuple[PageTable, int]:
    """The same as a ``PageTable``. Returns (table, pool size)."""
    table, num_pages = scattered_block_table(kv_lens, page_size, rng, extra_pages)
    return PageTable.from_block_table(table, kv_lens, page_size, num_pages=num_pages), num_pages


def block_table_of(page_table: PageTable, width: int | None = None, pad: int = -1,
                   dtype=np.int32) -> np.ndarray:
    """``page_table`` as vLLM's ``block_table`` [batch, width] (default: the most pages a
    request has, at least 1), each row's unused entries ``pad`` (never read)."""
    pages = np.diff(page_table.kv_indptr)
    if width is None:
        width = max(1, int(pages.max(initial=0)))
    table = np.full((page_table.batch_size, width), pad, dtype)
    for b, start in enumerate(page_table.kv_indptr[:-1]):
        table[b, :pages[b]] = page_table.kv_indices[start:start + pages[b]]
    return table
