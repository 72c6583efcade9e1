"""``DecodeExperiments(warps=8)`` (128-token tiles, 256 threads a CTA) on the GPU: the same
answers as the reference on every strategy, bf16 and fp8 K/V, graph-stable too. An experiment
for fp8, whose lone CTAs are latency-bound (docs/design/kernel.md, warps)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core import fp8
from splitkv.core.reference import to_float64
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import (assert_matches_reference, poisoned_output,
                                     random_device_array, random_kv_caches,
                                     scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu


# bf16 at head_dim 256 needs 256 KiB of shared memory with 8 warps (2 stages of 128 tokens):
# more than a block may have, so its plan() is refused; fp8 halves it.
@pytest.mark.parametrize("kv_dtype,hq,hk,d,page", [
    (None, 32, 8, 128, 16), ("float8_e4m3fn", 32, 8, 128, 16), (None, 64, 2, 64, 1),
    ("float8_e4m3fn", 64, 2, 64, 1), ("float8_e4m3fn", 16, 16, 256, 64)])
def test_eight_warps_match_the_reference(kv_dtype, hq, hk, d, page):
    rng = np.random.default_rng(zlib.crc32(repr((kv_dtype, hq, d)).encode()))
    lens = [1, 130, 0, 2000, 5000]
    pt, num_pages = scattered_page_table(lens, page, rng)
    q = random_device_array((len(lens), hq, d), "bfloat16", rng)
    shape = (num_pages, page, hk, d)
    if kv_dtype:
        k, v = (fp8.quantize(np.clip(rng.standard_normal(shape) * 2, -12, 12), kv_dtype)
                for _ in range(2))
    else:
        k, v = (random_device_array(shape, "bfloat16", rng).get() for _ in range(2))
    ref, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    eight = DecodeExperiments(warps=8)
    wrappers = [BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype=kv_dtype,
                                   experiments=eight),
                BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype=kv_dtype,
                                   experiments=eight, use_cuda_graph=True,
                                   max_batch_size=len(lens), max_num_pages=pt.kv_indices.size)]
    assert wrappers[0].variant.num_warps == 8
    for w in wrappers:
        for strategy, n in (("single", 1), ("split_merge", 3), ("fused", 4), ("fused", 2)):
            plan = w.plan(pt, num_splits=n, strategy=strategy)
            out = cupy.empty(q.shape, cupy.uint16)
            out.fill(0xFFFF)
            lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
            w.run(q, kd, vd, out=out, lse=lse)
            o = to_float64(out.get())
            assert not np.isnan(o).any(), plan
            err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
            assert err < 1e-2, f"rel err {err:.2e} with {plan} (graph-stable {w.use_cuda_graph})"
            finite = np.isfinite(ref_lse)
            np.testing.assert_allclose(lse.get()[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)


def test_fp8_plans_choose_their_warps_and_stay_exact():
    """By default an fp8 plan whose grid gives no SM two CTAs runs 8 warps, a larger grid 4, a
    graph-stable wrapper always 4 (``features.plan_warps``); each matches the reference."""
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
            assert w.kernel_variant.num_warps == want, (plan, w.use_cuda_graph)
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
    tiles, or pages smaller than a row step), else 4 (``features.plan_warps``); each plan
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
        assert w.kernel_variant.num_warps == warps, plan
        out = poisoned_output(q)
        lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
        w.run(q, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse)
        assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2,
                                 f"{plan}, {warps} warps")
