"""The builds a plan runs by default where the shape decides them (``features.default_occupancy``
and ``features.default_tile_per_warp``): which build runs, and its answers against the
float64 reference. 16-bit head_dim 64 of one row tile runs 4 CTAs an SM (3 stages, 128
registers), whose arithmetic is the 4-stage build's, so its bits are too; fp8 head_dim 128 on
grids past one CTA an SM runs 128-token tiles at 4 warps (32 tokens a warp), lone grids 8
warps of 16 tokens each."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import (assert_matches_reference, assert_paths_match_reference,
                                     plan_and_run, plan_and_run_both, random_device_array,
                                     random_kv_caches, scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

LENS = [3000, 127, 0, 129, 700]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4)]


def four_an_sm(w) -> bool:
    v = w.kernel_variant
    return (v.stages, v.max_registers) == (3, 128)


@pytest.mark.parametrize("hq,hk,page", [(32, 8, 16), (16, 16, 1), (64, 2, 16)])
def test_head_dim_64_runs_four_an_sm_with_the_four_stage_builds_bits(hq, hk, page):
    rng = np.random.default_rng(hq + page)
    pt, pages = scattered_page_table(LENS, page, rng)
    q = random_device_array((len(LENS), hq, 64), "bfloat16", rng)
    k, v = random_kv_caches((pages, page, hk, 64), "bfloat16", rng)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt)
    shipped = BatchDecodeWrapper(hq, hk, 64, page, "bfloat16")
    four_stages = BatchDecodeWrapper(hq, hk, 64, page, "bfloat16",
                                     experiments=DecodeExperiments(stages=4))
    one_row_tile = hq // hk <= 16
    for strategy, n in PLANS:
        o, lse = plan_and_run_both(four_stages, shipped, pt, q, k, v, f"{strategy}/{n}",
                                   strategy=strategy, num_splits=n)
        assert four_an_sm(shipped) == one_row_tile, shipped.kernel_variant.name
        assert four_stages.kernel_variant.stages == 4 and not four_an_sm(four_stages)
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, f"{strategy}/{n}")


def test_head_dim_64s_other_paths_run_four_an_sm():
    """Clusters, graph-stable wrappers planned on the host and on the device."""
    from splitkv.runtime import device_info

    def check(w):
        assert four_an_sm(w), w.kernel_variant.name

    *_, w = assert_paths_match_reference(None, 32, 8, 64, np.random.default_rng(5), check)
    if int(device_info()["cc"]) >= 90:          # its last plan: fused/4 merged in a cluster
        assert w.kernel_variant.cluster == 4
        check(w)


def test_forced_stages_or_warps_give_up_the_fp8_long_tiles():
    """An experiment that forces the stages or the warps gets 16 tokens a warp (the build it
    was measured as), not the shape's 128-token fp8 tiles."""
    rng = np.random.default_rng(13)
    lens = [int(x) for x in rng.integers(100, 2000, 40)]
    pt, pages = scattered_page_table(lens, 16, rng)
    q = random_device_array((len(lens), 32, 128), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, 8, 128), "bfloat16", rng, "float8_e4m3fn")
    for experiments in (DecodeExperiments(stages=5), DecodeExperiments(warps=4)):
        w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype="float8_e4m3fn",
                               experiments=experiments)
        plan_and_run(w, pt, q, k, v, strategy="single")
        assert w.kernel_variant.tile_per_warp == 16, (experiments, w.kernel_variant.name)


def test_the_unified_max_keeps_the_compilers_registers_at_head_dim_64():
    rng = np.random.default_rng(7)
    pt, pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), 32, 64), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, 8, 64), "bfloat16", rng)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt)
    w = BatchDecodeWrapper(32, 8, 64, 16, "bfloat16")
    o, lse = plan_and_run(w, pt, q, k, v, strategy="split_merge", num_splits=3, unified_max=8.0)
    assert w.kernel_variant.max_registers == 0 and w.kernel_variant.unified_max
    assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, "unified max")


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_head_dim_128_runs_long_tiles_past_one_cta_an_sm(kv_dtype):
    rng = np.random.default_rng(11)
    lens = [int(x) for x in rng.integers(0, 3000, 40)] + [127, 129]
    pt, pages = scattered_page_table(lens, 16, rng)
    q = random_device_array((len(lens), 32, 128), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, 8, 128), "bfloat16", rng, kv_dtype)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype)
    # 42 requests x 8 kv heads: 336 CTAs or more, past the 132 SMs
    for strategy, n in PLANS:
        o, lse = plan_and_run(w, pt, q, k, v, strategy=strategy, num_splits=n)
        variant = w.kernel_variant
        assert (variant.num_warps, variant.tile_tokens, variant.stages) == (4, 128, 3), variant
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 2e-2, f"{strategy}/{n}")
    # one request: 8 CTAs, one an SM: 8 warps of 64-token tiles
    one = scattered_page_table([5000], 16, rng)
    q1 = random_device_array((1, 32, 128), "bfloat16", rng)
    k1, v1 = random_kv_caches((one[1], 16, 8, 128), "bfloat16", rng, kv_dtype)
    ref_o, ref_lse = reference_decode(q1.get(), k1, v1, one[0], kv_dtype=kv_dtype)
    o, lse = plan_and_run(w, one[0], q1, k1, v1, strategy="split_merge", num_splits=4)
    assert (w.kernel_variant.num_warps, w.kernel_variant.tile_tokens) == (8, 128)
    assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 2e-2, "lone grid")
    # forced 16-token tiles keep them
    w16 = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype,
                             experiments=DecodeExperiments(tile_per_warp=16))
    plan_and_run(w16, pt, q, k, v, strategy="single")
    assert w16.kernel_variant.tile_tokens == 64
