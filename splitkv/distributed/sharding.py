"""Which rank owns which part of the KV: pure functions on page tables, no GPU.

Context parallelism cuts every request's tokens into one contiguous range per rank, on page
boundaries (a page lives on one rank only). Request b with P pages gives rank r the pages
``[P * r // R, P * (r + 1) // R)``, so the ranges differ by at most one page and the partial last
page, if any, goes to the last rank. Worked example, page_size 16, 4 ranks:

    100 tokens = 7 pages  ->  pages [0,1) [1,3) [3,5) [5,7)  ->  tokens 16, 32, 32, 20
    3 tokens   = 1 page   ->  ranks 0-2 get nothing (attention over nothing: zeros, LSE -inf),
                              rank 3 gets the 3 tokens

Head parallelism (tensor parallelism) cuts the heads instead: ``head_shard`` gives each rank a
contiguous block of KV heads and the query heads that read them.
"""

from __future__ import annotations

import numpy as np

from ..core import validation as V
from ..core.problem import PageTable


def shard_page_ranges(page_table: PageTable, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Pages of each request owned by each rank: (first_page, end_page), int64
    [num_ranks, batch_size], as offsets into the request's own page list."""
    V.check_instance("page_table", page_table, PageTable)
    num_ranks = V.check_int("num_ranks", num_ranks, 1)
    pages = np.diff(page_table.kv_indptr)
    r = np.arange(num_ranks + 1, dtype=np.int64)[:, None]
    bounds = pages[None, :] * r // num_ranks               # [num_ranks + 1, batch]
    return bounds[:-1], bounds[1:]


def shard_token_ranges(page_table: PageTable, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of each request owned by each rank: (start, end), int64 [num_ranks, batch_size];
    ``end - start`` is the rank's length for that request (0 where it owns nothing)."""
    first, end = shard_page_ranges(page_table, num_ranks)
    lens = page_table.kv_lens[None, :]
    size = page_table.page_size
    return np.minimum(first * size, lens), np.minimum(end * size, lens)


def shard_page_table(page_table: PageTable, num_ranks: int) -> list[PageTable]:
    """One PageTable per rank holding that rank's contiguous, page-aligned token range of every
    request (see the module docstring). Every table has the full batch size; page indices are
    the original ones (``compact_page_table`` renumbers them for a rank-local cache)."""
    first, end = shard_page_ranges(page_table, num_ranks)
    start_tok, end_tok = shard_token_ranges(page_table, num_ranks)
    indptr = page_table.kv_indptr
    tables = []
    for r in range(num_ranks):
        counts = end[r] - first[r]
        local_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        take = np.concatenate([np.arange(indptr[b] + first[r, b], indptr[b] + end[r, b])
                               for b in range(page_table.batch_size)] or [np.zeros(0, np.int64)])
        local_len = end_tok[r] - start_tok[r]
        last = np.where(counts > 0, local_len - (counts - 1) * page_table.page_size, 0)
        tables.append(PageTable(local_indptr, page_table.kv_indices[take.astype(np.int64)], last,
                                page_table.page_size))
    return tables


def compact_page_table(page_table: PageTable) -> tuple[PageTable, np.ndarray]:
    """Renumber the pages a table uses to 0..n-1, in order of first use. Returns the new table and
    ``page_ids`` [n], the original index of each new page: a rank's own cache is
    ``k_cache[page_ids]`` (and the same for V)."""
    V.check_instance("page_table", page_table, PageTable)
    page_ids, first_use, local = np.unique(page_table.kv_indices, return_index=True,
                                           return_inverse=True)
    order = np.argsort(first_use, kind="stable")           # new page i = i-th page first used
    rank_of = np.empty_like(order)
    rank_of[order] = np.arange(order.size)
    table = PageTable(page_table.kv_indptr, rank_of[local.reshape(-1)].astype(np.int64),
                      page_table.kv_last_page_len, page_table.page_size)
    return table, page_ids[order].astype(np.int64)


def head_shard(num_qo_heads: int, num_kv_heads: int, rank: int, num_ranks: int) -> tuple[slice, slice]:
    """Head (tensor) parallelism: (qo_heads, kv_heads) slices owned by ``rank``. The KV heads
    are cut into ``num_ranks`` equal blocks and each rank takes the query heads of its block,
    so it needs no exchange: its output is the final output for those heads."""
    hq, hk = V.check_heads(num_qo_heads, num_kv_heads)
    num_ranks = V.check_int("num_ranks", num_ranks, 1)
    rank = V.check_int("rank", rank, 0)
    if rank >= num_ranks:
        raise ValueError(f"rank: expected < num_ranks={num_ranks}, got {rank}")
    if hk % num_ranks:
        raise ValueError(f"num_kv_heads: {hk} is not a multiple of num_ranks={num_ranks}; head "
                         "parallelism gives each rank the same number of KV heads")
    kv_per_rank = hk // num_ranks
    group = hq // hk
    kv = slice(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    return slice(kv.start * group, kv.stop * group), kv
