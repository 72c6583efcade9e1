"""Logits soft cap (``plan(logits_soft_cap=)``) and attention sinks (``run(sinks=)``) on the GPU,
against the float64 reference (``core.variants``): every strategy (the cluster merge and
graph-stable wrappers too), with fp8 K/V and a sliding window, the sink counted once whatever the
plan splits and included in the LSE. ALiBi (``plan(alibi_slopes=)``) likewise, with the others."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, random_device_array,
                                       random_kv_caches, scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper
from splitkv.testing import block_table_of

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

LENS = [1, 17, 1000, 0, 3000]
TOL = {"bfloat16": 1e-2, "float16": 5e-3}
PLANS = [("single", 1), ("split_merge", 3), ("fused", 5), ("fused", 2), ("split_merge", 16)]


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make(rng, hq, hk, d, dtype, kv_dtype=None, scale=1.0):
    pt, num_pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), hq, d), dtype, rng)
    shape = (num_pages, 16, hk, d)
    k, v = random_kv_caches(shape, dtype, rng, kv_dtype)
    return pt, q, k, v


def run_and_check(w, pt, q, k, v, dtype, kv_dtype, cap, sinks, window_left=None, variant=None,
                  **plan_kw):
    """Plan (``plan_kw``: the split) and run into poisoned outputs, against the reference;
    ``variant``: more of plan()'s variant arguments, the reference's too."""
    variant = variant or {}
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype,
                                      window_left=-1 if window_left is None else window_left,
                                      logits_soft_cap=cap,
                                      sinks=None if sinks is None else sinks.astype(np.float64),
                                      **variant)
    plan = w.plan(pt, logits_soft_cap=cap, window_left=window_left, **variant, **plan_kw)
    out = cupy.empty(q.shape, cupy.float16 if dtype == "float16" else cupy.uint16)
    out.view(cupy.uint16).fill(0xFFFF)            # poisoned: NaN in both 16-bit types
    lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
    w.run(q, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse,
          sinks=None if sinks is None else cupy.asarray(sinks))
    cupy.cuda.runtime.deviceSynchronize()
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, TOL[dtype],
                             f"{plan}, cap {cap}, sinks {sinks is not None}, {list(variant)}")
    return plan


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (8, 8, 64), (64, 2, 128)])
def test_soft_cap_and_sinks_on_every_strategy(kv_dtype, dtype, hq, hk, d):
    rng = np.random.default_rng(zlib.crc32(repr((kv_dtype, dtype, hq, d)).encode()))
    pt, q, k, v = make(rng, hq, hk, d, dtype, kv_dtype)
    sinks = rng.standard_normal(hq).astype(np.float32) * 3
    sinks[1] = -np.inf                               # no sink for that head
    w = BatchDecodeWrapper(hq, hk, d, 16, dtype, kv_dtype=kv_dtype)
    for cap, with_sinks in ((5.0, False), (None, True), (3.0, True)):
        for strategy, n in PLANS:
            run_and_check(w, pt, q, k, v, dtype, kv_dtype, cap, sinks if with_sinks else None,
                          num_splits=n, strategy=strategy)
        run_and_check(w, pt, q, k, v, dtype, kv_dtype, cap, sinks if with_sinks else None)


def test_with_a_window_and_graph_stable():
    rng = np.random.default_rng(41)
    pt, q, k, v = make(rng, 32, 8, 128, "bfloat16")
    sinks = rng.standard_normal(32).astype(np.float32)
    stable = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", use_cuda_graph=True,
                                max_batch_size=len(LENS), max_num_pages=pt.kv_indices.size)
    for strategy, n in (("fused", 5), ("split_merge", 3)):
        run_and_check(stable, pt, q, k, v, "bfloat16", None, 4.0, sinks, window_left=300,
                      num_splits=n, strategy=strategy)


def test_a_cap_of_zero_or_none_is_the_plain_path_bit_for_bit():
    rng = np.random.default_rng(42)
    pt, q, k, v = make(rng, 32, 8, 128, "bfloat16")
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    w.plan(pt, num_splits=3, strategy="fused")
    plain = w.run(q, kd, vd).get()
    w.plan(pt, num_splits=3, strategy="fused", logits_soft_cap=0)
    assert np.array_equal(w.run(q, kd, vd).get(), plain)
    w.plan(pt, num_splits=3, strategy="fused", logits_soft_cap=1e6)    # a cap far above the scores
    assert rel_err(to_float64(w.run(q, kd, vd).get()), to_float64(plain)) < 1e-3
    with pytest.raises(ValueError, match="sinks: expected a contiguous float32 device array of 32"):
        w.run(q, kd, vd, sinks=cupy.zeros(8, cupy.float32))
    with pytest.raises(ValueError, match="logits_soft_cap: expected a finite value >= 0"):
        w.plan(pt, logits_soft_cap=-1.0)


def test_an_infinite_score_stays_nan_under_the_cap():
    """cap * tanh(+inf / cap) would be a finite cap: the kernel keeps the plain path's rule
    instead, so a +inf raw score makes its heads NaN, and only those."""
    rng = np.random.default_rng(43)
    pt, q, k, v = make(rng, 8, 2, 128, "bfloat16")
    qh = q.get()
    qh[4, 4:, 3] = 0x3F80                      # +1.0 at dim 3 for kv head 1's query heads
    k[pt.kv_indices[pt.kv_indptr[4]], 2, 1, 3] = 0x7F80      # +inf at dim 3: scores of +inf
    ref_o, _ = reference_decode(qh, k, v, pt, logits_soft_cap=4.0)
    w = BatchDecodeWrapper(8, 2, 128, 16, "bfloat16")
    for strategy, n in (("single", 1), ("fused", 3), ("split_merge", 3)):
        w.plan(pt, num_splits=n, strategy=strategy, logits_soft_cap=4.0)
        o = to_float64(w.run(cupy.asarray(qh), cupy.asarray(k), cupy.asarray(v)).get())
        assert np.all(np.isnan(o[4, 4:])) and np.all(np.isnan(ref_o[4, 4:])), strategy
        rest = np.ones(o.shape[:2], bool)
        rest[4, 4:] = False
        assert not np.isnan(o[rest]).any() and rel_err(o[rest], ref_o[rest]) < 1e-2, strategy


def test_a_graph_stable_wrapper_keeps_its_first_plans_cap_on_or_off_and_takes_each_value():
    rng = np.random.default_rng(44)
    pt, q, k, v = make(rng, 32, 8, 128, "bfloat16")
    stable = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", use_cuda_graph=True,
                                max_batch_size=len(LENS), max_num_pages=pt.kv_indices.size)
    # each plan's value reaches the launches it keeps (written at plan time), host-planned and
    # planned on the device; a cap of 2 against 30 moves the output well past the tolerance
    for cap in (2.0, 30.0, 2.0):
        run_and_check(stable, pt, q, k, v, "bfloat16", None, cap, None)
    with pytest.raises(ValueError, match="keeps the sm_scale of its first plan"):
        stable.plan(pt, logits_soft_cap=30.0, sm_scale=0.01)     # refused: the cap stays 2
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, logits_soft_cap=2.0)
    out, lse = stable.run(q, cupy.asarray(k), cupy.asarray(v), return_lse=True)
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse,
                             TOL["bfloat16"], "after a refused plan")
    lens = cupy.asarray(pt.kv_lens.astype(np.int32))
    table = block_table_of(pt, pad=0)
    device = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", use_cuda_graph=True,
                                max_batch_size=len(LENS), max_num_pages=pt.kv_indices.size)
    for cap in (30.0, 2.0):
        ref_o, ref_lse = reference_decode(q.get(), k, v, pt, logits_soft_cap=cap)
        device.plan_on_device(seq_lens=lens, block_table=cupy.asarray(table),
                              logits_soft_cap=cap)
        out, lse = device.run(q, cupy.asarray(k), cupy.asarray(v), return_lse=True)
        assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse,
                                 TOL["bfloat16"], f"plan_on_device, cap {cap}")
    with pytest.raises(ValueError, match="keeps its first plan's soft cap on"):
        stable.plan(pt)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_infinite_sink_makes_its_head_nan(bad):
    """Sinks are read on the device (not checked on the host): a NaN or +inf sink makes its
    head's output and LSE NaN, never a zero output that looks like an empty request; the other
    heads are as with finite sinks."""
    rng = np.random.default_rng(45)
    pt, q, k, v = make(rng, 8, 2, 128, "bfloat16")
    sinks = rng.standard_normal(8).astype(np.float32)
    good_o, good_lse = reference_decode(q.get(), k, v, pt, sinks=sinks.astype(np.float64))
    sinks[5] = bad
    w = BatchDecodeWrapper(8, 2, 128, 16, "bfloat16")
    for strategy, n in (("single", 1), ("fused", 3), ("split_merge", 3), ("fused", 2)):
        w.plan(pt, num_splits=n, strategy=strategy)
        out, lse = w.run(q, cupy.asarray(k), cupy.asarray(v), sinks=cupy.asarray(sinks),
                         return_lse=True)
        o, lse = to_float64(out.get()), lse.get()
        assert np.isnan(o[:, 5]).all() and np.isnan(lse[:, 5]).all(), strategy
        rest = np.ones(8, bool)
        rest[5] = False
        assert rel_err(o[:, rest], good_o[:, rest]) < 1e-2, strategy



@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (8, 8, 64), (12, 4, 256)])
def test_alibi_on_every_strategy_with_the_other_variants(kv_dtype, hq, hk, d):
    """plan(alibi_slopes=): each row's bias slope x (token - query position) before the max,
    against the reference, alone and with the soft cap, a window, chunks, sinks and several
    query rows, on every strategy; the slopes of the paper and random ones of both signs."""
    from splitkv.core.variants import alibi_slopes

    rng = np.random.default_rng(zlib.crc32(f"alibi{kv_dtype}{hq}{d}".encode()))
    pt, q, k, v = make(rng, hq, hk, d, "bfloat16", kv_dtype)
    for slopes in (alibi_slopes(hq), rng.uniform(-0.05, 0.05, hq)):
        # (soft cap, window, chunks) beside the slopes
        for cap, window, chunk in ((None, None, 0), (8.0, None, 0), (None, 300, 0),
                                   (None, None, 512)):
            for strategy, splits in PLANS:
                w = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", kv_dtype=kv_dtype)
                run_and_check(w, pt, q, k, v, "bfloat16", kv_dtype, cap, None, window,
                              variant={"alibi_slopes": slopes, "attention_chunk_size": chunk},
                              num_splits=splits, strategy=strategy)
                assert w.kernel_build.variant.alibi
    check_alibi_query_rows(BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", kv_dtype=kv_dtype),
                           rng, pt, k, v, kv_dtype, "alibi, multi-token rows")


def check_alibi_query_rows(w, rng, pt, k, v, kv_dtype, what):
    """Several query rows a request (LENS' five requests), each at its own position: ``w``
    plans them with the paper's slopes and runs, against the reference, the LSE too."""
    from splitkv.core.variants import alibi_slopes

    qo_indptr = np.array([0, 1, 3, 7, 8, 12])
    q_rows = random_device_array((12, w.num_qo_heads, w.head_dim), "bfloat16", rng)
    slopes = alibi_slopes(w.num_qo_heads)
    ref_o, ref_lse = reference_decode(q_rows.get(), k, v, pt, kv_dtype=kv_dtype,
                                      qo_indptr=qo_indptr, alibi_slopes=slopes)
    w.plan(pt, qo_indptr=qo_indptr, alibi_slopes=slopes)
    out, lse = w.run(q_rows, cupy.asarray(k), cupy.asarray(v), return_lse=True)
    cupy.cuda.runtime.deviceSynchronize()
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, TOL["bfloat16"],
                             what)


