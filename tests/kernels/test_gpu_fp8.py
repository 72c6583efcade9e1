"""fp8 KV caches on the GPU (``kv_dtype``): both formats, every strategy (the cluster merge too),
scales per tensor (a number, or a device value) and per kv head (a device array), against the
float64 reference over the exactly dequantized caches."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core import fp8
from splitkv.core.bfloat16 import float32_to_bits
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, random_device_array,
                                       scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 5e-3}
FORMATS = fp8.FP8_FORMATS


def fp8_case(rng, lens, hq, hk, d, page, dtype, fmt):
    pt, num_pages = scattered_page_table(lens, page, rng)
    q = random_device_array((len(lens), hq, d), dtype, rng)
    shape = (num_pages, page, hk, d)
    k = fp8.quantize(np.clip(rng.standard_normal(shape) * 2, -12, 12), fmt)
    v = fp8.quantize(np.clip(rng.standard_normal(shape) * 2, -12, 12), fmt)
    return pt, q, k, v


def rel_err(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def check(w, pt, q, k, v, dtype, fmt, scales, **plan_kw):
    """Plan and run (outputs poisoned first); returns the plan and the output on the host."""
    k_host, v_host = scales["host"]
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=fmt, k_scale=k_host,
                                      v_scale=v_host)
    plan = w.plan(pt, **plan_kw)
    out = cupy.empty(q.shape, dtype=cupy.float16 if dtype == "float16" else cupy.uint16)
    out.view(cupy.uint16).fill(0xFFFF)
    lse = cupy.full(q.shape[:2], np.nan, dtype=cupy.float32)
    w.run(q, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse, k_scale=scales["k"],
          v_scale=scales["v"])
    cupy.cuda.runtime.deviceSynchronize()
    o = to_float64(out.get())
    assert_matches_reference(o, lse.get(), ref_o, ref_lse, TOL[dtype],
                             f"{plan} ({fmt}, {scales['name']})")
    return plan, o


def scale_kinds(hk):
    per_head_k = np.linspace(0.25, 2.0, hk).astype(np.float32)
    per_head_v = np.linspace(3.0, 0.5, hk).astype(np.float32)
    return [
        {"name": "none", "k": None, "v": None, "host": (None, None)},
        {"name": "numbers", "k": 0.37, "v": 1.9, "host": (float(np.float32(0.37)),
                                                          float(np.float32(1.9)))},
        {"name": "device per tensor", "k": cupy.asarray([0.5], cupy.float32),
         "v": cupy.asarray([2.5], cupy.float32), "host": (0.5, 2.5)},
        {"name": "device per head", "k": cupy.asarray(per_head_k), "v": cupy.asarray(per_head_v),
         "host": (per_head_k.astype(np.float64), per_head_v.astype(np.float64))},
    ]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim,group,page", [(128, 4, 16), (64, 8, 1), (256, 1, 64), (128, 32, 16),
                                                 (64, 64, 16)])
def test_every_strategy_and_scale_kind_matches_the_reference(fmt, dtype, head_dim, group, page):
    rng = np.random.default_rng(hash((fmt, dtype, head_dim, group)) % 2**32)
    hk = 2
    lens = [1, page + 1, 1000, 0, 77, 3000]
    pt, q, k, v = fp8_case(rng, lens, hk * group, hk, head_dim, page, dtype, fmt)
    w = BatchDecodeWrapper(hk * group, hk, head_dim, page, dtype, kv_dtype=fmt)
    for scales in scale_kinds(hk):
        results = {}
        for strategy, n in (("single", 1), ("split_merge", 3), ("fused", 5), ("split_merge", 16),
                            ("fused", 16)):
            plan, o = check(w, pt, q, k, v, dtype, fmt, scales, num_splits=n, strategy=strategy)
            results[(strategy, n)] = o
        np.testing.assert_array_equal(results[("fused", 16)], results[("split_merge", 16)])
        check(w, pt, q, k, v, dtype, fmt, scales)          # the planner's own choice


@pytest.mark.parametrize("fmt", FORMATS)
def test_cluster_merge_and_graph_stable_with_fp8(fmt):
    """Short fused plans merge in clusters (sm_90); a graph-stable fp8 wrapper gives the same
    bits as an ordinary one."""
    rng = np.random.default_rng(5)
    pt, q, k, v = fp8_case(rng, [500, 900], 32, 8, 128, 16, "bfloat16", fmt)
    scales = scale_kinds(8)[3]
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=fmt)
    plan, o = check(w, pt, q, k, v, "bfloat16", fmt, scales, num_splits=4, strategy="fused")
    stable = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=fmt, use_cuda_graph=True,
                                max_batch_size=2, max_num_pages=pt.kv_indices.size)
    plan2, o2 = check(stable, pt, q, k, v, "bfloat16", fmt, scales, plan=plan)
    assert rel_err(o2, o) < 1e-2


def test_a_nan_code_makes_its_heads_nan_only():
    fmt = "float8_e4m3fn"
    rng = np.random.default_rng(8)
    pt, q, k, v = fp8_case(rng, [300, 300], 8, 2, 128, 16, "bfloat16", fmt)
    k[pt.kv_indices[pt.kv_indptr[1]], 2, 1, 7] = 0x7F          # request 1, kv head 1
    w = BatchDecodeWrapper(8, 2, 128, 16, "bfloat16", kv_dtype=fmt)
    w.plan(pt, num_splits=2, strategy="fused")
    out, lse = w.run(q, cupy.asarray(k), cupy.asarray(v), return_lse=True)
    lse = lse.get()
    assert np.all(np.isnan(lse[1, 4:])) and np.all(np.isfinite(lse[1, :4]))
    assert np.all(np.isfinite(lse[0]))


def test_fp8_misuse_is_named():
    rng = np.random.default_rng(1)
    pt, q, k, v = fp8_case(rng, [100], 8, 2, 128, 16, "bfloat16", "float8_e5m2")
    w = BatchDecodeWrapper(8, 2, 128, 16, "bfloat16", kv_dtype="fp8_e5m2")
    w.plan(pt)
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    with pytest.raises(TypeError, match="k_cache: the wrapper's kv_dtype is float8_e5m2"):
        w.run(q, kd.view(cupy.int8), vd)
    with pytest.raises(ValueError, match="k_scale: expected a number, or a contiguous float32"):
        w.run(q, kd, vd, k_scale=cupy.ones(3, cupy.float32))
    with pytest.raises(ValueError, match="v_scale: expected a finite value > 0"):
        w.run(q, kd, vd, v_scale=-2.0)
    plain = BatchDecodeWrapper(8, 2, 128, 16, "bfloat16")
    plain.plan(pt)
    with pytest.raises(ValueError, match="k_scale: scales are for fp8 caches"):
        plain.run(q, random_device_array(v.shape, "bfloat16", rng),
                  random_device_array(v.shape, "bfloat16", rng), k_scale=2.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_scale", [3e4, 1e-6])
def test_bfloat16_q_beyond_the_float16_range(fmt, q_scale):
    """fp8 kernels multiply in float16: a bfloat16 q is scaled by a power of two that brings its
    largest value into float16's range, so a q far above float16's maximum (65504) or in its
    subnormals still matches the reference; each query head's scale is its own."""
    rng = np.random.default_rng(23)
    pt, q, k, v = fp8_case(rng, [700, 33, 3000], 32, 2, 128, 16, "bfloat16", fmt)
    qf = to_float64(q.get())
    qf[:, :16] *= q_scale                      # kv head 0's query heads
    qf[1, 20:] *= 1 / 64                       # and some of kv head 1's, beside unscaled ones
    q = cupy.asarray(float32_to_bits(qf.astype(np.float32)))
    w = BatchDecodeWrapper(32, 2, 128, 16, "bfloat16", kv_dtype=fmt)
    for strategy, n in (("single", 1), ("fused", 4)):
        check(w, pt, q, k, v, "bfloat16", fmt, scale_kinds(2)[1], num_splits=n, strategy=strategy)


