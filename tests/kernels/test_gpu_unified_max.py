"""The unified max on the GPU (``plan(unified_max=phi)``): against the float64
reference on every strategy (the cluster merge too), bfloat16 and float16 q, fp8 K/V, and the
number of CTAs that fell back to the running max equal to the host's prediction
(``core.unified_max.fallback_items``) on realistic inputs (none) and on inputs built to break
phi: phi far above and far below the scores, one huge score, all scores equal, NaN and Inf in
q, K and V (NaN exactly where the reference has it)."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import DecodeProblem, plan_from_chunk_counts, reference_decode
from splitkv.core import unified_max as UM
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, poisoned_output,
                                       random_device_array, random_kv_caches,
                                       scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

HQ, HK, D = 32, 8, 128
LENS = [3000, 700, 0, 41]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4), ("split_merge", 16)]


def make(rng, dtype="bfloat16", kv_dtype=None, lens=LENS, hq=HQ, hk=HK):
    pt, pages = scattered_page_table(lens, 16, rng)
    q = random_device_array((len(lens), hq, D), dtype, rng).get()
    shape = (pages, 16, hk, D)
    k, v = random_kv_caches(shape, dtype, rng, kv_dtype)
    return pt, q, k, v


def run(w, pt, q, k, v, phi, kv_dtype=None, heads_checked=None, **plan_kw):
    """One run under phi: its output checked against the reference (and, with
    ``heads_checked`` = (request, heads), those rows alone as well, so that an error in one
    item is not diluted by the batch); returns (plan, the CTAs that fell back, the host's
    prediction of them)."""
    plan = w.plan(pt, unified_max=phi, **plan_kw)
    assert w.kernel_build.variant.unified_max == 1
    out = poisoned_output(q)
    lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
    w.run(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), out=out, lse=lse)
    fell_back = w.unified_max_fallbacks()
    ref_o, ref_lse = reference_decode(q, k, v, pt, kv_dtype=kv_dtype)
    o = to_float64(out.get())
    infinite = np.isinf(ref_o)                 # an Inf in V: the same infinities, then the rest
    np.testing.assert_array_equal(o[infinite], ref_o[infinite])
    o[infinite] = ref_o[infinite] = 0
    lse = lse.get()
    assert_matches_reference(o, lse, ref_o, ref_lse, 1e-2, f"{plan}, phi {phi}")
    if heads_checked is not None:
        b, heads = heads_checked
        assert_matches_reference(o[b:b + 1, heads], lse[b:b + 1, heads], ref_o[b:b + 1, heads],
                                 ref_lse[b:b + 1, heads], 1e-2, f"{plan}, phi {phi}, {b} {heads}")
    predicted = UM.fallback_items(plan, to_float64(q), k, v, pt, phi, w.dtype, kv_dtype=kv_dtype)
    return plan, fell_back, int(predicted.sum())


def phi_for(pt, q, k, dtype, kv_dtype=None):
    from splitkv import plan_fixed_splits

    problem = DecodeProblem.from_page_table(pt, q.shape[1], k.shape[2], D)
    maxima = UM.row_maxima(plan_fixed_splits(problem, 4), to_float64(q), k, pt, kv_dtype=kv_dtype)
    return UM.choose_unified_max(maxima, dtype, kv_dtype)


@pytest.mark.parametrize("dtype,kv_dtype", [("bfloat16", None), ("float16", None),
                                            ("bfloat16", "float8_e4m3fn")])
def test_realistic_scores_run_without_fallback_on_every_strategy(dtype, kv_dtype):
    rng = np.random.default_rng(5)
    pt, q, k, v = make(rng, dtype, kv_dtype)
    phi = phi_for(pt, q, k, dtype, kv_dtype)
    w = BatchDecodeWrapper(HQ, HK, D, 16, dtype, kv_dtype=kv_dtype)
    for strategy, n in PLANS:
        plan, fell_back, predicted = run(w, pt, q, k, v, phi, kv_dtype, strategy=strategy,
                                         num_splits=n)
        assert fell_back == predicted == 0, f"{plan}: {fell_back} fell back"
    # the planner's own plan, then a plain plan: the plain build again, nothing counted
    run(w, pt, q, k, v, phi, kv_dtype)
    w.plan(pt)
    assert w.kernel_build.variant.unified_max == 0 and w.unified_max_fallbacks() == 0


def test_the_cluster_merge_under_the_unified_max():
    from splitkv.runtime import device_info

    if int(device_info()["cc"]) < 90:
        pytest.skip("thread-block clusters need compute capability 9.0")
    rng = np.random.default_rng(6)
    pt, q, k, v = make(rng, lens=[9, 1000])
    phi = phi_for(pt, q, k, "bfloat16")
    w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16")
    problem = DecodeProblem.from_page_table(pt, HQ, HK, D)
    for n in (2, 4):
        plan, fell_back, predicted = run(w, pt, q, k, v, phi,
                                         plan=plan_from_chunk_counts(problem, [n, n], "fused"))
        assert w.cluster_size == n and fell_back == predicted == 0
        # phi far off: every CTA of the cluster streams twice, and the cluster still merges
        plan, fell_back, predicted = run(w, pt, q, k, v, phi - 60,
                                         plan=plan_from_chunk_counts(problem, [n, n], "fused"))
        live = int((plan.chunk_end > plan.chunk_start).sum()) * HK
        assert w.cluster_size == n and fell_back == predicted == live


@pytest.mark.parametrize("dtype,kv_dtype", [("bfloat16", None), ("float16", None),
                                            ("bfloat16", "float8_e5m2")])
@pytest.mark.parametrize("strategy,n", [("split_merge", 3), ("fused", 4)])
def test_inputs_built_to_break_phi_fall_back_and_stay_exact(dtype, kv_dtype, strategy, n):
    rng = np.random.default_rng(7)
    pt, q, k, v = make(rng, dtype, kv_dtype)
    phi = phi_for(pt, q, k, dtype, kv_dtype)
    w = BatchDecodeWrapper(HQ, HK, D, 16, dtype, kv_dtype=kv_dtype)
    plan, _, _ = run(w, pt, q, k, v, phi, kv_dtype, strategy=strategy, num_splits=n)
    live = int((plan.chunk_end > plan.chunk_start).sum()) * HK   # the items with tokens
    # phi far below every score: every item with tokens overflows the band
    _, fell_back, predicted = run(w, pt, q, k, v, phi - 60, kv_dtype, strategy=strategy,
                                  num_splits=n)
    assert fell_back == predicted == live
    # far above: below the band (float16 P's is narrow; bfloat16's reaches 41 below)
    _, fell_back, predicted = run(w, pt, q, k, v, phi + 80, kv_dtype, strategy=strategy,
                                  num_splits=n)
    assert fell_back == predicted == live
    if kv_dtype is None:
        # one huge score: request 0, kv head 2, its 100th token: K there is q's head 8 x 60
        k_spiked = k.copy()
        slot = pt.token_slots(0)[100]
        row = to_float64(q[0, 8]) * 60 / np.abs(to_float64(q[0, 8])).max()
        k_spiked.reshape(-1, HK, D)[slot, 2] = _bits(row, dtype)
        _, fell_back, predicted = run(w, pt, q, k_spiked, v, phi, kv_dtype, strategy=strategy,
                                      num_splits=n, heads_checked=(0, slice(8, 12)))
        assert fell_back == predicted == 1
        # all scores equal (every token's K the same row): in band, no fallback
        k_flat = np.broadcast_to(k.reshape(-1, HK, D)[:1], k.reshape(-1, HK, D).shape)
        k_flat = np.ascontiguousarray(k_flat).reshape(k.shape)
        phi_flat = phi_for(pt, q, k_flat, dtype)
        _, fell_back, predicted = run(w, pt, q, k_flat, v, phi_flat, kv_dtype,
                                      strategy=strategy, num_splits=n)
        assert fell_back == predicted == 0


def _bits(values, dtype):
    from splitkv.measure.test_data import float_to_bits

    return float_to_bits(np.asarray(values, np.float32), dtype)


@pytest.mark.parametrize("where", ["q nan", "k inf", "v inf", "v nan"])
def test_nan_and_inf_inputs_fall_back_and_stay_where_they_are(where):
    rng = np.random.default_rng(8)
    pt, q, k, v = make(rng)
    phi = phi_for(pt, q, k, "bfloat16")
    bits = {"nan": 0x7FC0, "inf": 0x7F80}[where.split()[1]]
    q, k, v = q.copy(), k.copy(), v.copy()
    if where.startswith("q"):
        q[1, 9, 3] = bits                      # request 1, query head 9 (kv head 2)
    else:
        target = k if where.startswith("k") else v
        target.reshape(-1, HK, D)[pt.token_slots(1)[200], 2, 3] = bits
    w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16")
    for strategy, n in PLANS[:3]:
        plan, fell_back, predicted = run(w, pt, q, k, v, phi, strategy=strategy, num_splits=n)
        assert fell_back == predicted >= 1, f"{plan}"


def test_multi_token_rows_soft_cap_and_sinks_under_the_unified_max():
    rng = np.random.default_rng(9)
    pt, q1, k, v = make(rng)
    qo_indptr = np.array([0, 4, 6, 7, 9])            # 4, 2, 1 (no KV), 2 rows
    q = random_device_array((9, HQ, D), "bfloat16", rng).get()
    sinks = np.linspace(-1, 2, HQ).astype(np.float32)
    w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16")
    phi = phi_for(pt, q1, k, "bfloat16")
    for strategy, n in PLANS[:3]:
        w.plan(pt, qo_indptr=qo_indptr, logits_soft_cap=6.0, unified_max=phi,
               strategy=strategy, num_splits=n)
        assert w.kernel_build.variant.unified_max == 1 and w.kernel_build.variant.multi_token == 1
        out = poisoned_output(q)
        lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
        w.run(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), out=out, lse=lse,
              sinks=cupy.asarray(sinks))
        ref_o, ref_lse = reference_decode(q, k, v, pt, qo_indptr=qo_indptr, logits_soft_cap=6.0,
                                          sinks=sinks.astype(np.float64))
        assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2,
                                 f"{strategy}/{n}")
        assert w.unified_max_fallbacks() == 0, f"{strategy}/{n}: the unified pass did not hold"


def test_what_the_unified_max_does_not_take_is_refused_by_name():
    rng = np.random.default_rng(10)
    pt, q, k, v = make(rng)
    w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16")
    with pytest.raises(TypeError, match="^unified_max: expected a number"):
        w.plan(pt, unified_max="3")
    with pytest.raises(ValueError, match="^unified_max: expected a finite"):
        w.plan(pt, unified_max=float("nan"))
    g = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16", use_cuda_graph=True, max_batch_size=4,
                           max_num_pages=pt.kv_indices.size)
    with pytest.raises(ValueError, match="^unified_max: graph-stable wrappers"):
        g.plan(pt, unified_max=2.0)


def test_two_row_tiles_and_a_request_with_only_its_sink():
    """Group 32 (two row tiles a CTA: the band check's scratch for the second, the group's
    named barriers in both passes), on realistic scores and with phi far off; then a request
    with no KV and a sink 100 units below phi: its LSE is the sink's (its empty state keeps
    the max -inf, so the sink is not lost under phi)."""
    rng = np.random.default_rng(11)
    hq, hk = 64, 2
    pt, q, k, v = make(rng, hq=hq, hk=hk)
    phi = phi_for(pt, q, k, "bfloat16")
    w = BatchDecodeWrapper(hq, hk, D, 16, "bfloat16")
    for strategy, n in PLANS[1:3]:
        plan, fell_back, predicted = run(w, pt, q, k, v, phi, strategy=strategy, num_splits=n)
        assert w.kernel_build.row_tiles == 2 and fell_back == predicted == 0
        plan, fell_back, predicted = run(w, pt, q, k, v, phi + 80, strategy=strategy,
                                         num_splits=n)
        assert fell_back == predicted == int((plan.chunk_end > plan.chunk_start).sum()) * hk
    sinks = np.full(hq, phi - 100, np.float32)
    w.plan(pt, unified_max=phi)
    out = poisoned_output(q)
    lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
    w.run(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), out=out, lse=lse,
          sinks=cupy.asarray(sinks))
    ref_o, ref_lse = reference_decode(q, k, v, pt, sinks=sinks.astype(np.float64))
    assert LENS[2] == 0 and np.allclose(lse.get()[2], phi - 100, rtol=1e-5), lse.get()[2]
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2, "sinks")


def test_torch_tensors_and_a_torch_cuda_graph_under_the_unified_max():
    """As an engine calls it from PyTorch: torch block table and lengths to plan(unified_max=),
    torch q/k/v/out/lse to run(), the run captured once by torch.cuda.graph on a torch stream
    and replayed over fresh q written in place. Each replay equals the reference; the counter
    adds up the replays' fallbacks: none on realistic q, every item on q scaled far past phi's
    band (and those replays stay exact)."""
    torch = pytest.importorskip("torch")
    from splitkv import PageTable, plan_fixed_splits

    rng = np.random.default_rng(12)
    lens = np.array([2500, 33, 900])
    width, batch = 160, 3
    gen = torch.Generator(device="cuda").manual_seed(12)
    k = torch.randn(batch * width, 16, HK, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(batch * width, 16, HK, D, device="cuda", generator=gen).to(torch.bfloat16)
    k64, v64 = (x.float().cpu().numpy().astype(np.float64) for x in (k, v))   # bf16 -> f32: exact
    table = torch.from_numpy(rng.permutation(batch * width).reshape(batch, width).astype(np.int32))
    seq_lens = torch.from_numpy(lens.astype(np.int32))
    pt = PageTable.from_block_table(table.numpy(), lens, 16)
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    q64 = q.float().cpu().numpy().astype(np.float64)
    problem = DecodeProblem.from_page_table(pt, HQ, HK, D)
    phi = UM.choose_unified_max(UM.row_maxima(plan_fixed_splits(problem, 4), q64, k64, pt),
                                "bfloat16")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, HQ), float("nan"), device="cuda")
    w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16")
    plan = w.plan(block_table=table, seq_lens=seq_lens, strategy="split_merge", num_splits=3,
                  unified_max=phi)
    live = int((plan.chunk_end > plan.chunk_start).sum()) * HK
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        w.run(q, k, v, out=out, lse=lse, stream=stream)        # compiles before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            w.run(q, k, v, out=out, lse=lse, stream=stream)
    stream.synchronize()
    counted = w.unified_max_fallbacks()
    assert counted == 0, f"{counted} items fell back on realistic q"
    for step, scale in enumerate([1, 1, 400, 1]):
        with torch.cuda.stream(stream):
            q.copy_((torch.randn(q.shape, device="cuda", generator=gen) * scale).to(q.dtype))
            out.fill_(float("nan"))
            graph.replay()
        stream.synchronize()
        q64 = q.float().cpu().numpy().astype(np.float64)
        ref_o, ref_lse = reference_decode(q64, k64, v64, pt)
        got = out.float().cpu().numpy().astype(np.float64)
        assert_matches_reference(got, lse.cpu().numpy(), ref_o, ref_lse, 1e-2,
                                 f"replay {step}, q x {scale}")
        predicted = int(UM.fallback_items(plan, q64, k64, v64, pt, phi, "bfloat16").sum())
        added, counted = w.unified_max_fallbacks() - counted, w.unified_max_fallbacks()
        assert added == predicted, f"replay {step}: {added} fell back, predicted {predicted}"
        if scale > 1:
            assert added == live, f"q x {scale}: {added} fell back of {live} live items"
