"""Multi-token decode (``plan(qo_indptr=)``) on the GPU against the float64 reference: ragged
and uniform query rows (1 to 16 a request, causal among themselves), every strategy (the
cluster merge too), GQA groups whose q_len x group rows need one to several CTAs a kv head,
fp8 K/V, the soft cap, sinks and a window per row together, graph-stable wrappers under a
captured graph; and what is not supported refused by name."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, random_device_array,
                                       random_kv_caches, scattered_page_table)
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
    k, v = random_kv_caches(shape, "bfloat16", rng, kv_dtype)
    return pt, qo_indptr, q, k, v


def check(w, pt, qo_indptr, q, k, v, kv_dtype=None, cap=None, sinks=None, window=-1,
          **plan_kw):
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype, qo_indptr=qo_indptr,
                                      logits_soft_cap=cap, window_left=window,
                                      sinks=None if sinks is None else sinks.astype(np.float64))
    plan = w.plan(pt, qo_indptr=qo_indptr, logits_soft_cap=cap, window_left=window,
                  **{k_: v_ for k_, v_ in plan_kw.items() if v_ is not None})
    assert w.kernel_build.variant.multi_token == 1
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
    assert w.kernel_build.variant.multi_token == 0
    pt2, qo2, q2, k2, v2 = make(rng, [900, 40], [3, 2], 32, 8, 128)
    check(w, pt2, qo2, q2, k2, v2)
    w.plan(pt)
    assert w.kernel_build.variant.multi_token == 0
    out = w.run(q, cupy.asarray(k), cupy.asarray(v))
    ref, _ = reference_decode(q.get(), k, v, pt)
    err = np.linalg.norm(to_float64(out.get()) - ref) / np.linalg.norm(ref)
    assert err < 1e-2


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_each_row_sees_its_own_window(kv_dtype):
    """window_left with query rows: the plan covers every row's window (window_left + max_q_len
    - 1 back) and each row masks its own, with sinks and the soft cap, on every strategy."""
    rng = np.random.default_rng(zlib.crc32(repr(kv_dtype).encode()))
    lens, q_lens = [3000, 90, 1, 700, 5000], [4, 8, 1, 16, 2]
    pt, qo_indptr, q, k, v = make(rng, lens, q_lens, 32, 8, 128, kv_dtype)
    sinks = rng.standard_normal(32).astype(np.float32)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype)
    for window in (0, 5, 100, 1000, 10000):
        for strategy, n in PLANS[:4]:
            plan = check(w, pt, qo_indptr, q, k, v, kv_dtype, 4.0, sinks, window=window,
                         strategy=strategy, num_splits=n)
            assert plan.problem.window_left == window + 15


def test_a_graph_stable_wrapper_replays_changing_multi_token_plans():
    """max_q_len: one captured graph replays plans of changing batches, query rows (1 to
    max_q_len, or no qo_indptr) and windows, each equal to the reference; rows past the plan's
    are left alone."""
    rng = np.random.default_rng(77)
    hq, hk, d, max_batch, max_q = 32, 8, 128, 6, 8
    pt0, _, _, k, v = make(rng, [4000] * max_batch, [1] * max_batch, hq, hk, d)
    pool = pt0.kv_indices.size
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    g = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", use_cuda_graph=True,
                           max_batch_size=max_batch, max_num_pages=pool, max_q_len=max_q)
    q = cupy.zeros((max_batch * max_q, hq, d), cupy.uint16)
    out = cupy.full(q.shape, 0xFFFF, cupy.uint16)
    lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    graph = None
    for step in range(12):
        batch = int(rng.integers(1, max_batch + 1))
        lens = rng.integers(1, 4000, batch)
        q_lens = np.minimum(rng.integers(1, max_q + 1, batch), lens)
        table = scattered_page_table(lens, 16, rng, extra_pages=0)[0]   # pages < the pool's
        indptr = None if step % 4 == 3 else np.concatenate([[0], np.cumsum(q_lens)])
        rows = batch if indptr is None else int(indptr[-1])
        window = [-1, 300, 2000][step % 3]
        g.plan(table, qo_indptr=indptr, window_left=window, stream=stream,
               **([{}, {"num_splits": 3, "strategy": "split_merge"},
                   {"num_splits": 2, "strategy": "fused"}][step % 3]))
        with stream:
            q[:rows] = random_device_array((rows, hq, d), "bfloat16", rng)
            out.fill(0xFFFF)
        if graph is None:
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
            g.run(q, kd, vd, out=out, lse=lse, stream=stream)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        ref_o, ref_lse = reference_decode(q[:rows].get(), k, v, table, qo_indptr=indptr,
                                          window_left=window)
        assert_matches_reference(to_float64(out[:rows].get()), lse[:rows].get(), ref_o, ref_lse,
                                 1e-2, f"step {step}: {g.current_plan}")
        assert (out[rows:].get() == 0xFFFF).all(), f"step {step}: rows past the plan written"


def test_what_multi_token_decode_does_not_take_yet_is_refused_by_name():
    rng = np.random.default_rng(6)
    pt, qo_indptr, q, k, v = make(rng, [900, 40], [3, 2], 32, 8, 128)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    with pytest.raises(ValueError, match="qo_indptr: pass num_splits"):
        w.plan(pt, qo_indptr=qo_indptr, plan=w.plan(pt))
    with pytest.raises(ValueError, match="max_q_len: a capacity is for a graph-stable"):
        BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", max_q_len=4)
    g = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", use_cuda_graph=True, max_batch_size=2,
                           max_num_pages=pt.kv_indices.size)
    with pytest.raises(ValueError, match="qo_indptr: request 0 has 3 query rows; this "
                                         "graph-stable wrapper's captured launch holds "
                                         "max_q_len=1"):
        g.plan(pt, qo_indptr=qo_indptr)
    with pytest.raises(ValueError, match="qo_indptr: this graph-stable wrapper's captured "
                                         "launch holds one query row"):
        g.plan_on_device(seq_lens=cupy.asarray(pt.kv_lens, cupy.int32),
                         block_table=cupy.zeros((2, 60), cupy.int32),
                         qo_indptr=cupy.asarray(qo_indptr, cupy.int32))
    g4 = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", use_cuda_graph=True, max_batch_size=2,
                            max_num_pages=pt.kv_indices.size, max_q_len=4)
    with pytest.raises(TypeError, match="qo_indptr: expected an int32 device array"):
        g4.plan_on_device(seq_lens=cupy.asarray(pt.kv_lens, cupy.int32),
                          block_table=cupy.zeros((2, 60), cupy.int32),
                          qo_indptr=cupy.asarray(qo_indptr, cupy.int64))
    with pytest.raises(ValueError, match="qo_indptr: expected a contiguous \\[batch \\+ 1\\]"):
        g4.plan_on_device(seq_lens=cupy.asarray(pt.kv_lens, cupy.int32),
                          block_table=cupy.zeros((2, 60), cupy.int32),
                          qo_indptr=cupy.zeros(2, cupy.int32))
    with pytest.raises(ValueError, match="qo_indptr: request 1 has 17 query rows"):
        w.plan(pt, qo_indptr=[0, 3, 20])
    with pytest.raises(ValueError, match="qo_indptr: expected 3 elements"):
        w.plan(pt, qo_indptr=[0, 3])
    w.plan(pt, qo_indptr=qo_indptr)
    with pytest.raises(ValueError, match="q"):
        w.run(q[:3], cupy.asarray(k), cupy.asarray(v))


def test_plan_on_device_with_query_rows_in_one_graph():
    """A graph-stable wrapper made with max_q_len plans on the device from qo_indptr (device
    int32, updated in place with the lengths) under a window: one graph of plan_on_device()
    then run() replayed over changing batches equals the reference; a bad qo_indptr is kept as
    the device error and leaves every row unwritten."""
    rng = np.random.default_rng(88)
    hq, hk, d, max_batch, max_q, width = 32, 8, 128, 4, 4, 300
    pool = max_batch * width
    k = random_device_array((pool, 16, hk, d), "bfloat16", rng)
    v = random_device_array((pool, 16, hk, d), "bfloat16", rng)
    g = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", use_cuda_graph=True,
                           max_batch_size=max_batch, max_num_pages=pool, max_q_len=max_q)
    seq_lens = cupy.zeros(max_batch, cupy.int32)
    table = cupy.asarray(rng.permutation(pool)[:max_batch * width].reshape(max_batch, width),
                         cupy.int32)
    qo = cupy.zeros(max_batch + 1, cupy.int32)
    q = cupy.zeros((max_batch * max_q, hq, d), cupy.uint16)
    out = cupy.full(q.shape, 0xFFFF, cupy.uint16)
    lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    graph = None
    from splitkv import PageTable

    for step in range(8):
        lens = rng.integers(1, width * 16, max_batch)
        q_lens = np.minimum(rng.integers(1, max_q + 1, max_batch), lens)
        indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        rows = int(indptr[-1])
        with stream:
            seq_lens.set(lens.astype(np.int32), stream=stream)
            qo.set(indptr, stream=stream)
            q[:rows] = random_device_array((rows, hq, d), "bfloat16", rng)
            out.fill(0xFFFF)
        if graph is None:
            g.plan_on_device(seq_lens=seq_lens, block_table=table, qo_indptr=qo, stream=stream,
                             window_left=700)
            stream.synchronize()
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
            g.plan_on_device(seq_lens=seq_lens, block_table=table, qo_indptr=qo, stream=stream,
                             window_left=700)
            g.run(q, k, v, out=out, lse=lse, stream=stream)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        host_table = table.get()
        pt = PageTable.from_block_table(host_table, lens, 16)
        ref_o, ref_lse = reference_decode(q[:rows].get(), k.get(), v.get(), pt, qo_indptr=indptr,
                                          window_left=700)
        assert_matches_reference(to_float64(out[:rows].get()), lse[:rows].get(), ref_o, ref_lse,
                                 1e-2, f"step {step}: {g.device_plan_state()}")
        assert g.device_plan_state()["error"] is None
        assert (out[rows:].get() == 0xFFFF).all()
    with stream:                                     # request 1 with more rows than max_q_len
        qo.set(np.array([0, 1, 1 + max_q + 1, max_q + 3, max_q + 4], np.int32), stream=stream)
        out.fill(0xFFFF)
    graph.launch(stream)
    stream.synchronize()
    state = g.device_plan_state()
    assert state["error"].startswith("qo_indptr:") and state["error_request"] == 1, state
    assert (out.get() == 0xFFFF).all()         # no row of the batch written


def test_torch_tensors_and_torch_cuda_graph_with_query_rows():
    """As an engine calls it from PyTorch: torch tensors in (zero-copy), qo_indptr a torch int32
    CUDA tensor updated in place, plan_on_device() then run() captured by torch.cuda.graph on a
    torch stream and replayed over changing batches and query rows under a window; the host
    path takes a torch CPU qo_indptr too. Each replay equals the reference."""
    torch = pytest.importorskip("torch")
    from splitkv import PageTable

    rng = np.random.default_rng(99)
    hq, hk, d, max_batch, max_q, width, window = 32, 8, 128, 3, 4, 200, 900
    pool = max_batch * width
    gen = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(pool, 16, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(pool, 16, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
    k64, v64 = (x.float().cpu().numpy().astype(np.float64) for x in (k, v))   # bf16 -> f32: exact
    table = torch.from_numpy(rng.permutation(pool).reshape(max_batch, width).astype(np.int32))
    table = table.cuda()
    seq_lens = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    qo = torch.zeros(max_batch + 1, dtype=torch.int32, device="cuda")
    q = torch.zeros(max_batch * max_q, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device="cuda")
    g = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", use_cuda_graph=True,
                           max_batch_size=max_batch, max_num_pages=pool, max_q_len=max_q)
    stream = torch.cuda.Stream()
    graph = None

    def reference(lens, indptr):
        pt = PageTable.from_block_table(table.cpu().numpy(), lens, 16)
        rows = int(indptr[-1])
        q64 = q[:rows].float().cpu().numpy().astype(np.float64)
        return reference_decode(q64, k64, v64, pt, qo_indptr=indptr, window_left=window)

    for step in range(6):
        lens = rng.integers(1, width * 16, max_batch)
        q_lens = np.minimum(rng.integers(1, max_q + 1, max_batch), lens)
        indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        rows = int(indptr[-1])
        with torch.cuda.stream(stream):
            seq_lens.copy_(torch.from_numpy(lens.astype(np.int32)))
            qo.copy_(torch.from_numpy(indptr))
            q[:rows] = torch.randn(rows, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
            out.fill_(float("nan"))
        if graph is None:
            g.plan_on_device(seq_lens=seq_lens, block_table=table, qo_indptr=qo, stream=stream,
                             window_left=window)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                g.plan_on_device(seq_lens=seq_lens, block_table=table, qo_indptr=qo,
                                 stream=stream, window_left=window)
                g.run(q, k, v, out=out, lse=lse, stream=stream)
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        ref_o, ref_lse = reference(lens, indptr)
        got = out[:rows].float().cpu().numpy().astype(np.float64)
        assert_matches_reference(got, lse[:rows].cpu().numpy(), ref_o, ref_lse, 1e-2,
                                 f"step {step}: {g.device_plan_state()}")
        assert torch.isnan(out[rows:].float()).all(), f"step {step}: rows past the batch written"

    # the host path from torch: a CPU int32 qo_indptr, torch q/k/v/out, torch's current stream
    w = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16")
    lens = np.array([3000, 17, 700])
    indptr = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    pt = PageTable.from_block_table(table.cpu().numpy(), lens, 16)
    w.plan(pt, qo_indptr=indptr, window_left=window)
    out.fill_(float("nan"))
    w.run(q[:8], k, v, out=out[:8], lse=lse[:8], stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    ref_o, ref_lse = reference(lens, indptr.numpy())
    got = out[:8].float().cpu().numpy().astype(np.float64)
    assert_matches_reference(got, lse[:8].cpu().numpy(), ref_o, ref_lse, 1e-2, "host plan")