def test_alibi_slopes_of_zero_are_the_plain_answer():
    rng = np.random.default_rng(5)
    pt, q, k, v = make(rng, 32, 8, 128, "bfloat16")
    k, v = cupy.asarray(k), cupy.asarray(v)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    w.plan(pt, num_splits=3, strategy="split_merge")
    plain = w.run(q, k, v, return_lse=True)
    w.plan(pt, num_splits=3, strategy="split_merge", alibi_slopes=np.zeros(32))
    zero = w.run(q, k, v, return_lse=True)
    cupy.cuda.runtime.deviceSynchronize()
    np.testing.assert_array_equal(zero[0].get(), plain[0].get())
    np.testing.assert_array_equal(zero[1].get(), plain[1].get())


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_alibi_on_a_graph_stable_wrapper_planned_on_the_host(kv_dtype):
    """plan(alibi_slopes=) of a graph-stable wrapper: its fixed buffers carry each request's
    position and the slopes (new values each plan), against the reference on every strategy;
    ALiBi stays on or off as its first plan had it."""
    from splitkv.core.variants import alibi_slopes

    rng = np.random.default_rng(zlib.crc32(f"stable-alibi{kv_dtype}".encode()))
    pt, q, k, v = make(rng, 32, 8, 128, "bfloat16", kv_dtype)
    stable = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype,
                                use_cuda_graph=True, max_batch_size=8,
                                max_num_pages=pt.kv_indices.size)
    for slopes in (alibi_slopes(32), rng.uniform(-0.05, 0.05, 32)):
        for strategy, splits in (("single", 1), ("fused", 4), ("split_merge", 3)):
            run_and_check(stable, pt, q, k, v, "bfloat16", kv_dtype, None, None,
                          variant={"alibi_slopes": slopes}, num_splits=splits,
                          strategy=strategy)
    assert stable.kernel_build.variant.alibi
    with pytest.raises(ValueError, match="keeps its first plan's ALiBi on"):
        stable.plan(pt)
    plain = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype,
                               use_cuda_graph=True, max_batch_size=8,
                               max_num_pages=pt.kv_indices.size)
    plain.plan(pt)
    with pytest.raises(ValueError, match="keeps its first plan's ALiBi off"):
        plain.plan(pt, alibi_slopes=alibi_slopes(32))
    # several query rows a request (a wrapper made with max_q_len), each at its own position
    rows = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype,
                              use_cuda_graph=True, max_batch_size=8,
                              max_num_pages=pt.kv_indices.size, max_q_len=4)
    check_alibi_query_rows(rows, rng, pt, k, v, kv_dtype, "graph-stable, alibi, multi-token rows")


