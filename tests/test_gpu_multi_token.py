"""Multi-token decode (``plan(qo_indptr=)``) on the GPU against the float64 reference: ragged
and uniform query rows (1 to 16 a request, causal among themselves), every strategy (the
cluster merge too), GQA groups whose q_len x group rows need one to several CTAs a kv head,
fp8 K/V, the soft cap and sinks together; and the combinations not run yet refused by name."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core import fp8
from splitkv.core.reference import to_float64
from splitkv.runtime.testing import (assert_matches_reference, random_device_array,
                                     scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

PLANS = [(None, None), ("single", 1), ("split_merge", 3), ("fused", 4), ("fused", 2),
         ("split_merge", 16)]


def make(rng, lens, q_lens, hq, hk, d, kv_dtype=None):
    pt, num_pages = scattered_page_table(lens, 16, rng)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = random_device_array((int(qo_indptr[-1]), hq, d), "bfloat16", rng)
    shape = (num_pages, 16, hk, d)
    if kv_dtype:
        k, v = (fp8.quantize(np.clip(rng.standard_normal(shape) * 2, -12, 12), kv_dtype)
                for _ in range(2))
    else:
        k, v = (random_device_array(shape, "bfloat16", rng).get() for _ in range(2))
    return pt, qo_indptr, q, k, v


def check(w, pt, qo_indptr, q, k, v, kv_dtype=None, cap=None, sinks=None, **plan_kw):
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype, qo_indptr=qo_indptr,
                                      logits_soft_cap=cap,
                                      sinks=None if sinks is None else sinks.astype(np.float64))
    plan = w.plan(pt, qo_indptr=qo_indptr, logits_soft_cap=cap,
                  **{k_: v_ for k_, v_ in plan_kw.items() if v_ is not None})
    assert w.kernel_variant.multi_token == 1
    out = cupy.full(q.shape, 0xFFFF, cupy.uint16)     # poisoned: NaN
    lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
    w.run(q, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse,
          sinks=None if sinks is None else cupy.asarray(sinks))
    cupy.cuda.runtime.deviceSynchronize()
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2,
                             f"{plan}, q_lens {np.diff(qo_indptr).tolist()}")
    return plan


@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (8, 8, 64), (64, 2, 128), (16, 2, 256)])
def test_ragged_query_rows_on_every_strategy(hq, hk, d):
    rng = np.random.default_rng(zlib.crc32(repr((hq, hk, d)).encode()))
    lens, q_lens = [1, 130, 0, 2000, 5000, 17, 64], [1, 4, 1, 16, 8, 3, 2]
    pt, qo_indptr, q, k, v = make(rng, lens, q_lens, hq, hk, d)
    w = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16")
    for strategy, n in PLANS:
        check(w, pt, qo_indptr, q, k, v, strategy=strategy, num_splits=n)


@pytest.mark.parametrize("q_len", [2, 4, 8, 16])
def test_uniform_query_rows_with_clusters(q_len):
    """Equal requests cut into equal chunks: the fused plans merge in clusters on sm_90."""
    rng = np.random.default_rng(q_len)
    pt, qo_indptr, q, k, v = make(rng, [3000] * 4, [q_len] * 4, 32, 8, 128)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    for strategy, n in (("fused", 2), ("fused", 4), ("split_merge", 2), (None, None)):
        check(w, pt, qo_indptr, q, k, v, strategy=strategy, num_splits=n)


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_with_soft_cap_and_sinks(kv_dtype):
    rng = np.random.default_rng(zlib.crc32(kv_dtype.encode()))
    lens, q_lens = [700, 4000, 33], [4, 4, 4]
    pt, qo_indptr, q, k, v = make(rng, lens, q_lens, 32, 8, 128, kv_dtype)
    sinks = rng.standard_normal(32).astype(np.float32) * 2
    sinks[3] = -np.inf
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype)
    for strategy, n in PLANS[:4]:
        for cap, s in ((None, None), (5.0, sinks), (None, sinks)):
            check(w, pt, qo_indptr, q, k, v, kv_dtype, cap, s, strategy=strategy, num_splits=n)


def test_one_row_each_is_the_plain_decode_and_plans_switch_back():
    """qo_indptr of one row a request runs the plain build; a plain plan after a multi-token
    one runs plain again."""
    rng = np.random.default_rng(5)
    pt, qo_indptr, q, k, v = make(rng, [900, 40], [1, 1], 32, 8, 128)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    w.plan(pt, qo_indptr=qo_indptr)
    assert w.kernel_variant.multi_token == 0
    pt2, qo2, q2, k2, v2 = make(rng, [900, 40], [3, 2], 32, 8, 128)
    check(w, pt2, qo2, q2, k2, v2)
    w.plan(pt)
    assert w.kernel_variant.multi_token == 0
    out = w.run(q, cupy.asarray(k), cupy.asarray(v))
    ref, _ = reference_decode(q.get(), k, v, pt)
    err = np.linalg.norm(to_float64(out.get()) - ref) / np.linalg.norm(ref)
    assert err < 1e-2


def test_what_multi_token_decode_does_not_take_yet_is_refused_by_name():
    rng = np.random.default_rng(6)
    pt, qo_indptr, q, k, v = make(rng, [900, 40], [3, 2], 32, 8, 128)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    with pytest.raises(ValueError, match="qo_indptr: a plan made with window_left"):
        w.plan(pt, qo_indptr=qo_indptr, window_left=100)
    with pytest.raises(ValueError, match="qo_indptr: pass num_splits"):
        w.plan(pt, qo_indptr=qo_indptr, plan=w.plan(pt))
    g = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", use_cuda_graph=True, max_batch_size=2,
                           max_num_pages=pt.kv_indices.size)
    with pytest.raises(ValueError, match="qo_indptr: multi-token decode runs on per-shape"):
        g.plan(pt, qo_indptr=qo_indptr)
    with pytest.raises(ValueError, match="qo_indptr: request 1 has 17 query rows"):
        w.plan(pt, qo_indptr=[0, 3, 20])
    with pytest.raises(ValueError, match="qo_indptr: expected 3 elements"):
        w.plan(pt, qo_indptr=[0, 3])
    w.plan(pt, qo_indptr=qo_indptr)
    with pytest.raises(ValueError, match="q"):
        w.run(q[:3], cupy.asarray(k), cupy.asarray(v))
