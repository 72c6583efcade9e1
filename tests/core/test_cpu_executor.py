"""Split invariance: however the KV is chunked, split + merge gives the reference answer."""

import numpy as np
import pytest

from splitkv import (DecodeProblem, PageTable, Plan, execute_plan_cpu, plan_chunk_tokens, plan_fixed_splits,
                     plan_from_chunk_counts, reference_decode)
from splitkv.core.cpu_executor import compute_partials, merge_partials
from splitkv.core.reference import attend

TOL = dict(rtol=1e-12, atol=1e-12)


def assert_matches_reference(bt, plan, **tol):
    tol = tol or TOL
    out, lse = execute_plan_cpu(plan, bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    ref_out, ref_lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    np.testing.assert_allclose(out, ref_out, **tol)
    np.testing.assert_allclose(lse, ref_lse, **tol)
    return out, lse


def hand_plan(problem, cuts, strategy="split_merge"):
    """A Plan from explicit cut points: ``cuts[b]`` are the inner chunk boundaries of request b."""
    req, start, end, indptr = [], [], [], [0]
    for b, n in enumerate(problem.kv_lens):
        edges = [0, *cuts[b], int(n)]
        start += edges[:-1]
        end += edges[1:]
        req += [b] * (len(edges) - 1)
        indptr.append(len(req))
    return Plan(problem, strategy, req, start, end, indptr)


LENS = [1, 16, 17, 40, 0, 77]     # page_size 16: single token, exactly one page, one past, ...


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("align", [1, 3, 16])
def test_fixed_splits_match_reference(make_batch, num_splits, align):
    bt = make_batch(LENS)
    assert_matches_reference(bt, plan_fixed_splits(bt.problem, num_splits, align=align))


@pytest.mark.parametrize("chunk_tokens", [1, 2, 7, 16, 32, 1000])
@pytest.mark.parametrize("strategy", ["split_merge", "fused"])
def test_chunk_tokens_match_reference(make_batch, chunk_tokens, strategy):
    bt = make_batch(LENS)
    plan = plan_chunk_tokens(bt.problem, chunk_tokens, strategy, align=1)
    if chunk_tokens == 1:
        assert np.all(plan.chunk_end - plan.chunk_start <= 1)    # one token per chunk
    assert_matches_reference(bt, plan)


def test_random_chunk_counts_match_reference(make_batch, rng):
    bt = make_batch(LENS)
    for _ in range(5):
        counts = rng.integers(1, 20, size=len(LENS))
        assert_matches_reference(bt, plan_from_chunk_counts(bt.problem, counts, "fused"))


def test_every_chunking_gives_the_same_answer(make_batch, rng):
    """All plans on one batch agree with each other to 1e-12, not only with the reference."""
    bt = make_batch(LENS, num_qo_heads=8, num_kv_heads=8)
    p = bt.problem
    plans = [plan_fixed_splits(p, 1), plan_fixed_splits(p, 4, align=16),
             plan_chunk_tokens(p, 1, "split_merge"), plan_chunk_tokens(p, 5, "fused", align=5)]
    results = [execute_plan_cpu(plan, bt.q, bt.k_cache, bt.v_cache, bt.page_table) for plan in plans]
    for out, lse in results[1:]:
        np.testing.assert_allclose(out, results[0][0], **TOL)
        np.testing.assert_allclose(lse, results[0][1], **TOL)


@pytest.mark.parametrize("name, cuts", [
    # LENS = [1, 16, 17, 40, 0, 77]
    ("inside pages", [[], [5], [3, 9], [7, 21, 39], [], [1, 30, 50, 70]]),
    ("on page edges", [[], [], [16], [16, 32], [], [16, 32, 48, 64]]),
    ("across page edges", [[], [15], [1, 16], [15, 17, 33], [], [10, 47, 76]]),
    ("one token each", [[], list(range(1, 16)), list(range(1, 17)), list(range(1, 40)), [],
                        list(range(1, 77))]),
    ("empty chunks inside", [[], [0, 8, 8], [17], [0, 40], [], [77]]),
])
def test_hand_built_plans_match_reference(make_batch, name, cuts):
    bt = make_batch(LENS)
    plan = hand_plan(bt.problem, cuts)
    assert_matches_reference(bt, plan)


def test_random_hand_built_cuts(make_batch, rng):
    bt = make_batch([300, 5, 129], num_qo_heads=16, num_kv_heads=2, page_size=8)
    for _ in range(10):
        cuts = [sorted(rng.choice(np.arange(1, n), size=rng.integers(0, min(n - 1, 12) + 1),
                                  replace=False).tolist()) for n in bt.problem.kv_lens]
        assert_matches_reference(bt, hand_plan(bt.problem, cuts))


@pytest.mark.parametrize("hq, hk", [(8, 8), (8, 2), (10, 2), (16, 2)])   # groups 1, 4, 5, 8
def test_gqa_groups(make_batch, hq, hk):
    bt = make_batch([33, 1, 64, 0], num_qo_heads=hq, num_kv_heads=hk)
    for plan in (plan_fixed_splits(bt.problem, 1), plan_fixed_splits(bt.problem, 3),
                 plan_chunk_tokens(bt.problem, 16, "fused", align=16)):
        assert_matches_reference(bt, plan)


def test_length_one_requests(make_batch):
    bt = make_batch([1] * 5, num_qo_heads=10, num_kv_heads=2)
    plan = plan_fixed_splits(bt.problem, 8)
    assert plan.num_chunks == 5 and plan.num_splits == 1
    out, _ = assert_matches_reference(bt, plan)
    v_flat = bt.v_cache.reshape(-1, 2, 64)
    for b in range(5):
        slot = bt.page_table.token_slots(b)[0]
        np.testing.assert_allclose(out[b, 0], v_flat[slot, 0], rtol=1e-14)


def test_zero_length_requests(make_batch):
    bt = make_batch([0, 50, 0])
    out, lse = assert_matches_reference(bt, plan_fixed_splits(bt.problem, 4))
    assert np.all(out[[0, 2]] == 0) and np.all(lse[[0, 2]] == -np.inf)
    assert np.all(np.isfinite(lse[1]))


def test_empty_batch(make_batch):
    bt = make_batch(np.zeros(0, dtype=np.int64), num_qo_heads=8, num_kv_heads=2)
    out, lse = execute_plan_cpu(plan_fixed_splits(bt.problem, 2), bt.q, bt.k_cache, bt.v_cache,
                                bt.page_table)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8)