def test_alibi_planned_on_the_device_in_one_graph_as_lengths_and_slopes_change():
    """plan_on_device(alibi_slopes=) captured with the runs: each replay plans the new lengths
    and biases each request at its own position; new slopes are copied outside the capture
    (and refused inside it), the same array again costs nothing."""
    from splitkv import PageTable
    from splitkv.core.variants import alibi_slopes

    rng = np.random.default_rng(77)
    hq, hk, d, page, rows, width = 32, 8, 128, 16, 6, 64
    num_pages = rows * width
    k, v = (random_device_array((num_pages, page, hk, d), "bfloat16", rng) for _ in range(2))
    q = random_device_array((rows, hq, d), "bfloat16", rng)
    seq_lens = cupy.zeros(rows, cupy.int32)
    table = cupy.zeros((rows, width), cupy.int32)
    out = cupy.empty(q.shape, cupy.uint16)
    lse = cupy.empty(q.shape[:2], cupy.float32)
    w = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", use_cuda_graph=True,
                           max_batch_size=rows, max_num_pages=num_pages)
    slopes = alibi_slopes(hq)

    def load(seed):
        """New lengths (one empty) over scattered pages of the pool, written in place."""
        r = np.random.default_rng(seed)
        lens = r.integers(1, width * page, rows).astype(np.int32)
        lens[seed % rows] = 0
        pages = -(-lens // page)
        host_table = np.zeros((rows, width), np.int32)
        ids = r.permutation(num_pages)[:pages.sum()]
        for b, start in enumerate(np.cumsum(pages) - pages):
            host_table[b, :pages[b]] = ids[start:start + pages[b]]
        pt = PageTable.from_block_table(host_table, lens, page)
        seq_lens.set(lens)
        table.set(host_table)
        cupy.cuda.runtime.deviceSynchronize()
        return pt

    def check(pt, given, what):
        """Against the reference, the LSE too: a request's position moves only its LSE (the
        bias at the query's own position is the same for every key)."""
        ref_o, ref_lse = reference_decode(q.get(), k.get(), v.get(), pt, alibi_slopes=given)
        assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse,
                                 TOL["bfloat16"], what)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        pt = load(1)
        with pytest.raises(TypeError, match="alibi_slopes: plan_on_device.. takes the slopes"):
            w.plan_on_device(seq_lens=seq_lens, block_table=table,
                             alibi_slopes=cupy.asarray(slopes))
        w.plan_on_device(seq_lens=seq_lens, block_table=table, alibi_slopes=slopes)
        w.run(q, k, v, out=out, lse=lse)
        stream.synchronize()
        check(pt, slopes, "eager")
        stream.begin_capture()
        w.plan_on_device(seq_lens=seq_lens, block_table=table, alibi_slopes=slopes)
        w.run(q, k, v, out=out, lse=lse)
        graph = stream.end_capture()
        for seed in (2, 3):
            pt = load(seed)
            out.fill(0xFFFF)
            lse.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            check(pt, slopes, f"replay {seed}")
        halved = slopes / 2
        w.plan_on_device(seq_lens=seq_lens, block_table=table, alibi_slopes=halved)
        graph.launch(stream)
        stream.synchronize()
        check(pt, halved, "new slopes, then the replay")
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="alibi_slopes: new slopes"):
                w.plan_on_device(seq_lens=seq_lens, block_table=table, alibi_slopes=slopes)
        finally:
            stream.end_capture()
