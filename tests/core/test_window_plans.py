"""Plans over sliding windows (``DecodeProblem(window_left=)``): each request's chunks cover only
its last window_left + 1 tokens, so the planner's cost follows the window, and the CPU executor
runs such plans to the reference's windowed answer on every strategy."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import DecodeProblem, execute_plan_cpu, plan_fixed_splits, reference_decode
from splitkv.planner import choose_plan
from splitkv.planner.profile_lookup import load_profile

from helpers.batches import build_batch

MODEL = load_profile(device_name="NVIDIA H200", num_sms=132).cost_model().with_clusters(False)


def test_a_windowed_plan_covers_only_the_window():
    problem = DecodeProblem([131072, 100, 0, 5000], 32, 8, 128, 16, window_left=4095)
    np.testing.assert_array_equal(problem.kv_begin, [131072 - 4096, 0, 0, 5000 - 4096])
    np.testing.assert_array_equal(problem.read_lens, [4096, 100, 0, 4096])
    assert problem.total_tokens == 4096 * 2 + 100
    plan = plan_fixed_splits(problem, 4, "split_merge", align=64)
    for b in range(4):
        chunks = slice(plan.merge_indptr[b], plan.merge_indptr[b + 1])
        assert plan.chunk_start[chunks][0] == problem.kv_begin[b]
        assert plan.chunk_end[chunks][-1] == problem.kv_lens[b]


def test_the_planner_plans_a_window_like_a_context_of_its_size():
    """A 4,096-token window over a 128k context: the plan of a plain 4k context, moved."""
    windowed = choose_plan(DecodeProblem([131072], 32, 8, 128, 16, window_left=4095), MODEL)
    plain = choose_plan(DecodeProblem([4096], 32, 8, 128, 16), MODEL)
    assert (windowed.strategy, windowed.num_chunks) == (plain.strategy, plain.num_chunks)
    assert windowed.predicted_us == plain.predicted_us
    np.testing.assert_array_equal(windowed.chunk_start - (131072 - 4096), plain.chunk_start)


@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 5)])
def test_the_executor_runs_windowed_plans_to_the_reference(rng, strategy, splits):
    b = build_batch(rng, [300, 1, 129, 0, 700], num_qo_heads=8, num_kv_heads=2, head_dim=64)
    problem = DecodeProblem.from_page_table(b.page_table, 8, 2, 64, "float16", window_left=50)
    plan = plan_fixed_splits(problem, splits, strategy)
    out, lse = execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table)
    want_o, want_lse = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, window_left=50)
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    # the planner's own choice too
    chosen = choose_plan(problem, MODEL)
    got = execute_plan_cpu(chosen, b.q, b.k_cache, b.v_cache, b.page_table, window_left=50)
    np.testing.assert_allclose(got[0], want_o, rtol=1e-12, atol=1e-12)


def test_the_planners_windowed_plans_are_valid_plans_that_split():
    """Large ragged batches under a window, where the planner splits (the ragged branch):
    every chosen plan rebuilt through Plan's own checks (chunks from each window's first
    token), and it equals the plain plan of the windows' lengths, moved."""
    rng = np.random.default_rng(4)
    for _ in range(40):
        lens = rng.integers(0, 200000, int(rng.integers(1, 40)))
        window = int(rng.choice([0, 63, 1000, 4095, 30000]))
        problem = DecodeProblem(lens, 32, 8, 128, 16, window_left=window)
        plan = choose_plan(problem, MODEL)
        type(plan)(problem, plan.strategy, plan.chunk_request, plan.chunk_start, plan.chunk_end,
                   plan.merge_indptr)
        plain = choose_plan(DecodeProblem(problem.read_lens, 32, 8, 128, 16), MODEL)
        assert plan.num_chunks == plain.num_chunks and plan.predicted_us == plain.predicted_us
        np.testing.assert_array_equal(plan.chunk_start - problem.kv_begin[plan.chunk_request],
                                      plain.chunk_start)


def test_windowed_plans_refuse_what_they_cannot_serve(rng):
    b = build_batch(rng, [300, 40], num_qo_heads=8, num_kv_heads=2, head_dim=64)
    problem = DecodeProblem.from_page_table(b.page_table, 8, 2, 64, "float16", window_left=50)
    plan = plan_fixed_splits(problem, 2, "split_merge")
    with pytest.raises(ValueError, match="window_left: the plan was made for window_left=50"):
        execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table, window_left=10)
    # -1 asks for no window, which a plan of windows cannot give (leaving it out runs the plan's)
    with pytest.raises(ValueError, match="this call has -1 \\(no window\\); leave it out"):
        execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table, window_left=-1)
    q = rng.standard_normal((4, 8, 64))
    with pytest.raises(ValueError, match="window_left: a plan made for window_left=50 runs "
                                         "query rows"):
        execute_plan_cpu(plan, q, b.k_cache, b.v_cache, b.page_table, qo_indptr=[0, 2, 4])
    with pytest.raises(ValueError, match="qo_indptr: 2 query rows with window_left=50 need"):
        execute_plan_cpu(plan, q, b.k_cache, b.v_cache, b.page_table, qo_indptr=[0, 2, 4],
                         window_left=50)
    with pytest.raises(ValueError, match="window_left"):
        DecodeProblem([10], 8, 2, 64, 16, window_left=-5)
    plain = plan_fixed_splits(DecodeProblem.from_page_table(b.page_table, 8, 2, 64, "float16"),
                              2, "split_merge")
    with pytest.raises(ValueError, match="chunk_start: the first chunk of request 0 must start "
                                         "at token 249 \\(its window\\)"):
        type(plan)(problem, "split_merge", plain.chunk_request, plain.chunk_start,
                   plain.chunk_end, plain.merge_indptr)


@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 5)])
def test_multi_token_rows_run_on_a_plan_that_covers_every_rows_window(rng, strategy, splits):
    """Query rows under a window: the plan covers window_left + max_q_len - 1 tokens back
    (``covering_window_left``, what the GPU wrapper plans) and each row masks its own window;
    a plan of the bare window is refused by name, as is one without the call's window."""
    from splitkv.core.variants import covering_window_left

    b = build_batch(rng, [300, 1, 129, 0, 700], num_qo_heads=8, num_kv_heads=2, head_dim=64)
    qo_indptr = np.array([0, 4, 5, 8, 9, 13])
    q = rng.standard_normal((13, 8, 64))
    assert covering_window_left(50, 4) == 53 and covering_window_left(-1, 4) == -1
    covering = DecodeProblem.from_page_table(b.page_table, 8, 2, 64, "float16", window_left=53)
    plan = plan_fixed_splits(covering, splits, strategy)
    out, lse = execute_plan_cpu(plan, q, b.k_cache, b.v_cache, b.page_table, window_left=50,
                                qo_indptr=qo_indptr, logits_soft_cap=3.0)
    want_o, want_lse = reference_decode(q, b.k_cache, b.v_cache, b.page_table, window_left=50,
                                        qo_indptr=qo_indptr, logits_soft_cap=3.0)
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    bare = plan_fixed_splits(DecodeProblem.from_page_table(b.page_table, 8, 2, 64, "float16",
                                                           window_left=50), splits, strategy)
    with pytest.raises(ValueError, match="need a plan that covers window_left=53"):
        execute_plan_cpu(bare, q, b.k_cache, b.v_cache, b.page_table, window_left=50,
                         qo_indptr=qo_indptr)
    with pytest.raises(ValueError, match="give it"):
        execute_plan_cpu(plan, q, b.k_cache, b.v_cache, b.page_table, qo_indptr=qo_indptr)