def test_a_nan_in_q_makes_its_head_nan_only():
    """q's float16 scale is per query head, from its finite values: a NaN leaves its own head
    NaN, and the heads beside it (same CTA, same MMAs) exact."""
    fmt = "float8_e4m3fn"
    rng = np.random.default_rng(9)
    pt, q, k, v = fp8_case(rng, [300, 300], 8, 2, 128, 16, "bfloat16", fmt)
    qh = q.get()
    qh[1, 5, 3] = 0x7FC0                      # bfloat16 NaN: request 1, kv head 1's group
    ref_o, _ = reference_decode(qh, k, v, pt, kv_dtype=fmt)
    w = BatchDecodeWrapper(8, 2, 128, 16, "bfloat16", kv_dtype=fmt)
    w.plan(pt)
    o = to_float64(w.run(cupy.asarray(qh), cupy.asarray(k), cupy.asarray(v)).get())
    assert np.all(np.isnan(o[1, 5])) and np.all(np.isnan(ref_o[1, 5]))
    rows = np.ones(o.shape[:2], bool)
    rows[1, 5] = False
    assert rel_err(o[rows], ref_o[rows]) < TOL["bfloat16"]


def test_graph_stable_fp8_grids_are_not_spread():
    """A graph-stable fp8 grid never spreads one CTA per SM (a lone fp8 CTA streams far below
    an SM's share): a batch-1 capacity gets the two-CTAs-an-SM grid, where bf16 spreads."""
    from splitkv.runtime import device_info

    sms = device_info()["num_sms"]
    kw = dict(use_cuda_graph=True, max_batch_size=1, max_num_pages=100)
    fp8_w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype="float8_e4m3fn", **kw)
    bf16_w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", **kw)
    assert fp8_w.max_chunks == 4 * sms // 8
    assert bf16_w.max_chunks == 2 * sms // 8
