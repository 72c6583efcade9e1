"""The builds a plan runs by default where the shape decides them
(``core.builds.default_occupancy`` and ``core.builds.default_tile_per_warp``): which build runs,
and its answers against the float64 reference. 16-bit head_dim 64 of one row tile runs 4 CTAs an SM (3 stages, 128
registers), whose arithmetic is the 4-stage build's, so its bits are too; fp8 head_dim 128 on
grids past one CTA an SM runs 128-token tiles at 4 warps (32 tokens a warp), lone grids 8
warps of 16 tokens each; 16-bit lone grids of long chunks run 8 warps where 4 are issue-bound
(``core.builds.plan_warps``)."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core import fp8
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, assert_paths_match_reference,
                                       plan_and_run, plan_and_run_both, poisoned_output,
                                       random_device_array, random_kv_caches, scattered_page_table)
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

LENS = [3000, 127, 0, 129, 700]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4)]


def four_an_sm(w) -> bool:
    v = w.kernel_build
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
        assert four_an_sm(shipped) == one_row_tile, shipped.kernel_build.name
        assert four_stages.kernel_build.stages == 4 and not four_an_sm(four_stages)
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, f"{strategy}/{n}")


def test_head_dim_64s_other_paths_run_four_an_sm():
    """Clusters, graph-stable wrappers planned on the host and on the device."""
    from splitkv.runtime import device_info

    def check(w):
        assert four_an_sm(w), w.kernel_build.name

    *_, w = assert_paths_match_reference(None, 32, 8, 64, np.random.default_rng(5), check)
    if int(device_info()["cc"]) >= 90:          # its last plan: fused/4 merged in a cluster
        assert w.kernel_build.cluster == 4
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
        assert w.kernel_build.tile_per_warp == 16, (experiments, w.kernel_build.name)


def test_the_unified_max_keeps_the_compilers_registers_at_head_dim_64():
    rng = np.random.default_rng(7)
    pt, pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), 32, 64), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, 8, 64), "bfloat16", rng)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt)
    w = BatchDecodeWrapper(32, 8, 64, 16, "bfloat16")
    o, lse = plan_and_run(w, pt, q, k, v, strategy="split_merge", num_splits=3, unified_max=8.0)
    assert w.kernel_build.max_registers == 0 and w.kernel_build.variant.unified_max
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
        variant = w.kernel_build
        assert (variant.num_warps, variant.tile_tokens, variant.stages) == (4, 128, 3), variant
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 2e-2, f"{strategy}/{n}")
    # one request: 8 CTAs, one an SM: 8 warps of 64-token tiles
    one = scattered_page_table([5000], 16, rng)
    q1 = random_device_array((1, 32, 128), "bfloat16", rng)
    k1, v1 = random_kv_caches((one[1], 16, 8, 128), "bfloat16", rng, kv_dtype)
    ref_o, ref_lse = reference_decode(q1.get(), k1, v1, one[0], kv_dtype=kv_dtype)
    o, lse = plan_and_run(w, one[0], q1, k1, v1, strategy="split_merge", num_splits=4)
    assert (w.kernel_build.num_warps, w.kernel_build.tile_tokens) == (8, 128)
    assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 2e-2, "lone grid")
    # forced 16-token tiles keep them
    w16 = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype,
                             experiments=DecodeExperiments(tile_per_warp=16))
    plan_and_run(w16, pt, q, k, v, strategy="single")
    assert w16.kernel_build.tile_tokens == 64


def test_fp8_plans_choose_their_warps_and_stay_exact():
    """By default an fp8 plan whose grid gives no SM two CTAs runs 8 warps, a larger grid 4, a
    graph-stable wrapper always 4 (``core.builds.plan_warps``); each matches the reference."""
    from splitkv.runtime import device_info

    rng = np.random.default_rng(7)
    hq, hk, d, page = 32, 8, 128, 16
    sms = device_info()["num_sms"]
    # (lengths, splits, strategy, warps a per-shape plan gets): 1 x 4 x 8 = 32 CTAs; then
    # more requests than SMs / kv heads, unsplit: more CTAs than SMs
    for lens, n, strategy, warps in (([3000], 4, "split_merge", 8), ([3000], 2, "fused", 8),
                                     ([9000], 8, "fused", 8),
                                     ([700] * (sms // hk + 1), 1, "single", 4)):
        pt, num_pages = scattered_page_table(lens, page, rng)
        shape = (num_pages, page, hk, d)
        k, v = (fp8.quantize(rng.standard_normal(shape) * 2, "float8_e4m3fn") for _ in range(2))
        kd, vd = cupy.asarray(k), cupy.asarray(v)
        q = random_device_array((len(lens), hq, d), "bfloat16", rng)
        ref, _ = reference_decode(q.get(), k, v, pt, kv_dtype="float8_e4m3fn")
        per_shape = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype="float8_e4m3fn")
        stable = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype="float8_e4m3fn",
                                    use_cuda_graph=True, max_batch_size=len(lens),
                                    max_num_pages=pt.kv_indices.size)
        forced = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype="float8_e4m3fn",
                                    experiments=DecodeExperiments(warps=4))
        for w, want in ((per_shape, warps), (stable, 4), (forced, 4)):
            plan = w.plan(pt, num_splits=n, strategy=strategy)
            assert w.kernel_build.num_warps == want, (plan, w.use_cuda_graph)
            out = cupy.full(q.shape, 0xFFFF, cupy.uint16)
            w.run(q, kd, vd, out=out)
            o = to_float64(out.get())
            err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
            assert err < 1e-2, (plan, w.use_cuda_graph, err)


@pytest.mark.parametrize("hq,hk,page,lens,warps", [
    (64, 2, 16, [4096] * 3, 8),          # group 32: two row tiles, long chunks, a lone grid
    (32, 8, 1, [5000, 6000], 8),         # page 1 (smaller than a row step), long chunks
    (32, 8, 16, [4096] * 3, 4),          # group 4, page 16: no gain measured, 4
    (64, 2, 16, [700] * 3, 4)])          # group 32 but short chunks: 4
def test_sixteen_bit_lone_ctas_choose_their_warps_and_stay_exact(hq, hk, page, lens, warps):
    """16-bit K/V: a lone grid of long chunks runs 8 warps where 4 are issue-bound (two row
    tiles, or pages smaller than a row step), else 4 (``core.builds.plan_warps``); each plan
    matches the reference, single and split."""
    rng = np.random.default_rng(hq + page)
    d = 128
    pt, num_pages = scattered_page_table(lens, page, rng)
    k, v = random_kv_caches((num_pages, page, hk, d), "bfloat16", rng)
    q = random_device_array((len(lens), hq, d), "bfloat16", rng)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt)
    w = BatchDecodeWrapper(hq, hk, d, page, "bfloat16")
    for strategy, n in (("single", 1), ("split_merge", 2)):
        plan = w.plan(pt, num_splits=n, strategy=strategy)
        assert w.kernel_build.num_warps == warps, plan
        out = poisoned_output(q)
        lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
        w.run(q, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse)
        assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2,
                                 f"{plan}, {warps} warps")