@pytest.mark.parametrize("q_scale", [1e2, 1e4])
def test_huge_logits(make_batch, q_scale):
    bt = make_batch([200, 3, 41], num_qo_heads=4, num_kv_heads=2, q_scale=q_scale)
    for plan in (plan_fixed_splits(bt.problem, 7), plan_chunk_tokens(bt.problem, 1, "fused")):
        out, lse = assert_matches_reference(bt, plan, rtol=1e-9, atol=1e-12)
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
        assert np.abs(lse).max() > q_scale / 10


def test_all_equal_scores(make_batch):
    bt = make_batch([96, 7])
    bt.q[:] = 0
    out, lse = assert_matches_reference(bt, plan_chunk_tokens(bt.problem, 10, "split_merge"))
    np.testing.assert_allclose(lse[0], np.log(96), rtol=1e-14)


def test_one_dominant_token(make_batch):
    bt = make_batch([90], num_qo_heads=1, num_kv_heads=1)
    slots = bt.page_table.token_slots(0)
    k_flat = bt.k_cache.reshape(-1, 64)
    bt.q[:] = 0
    bt.q[0, 0, 0] = 1e5
    k_flat[slots, 0] = -1.0
    k_flat[slots[61], 0] = 1.0       # 1.25e4 above zero, the rest 1.25e4 below
    out, lse = assert_matches_reference(bt, plan_fixed_splits(bt.problem, 9))
    np.testing.assert_array_equal(out[0, 0], bt.v_cache.reshape(-1, 64)[slots[61]])


def test_float16_inputs(make_batch):
    bt = make_batch(LENS, dtype=np.float16)
    assert_matches_reference(bt, plan_chunk_tokens(bt.problem, 8, "fused"))


def test_contiguous_cache(rng):
    lens = np.array([12, 0, 3])
    pt = PageTable.contiguous(lens, 12)
    q = rng.standard_normal((3, 4, 64))
    k, v = rng.standard_normal((2, 3, 12, 2, 64))
    plan = plan_fixed_splits(DecodeProblem.from_page_table(pt, 4, 2, 64), 3)
    out, lse = execute_plan_cpu(plan, q, k, v, pt)
    ref = reference_decode(q, k, v, pt)
    np.testing.assert_allclose(out, ref[0], **TOL)


def test_partials_are_attention_over_each_chunk(make_batch):
    """Partial slot (c, h) holds attention of query head h over chunk c's tokens only."""
    bt = make_batch([40, 0, 9], num_qo_heads=8, num_kv_heads=2)
    plan = plan_fixed_splits(bt.problem, 3)
    partial_o, partial_lse = compute_partials(plan, bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    assert partial_o.shape == (plan.num_chunks, 8, 64)
    assert partial_lse.shape == (plan.num_chunks, 8)
    k_flat, v_flat = bt.k_cache.reshape(-1, 2, 64), bt.v_cache.reshape(-1, 2, 64)
    for c in range(plan.num_chunks):
        b = plan.chunk_request[c]
        slots = bt.page_table.token_slots(b)[plan.chunk_start[c]:plan.chunk_end[c]]
        for h in range(8):
            o, lse = attend(bt.q[b, h][None], k_flat[slots, h // 4], v_flat[slots, h // 4], 1 / 8)
            np.testing.assert_allclose(partial_o[c, h], o[0], **TOL)
            np.testing.assert_allclose(partial_lse[c, h], lse[0], **TOL)
    out, lse = merge_partials(plan, partial_o, partial_lse)
    np.testing.assert_allclose(out, reference_decode(bt.q, bt.k_cache, bt.v_cache,
                                                     bt.page_table)[0], **TOL)


def test_custom_sm_scale(make_batch):
    bt = make_batch([30, 9])
    plan = plan_fixed_splits(bt.problem, 4)
    out, lse = execute_plan_cpu(plan, bt.q, bt.k_cache, bt.v_cache, bt.page_table, sm_scale=0.3)
    ref = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table, sm_scale=0.3)
    np.testing.assert_allclose(out, ref[0], **TOL)
    np.testing.assert_allclose(lse, ref[1], **TOL)


def test_uint16_holds_the_bits_of_a_float16_plan(make_batch):
    """As on the GPU, uint16 arrays hold the bits of the plan's 16-bit dtype: under a float16
    plan they are float16 bits, not bfloat16 bits (read as bfloat16 they are off by ~100)."""
    b = make_batch([40, 7, 100], dtype=np.float16)
    problem = DecodeProblem.from_page_table(b.page_table, 4, 2, 64, dtype="float16")
    plan = plan_fixed_splits(problem, 2)
    as_float16 = execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table)
    as_bits = execute_plan_cpu(plan, *(a.view(np.uint16) for a in (b.q, b.k_cache, b.v_cache)),
                               b.page_table)
    np.testing.assert_array_equal(as_bits[0] if isinstance(as_bits, tuple) else as_bits,
                                  as_float16[0] if isinstance(as_float16, tuple) else as_float16)
