"""The 128-token tile experiment (``DecodeExperiments(tile_per_warp=32)``: each warp computes
two 16-token subtiles a tile, TILE_N = 32 x warps) against the float64 reference, for the rows
of 128 bytes it is for (16-bit head_dim 64, fp8 head_dim 128) and others: every strategy and the
cluster merge, lengths that leave partial tiles, multi-token rows under a window, page sizes
smaller than a row step, 8 warps, and a graph-stable wrapper (whose records and device plan
count the tile's pages). Sums run in another order than the 64-token build's, so the check is
the reference's tolerance, not the default build's bits."""

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

LENS = [3000, 127, 0, 129, 700]        # 127 and 129: a tile short of and past 128 tokens
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4), ("split_merge", 16)]
TILE_32 = DecodeExperiments(tile_per_warp=32)


@pytest.mark.parametrize("d,hq,hk,page,kv_dtype", [
    (64, 32, 8, 16, None), (128, 32, 8, 16, "float8_e4m3fn"), (128, 64, 2, 16, "float8_e5m2"),
    (64, 32, 8, 1, None), (128, 32, 8, 16, None), (64, 128, 2, 16, None)])
def test_tiles_of_32_tokens_a_warp_match_the_reference(d, hq, hk, page, kv_dtype):
    rng = np.random.default_rng(d + hq + page)
    pt, pages = scattered_page_table(LENS, page, rng)
    q = random_device_array((len(LENS), hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, page, hk, d), "bfloat16", rng, kv_dtype)
    w = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype=kv_dtype, experiments=TILE_32)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)
    for strategy, n in PLANS:
        o, lse = plan_and_run(w, pt, q, k, v, strategy=strategy, num_splits=n)
        assert w.kernel_variant.tile_tokens == 128 and w.kernel_variant.num_warps == 4
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, f"{strategy}/{n}")


def test_tiles_of_32_tokens_under_clusters_multi_token_and_graphs():
    def tiles_of_128(w):                 # graph-stable records carry the tile's first pages
        assert w.kernel_variant.tile_tokens == 128

    rng = np.random.default_rng(5)
    hq, hk, d = 32, 8, 64
    pt, q, k, v, w = assert_paths_match_reference(TILE_32, hq, hk, d, rng, tiles_of_128)
    # multi-token rows (3 and 2 query rows) under a window
    qo_indptr = np.array([0, 3, 5])
    qm = random_device_array((5, hq, d), "bfloat16", rng)
    o, lse = plan_and_run(w, pt, qm, k, v, qo_indptr=qo_indptr, window_left=300)
    ref_o, ref_lse = reference_decode(qm.get(), k, v, pt, qo_indptr=qo_indptr, window_left=300)
    assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, "multi-token, window")
