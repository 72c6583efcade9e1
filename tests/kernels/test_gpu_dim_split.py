"""The head-dim split experiment (``DecodeExperiments(dim_split=2)``: pairs of warps compute the
same scores and each accumulates half of O's dims, WARPS_D = 2, 8 warps a CTA) against the
float64 reference: head_dim 256 and 128, every strategy and the cluster merge, partial tiles,
two row tiles, multi-token rows under a window, sinks and the soft cap, and a graph-stable
wrapper planned on the host and on the device."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import (assert_matches_reference, assert_paths_match_reference,
                                     plan_and_run, random_device_array, random_kv_caches,
                                     scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

LENS = [3000, 63, 0, 65, 700]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4), ("split_merge", 16)]
SPLIT = DecodeExperiments(dim_split=2)


@pytest.mark.parametrize("d,hq,hk,dtype,q_in_smem", [
    (256, 16, 8, "bfloat16", None), (256, 16, 8, "bfloat16", False), (256, 64, 2, "float16", None),
    (128, 32, 8, "bfloat16", None), (128, 128, 2, "bfloat16", None)])
@pytest.mark.parametrize("page", [16, 1])
def test_the_split_head_dim_matches_the_reference(d, hq, hk, dtype, q_in_smem, page):
    """hq 128 over 2 kv heads: four row tiles, so each token group is all 8 warps (one warp
    of tokens, a 256-thread barrier); page 1: the page walk's per-copy path."""
    rng = np.random.default_rng(d + hq + page)
    pt, pages = scattered_page_table(LENS, page, rng)
    q = random_device_array((len(LENS), hq, d), dtype, rng)
    k, v = random_kv_caches((pages, page, hk, d), dtype, rng)
    w = BatchDecodeWrapper(hq, hk, d, page, dtype,
                           experiments=DecodeExperiments(dim_split=2, q_in_smem=q_in_smem))
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt)
    for strategy, n in PLANS:
        o, lse = plan_and_run(w, pt, q, k, v, strategy=strategy, num_splits=n)
        variant = w.kernel_variant
        assert (variant.dim_split, variant.num_warps, variant.tile_tokens) == (2, 8, 64)
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, f"{strategy}/{n}")


def test_the_split_head_dim_under_clusters_variants_and_graphs():
    def split(w):
        assert w.kernel_variant.dim_split == 2

    rng = np.random.default_rng(9)
    hq, hk, d = 16, 8, 256
    pt, q, k, v, w = assert_paths_match_reference(SPLIT, hq, hk, d, rng, split)
    # multi-token rows under a window, with sinks and the soft cap
    qo_indptr = np.array([0, 3, 5])
    qm = random_device_array((5, hq, d), "bfloat16", rng)
    sinks = rng.standard_normal(hq).astype(np.float32)
    w.plan(pt, qo_indptr=qo_indptr, window_left=300, logits_soft_cap=20.0, strategy="fused",
           num_splits=3)
    out = cupy.full(qm.shape, 0xFFFF, cupy.uint16)
    lse = cupy.full(qm.shape[:2], np.nan, cupy.float32)
    w.run(qm, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse, sinks=cupy.asarray(sinks))
    mref_o, mref_lse = reference_decode(qm.get(), k, v, pt, qo_indptr=qo_indptr,
                                        window_left=300, logits_soft_cap=20.0,
                                        sinks=sinks.astype(np.float64))
    assert_matches_reference(to_float64(out.get()), lse.get(), mref_o, mref_lse, 1e-2,
                             "multi-token, window, sinks, cap")
