"""Shared fixtures: seeded randomness and random paged decode batches, built on the host.

Tests marked ``gpu`` are skipped, with the reason, when ``splitkv.runtime.gpu_available()``
says there is no usable GPU (or the runtime cannot be imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

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


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def make_batch(rng):
    """``make_batch(kv_lens, **kwargs)``: ``build_batch`` with this test's seeded generator."""
    return lambda kv_lens, **kwargs: build_batch(rng, kv_lens, **kwargs)


# NVRTC's register and spill report of each kernel variant the compile tests built
# (test_kernels_compile.py), printed after a verbose run (pytest -v) only: a plain run is quiet.
REGISTER_REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter, config):
    if REGISTER_REPORT and config.option.verbose > 0:
        terminalreporter.section(f"NVRTC register report ({len(REGISTER_REPORT)} builds)")
        for line in REGISTER_REPORT:
            terminalreporter.write_line(line)


def _skip_unless(items, marker: str, check) -> None:
    """Skip ``items`` marked ``marker``, with the reason, unless ``check()`` says (True, _)."""
    marked = [item for item in items if item.get_closest_marker(marker)]
    if not marked:
        return
    try:
        ok, reason = check()
    except Exception as exc:   # no runtime, no CuPy, no driver: all mean "not usable here"
        ok, reason = False, f"splitkv.runtime unusable: {type(exc).__name__}: {exc}"
    if not ok:
        skip = pytest.mark.skip(reason=reason)
        for item in marked:
            item.add_marker(skip)


def _gpu_check():
    from splitkv.runtime import gpu_available
    ok, reason = gpu_available()
    return ok, f"no usable GPU: {reason}"


def _nvrtc_check():
    from splitkv.runtime import nvrtc_available
    ok, reason = nvrtc_available()
    return ok, f"no NVRTC: {reason}"


def pytest_collection_modifyitems(config, items):
    _skip_unless(items, "gpu", _gpu_check)
    _skip_unless(items, "nvrtc", _nvrtc_check)
