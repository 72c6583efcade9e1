"""Random paged decode batches, built on the host: what the host and GPU tests feed the paths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitkv import DecodeProblem, PageTable
from splitkv.testing import scattered_page_table


@dataclass
class PagedBatch:
    """q [B, Hq, D]; k_cache, v_cache [num_pages, page_size, Hk, D] (NHD); pages scattered."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    page_table: PageTable
    problem: DecodeProblem


def build_batch(rng: np.random.Generator, kv_lens, num_qo_heads: int = 4, num_kv_heads: int = 2,
               head_dim: int = 64, page_size: int = 16, dtype=np.float64, spare_pages: int = 3,
               q_scale: float = 1.0) -> PagedBatch:
    """A decode batch whose pages are a random permutation of a pool with a few unused pages."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    page_table, num_pages = scattered_page_table(kv_lens, page_size, rng, spare_pages)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    q = (q_scale * rng.standard_normal((kv_lens.size, num_qo_heads, head_dim))).astype(dtype)
    k_cache = rng.standard_normal(shape).astype(dtype)
    v_cache = rng.standard_normal(shape).astype(dtype)
    problem = DecodeProblem.from_page_table(page_table, num_qo_heads, num_kv_heads, head_dim)
    return PagedBatch(q, k_cache, v_cache, page_table, problem)


def host_decode_inputs(rng: np.random.Generator, kv_lens) -> dict:
    """q, k_cache, v_cache (float64, 8/2 heads, head_dim 64, pages 0..3 of 16 tokens), the page
    table of two requests of ``kv_lens`` tokens, and a 2-split plan: the host paths' inputs."""
    from splitkv import plan_fixed_splits

    pt = PageTable.from_block_table([[2, 0], [1, 3]], kv_lens, 16, num_pages=4)
    q = rng.standard_normal((2, 8, 64))
    k = rng.standard_normal((4, 16, 2, 64))
    v = rng.standard_normal((4, 16, 2, 64))
    plan = plan_fixed_splits(DecodeProblem.from_page_table(pt, 8, 2, 64), 2)
    return dict(q=q, k_cache=k, v_cache=v, page_table=pt, plan=plan)
