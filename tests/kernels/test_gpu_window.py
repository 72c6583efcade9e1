"""Sliding windows on the GPU: ``plan(window_left=)`` plans only each request's last
window_left + 1 tokens, and the kernels (unchanged: they read a chunk's token range) give the
windowed reference, on every strategy and through a graph-stable wrapper; planned on the
device (``plan_on_device(window_left=)``), the graph-stable wrapper's bits. Chunked local
attention (``attention_chunk_size``) likewise: its plans cover each request's last chunk."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import random_device_array, scattered_page_table
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu


def rel_err(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def plans_match_the_reference(lens, page: int, rng, **variant) -> list:
    """Every strategy, and a graph-stable wrapper, planned with ``variant`` (plan()'s window
    and chunk arguments) give the reference's answer; the graph-stable plan made on the device
    gives the same bits. Returns the plans."""
    pt, num_pages = scattered_page_table(lens, page, rng)
    q = random_device_array((len(lens), 32, 128), "bfloat16", rng)
    k = random_device_array((num_pages, page, 8, 128), "bfloat16", rng)
    v = random_device_array((num_pages, page, 8, 128), "bfloat16", rng)
    ref_o, ref_lse = reference_decode(q.get(), k.get(), v.get(), pt, **variant)
    plans = []
    for options, plan_kw in (({}, dict(strategy="single")),
                             ({}, dict(num_splits=3, strategy="split_merge")),
                             ({}, dict(num_splits=4, strategy="fused")),
                             ({}, {}),
                             (dict(use_cuda_graph=True, max_batch_size=len(lens),
                                   max_num_pages=pt.kv_indices.size), {})):
        w = BatchDecodeWrapper(32, 8, 128, page, "bfloat16", **options)
        plan = w.plan(pt, **variant, **plan_kw)
        plans.append(plan)
        out, lse = w.run(q, k, v, return_lse=True)
        cupy.cuda.runtime.deviceSynchronize()
        err = rel_err(to_float64(out.get()), ref_o)
        assert err < 1e-2, f"rel err {err:.2e} for {plan}"
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse.get()[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)
        if options:                  # the same variant planned on the device: the same bits
            d = BatchDecodeWrapper(32, 8, 128, page, "bfloat16", **options)
            d.plan_on_device(kv_indptr=cupy.asarray(pt.kv_indptr, cupy.int32),
                             kv_indices=cupy.asarray(pt.kv_indices, cupy.int32),
                             kv_last_page_len=cupy.asarray(pt.kv_last_page_len, cupy.int32),
                             **variant)
            out_d, lse_d = d.run(q, k, v, return_lse=True)
            cupy.cuda.runtime.deviceSynchronize()
            state = d.device_plan_state()
            assert state["error"] is None and state["num_chunks"] == plan.num_chunks, state
            np.testing.assert_array_equal(out_d.get(), out.get())
            np.testing.assert_array_equal(lse_d.get(), lse.get())
    return plans


@pytest.mark.parametrize("window_left", [0, 63, 1000, 4095])
@pytest.mark.parametrize("page", [1, 16])
def test_windowed_plans_match_the_windowed_reference(window_left, page):
    plans_match_the_reference([1, 70, 3000, 0, 9000, 4096, 4097], page,
                              np.random.default_rng(window_left + page), window_left=window_left)


@pytest.mark.parametrize("chunk,window_left", [(8192, -1), (1000, -1), (64, -1), (1000, 300)])
def test_chunked_attention_plans_match_the_chunked_reference(chunk, window_left):
    """``plan(attention_chunk_size=)`` (Llama 4's chunked local attention): the plan covers
    each request's last chunk (with a window, the later start), and the kernels, which read a
    chunk's token range, give the chunked reference; planned on the device, the same bits."""
    lens = [1, 70, 8192, 8193, 0, 9000, 20000, 1000, 1001]
    plans = plans_match_the_reference(lens, 16, np.random.default_rng(chunk + window_left),
                                      window_left=window_left, attention_chunk_size=chunk)
    assert all(plan.problem.attention_chunk_size == chunk for plan in plans)
    pt, _ = scattered_page_table(lens, 16, np.random.default_rng(0))
    with pytest.raises(ValueError, match="chunked attention takes one query row a request"):
        BatchDecodeWrapper(32, 8, 128, 16, "bfloat16").plan(
            pt, qo_indptr=np.array([0, 1, 2, 4, 5, 6, 7, 8, 9, 10]), attention_chunk_size=chunk)
