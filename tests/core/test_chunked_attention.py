"""Chunked local attention (``attention_chunk_size``, Llama 4): a query at position p sees only
the keys of its chunk, (p // C) * C .. p. Its float64 meaning (the reference against a direct
softmax), the plans that cover only those keys (alone and with a window), the CPU executor's
answer on every strategy and on the planner's own plans, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import DecodeProblem, execute_plan_cpu, plan_fixed_splits, reference_decode
from splitkv.core import variants as VA
from splitkv.core.validation import check_plan_for_table
from splitkv.planner import choose_plan
from splitkv.planner.profile_lookup import load_profile

from helpers.batches import build_batch

MODEL = load_profile(device_name="NVIDIA H200", num_sms=132).cost_model().with_clusters(False)


def test_a_query_sees_the_keys_of_its_own_chunk():
    assert VA.visible(8191, 8192, -1, 8192) == (0, 8192)       # the last of the first chunk
    assert VA.visible(8192, 8193, -1, 8192) == (8192, 8193)    # the first of the next: itself
    assert VA.visible(9000, 9001, -1, 8192) == (8192, 9001)
    assert VA.visible(9000, 9001, 100, 8192) == (8900, 9001)   # the window starts later
    assert VA.visible(9000, 9001, 2000, 8192) == (8192, 9001)  # the chunk starts later
    assert VA.visible(9000, 9001, -1, 0) == (0, 9001)          # 0: no chunks


def test_the_reference_is_a_softmax_over_the_chunks_keys(rng):
    b = build_batch(rng, [1, 64, 65, 200, 0], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                    page_size=8)
    out, lse = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, attention_chunk_size=64)
    for r, n in enumerate(b.page_table.kv_lens):
        if n == 0:
            assert np.all(out[r] == 0) and np.all(np.isneginf(lse[r]))
            continue
        slots = b.page_table.token_slots(r)[(n - 1) // 64 * 64:n]
        for h in range(4):
            k = b.k_cache.reshape(-1, 2, 64)[slots, h // 2].astype(np.float64)
            v = b.v_cache.reshape(-1, 2, 64)[slots, h // 2].astype(np.float64)
            s = k @ b.q[r, h].astype(np.float64) / np.sqrt(64)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[r, h], p @ v / p.sum(), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[r, h], s.max() + np.log(p.sum()), rtol=1e-12)


def test_a_chunked_plan_covers_only_the_last_positions_chunk():
    problem = DecodeProblem([131072, 8192, 8193, 100, 0], 32, 8, 128, 16,
                            attention_chunk_size=8192)
    np.testing.assert_array_equal(problem.kv_begin, [122880, 0, 8192, 0, 0])
    np.testing.assert_array_equal(problem.read_lens, [8192, 8192, 1, 100, 0])
    both = DecodeProblem([131072, 8193, 100], 32, 8, 128, 16, window_left=4095,
                         attention_chunk_size=8192)
    np.testing.assert_array_equal(both.kv_begin, [131072 - 4096, 8192, 0])
    assert "attention_chunk_size=8192" in repr(problem)
    none = DecodeProblem([100], 32, 8, 128, 16, attention_chunk_size=None)    # None: no chunks
    assert none.attention_chunk_size == 0 and not none.windowed
    plan = plan_fixed_splits(problem, 4, "split_merge", align=64)
    for b in range(problem.batch_size):
        chunks = slice(plan.merge_indptr[b], plan.merge_indptr[b + 1])
        if problem.kv_lens[b]:
            assert plan.chunk_start[chunks][0] == problem.kv_begin[b]
            assert plan.chunk_end[chunks][-1] == problem.kv_lens[b]


def test_the_planner_plans_a_chunk_like_a_context_of_its_length():
    """The last 8,192-token chunk of a 128k context: the plan of a plain 8k context, moved."""
    chunked = choose_plan(DecodeProblem([131072], 32, 8, 128, 16, attention_chunk_size=8192),
                          MODEL)
    plain = choose_plan(DecodeProblem([8192], 32, 8, 128, 16), MODEL)
    assert (chunked.strategy, chunked.num_chunks) == (plain.strategy, plain.num_chunks)
    assert chunked.predicted_us == plain.predicted_us
    np.testing.assert_array_equal(chunked.chunk_start - 122880, plain.chunk_start)


@pytest.mark.parametrize("window", [-1, 30])
@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 5)])
def test_the_executor_runs_chunked_plans_to_the_reference(rng, strategy, splits, window):
    b = build_batch(rng, [300, 1, 129, 0, 700, 128], num_qo_heads=8, num_kv_heads=2,
                    head_dim=64)
    problem = DecodeProblem.from_page_table(b.page_table, 8, 2, 64, "float16",
                                            window_left=window, attention_chunk_size=128)
    want_o, want_lse = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table,
                                        window_left=window, attention_chunk_size=128)
    for plan in (plan_fixed_splits(problem, splits, strategy), choose_plan(problem, MODEL)):
        out, lse = execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table)
        np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    # not the plain answer: the chunks hide keys
    plain_o, _ = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, window_left=window)
    assert not np.allclose(plain_o[2], want_o[2])      # 129 tokens: its chunk is its last


def test_chunked_attention_refuses_what_it_cannot_serve(rng):
    b = build_batch(rng, [300, 129], num_qo_heads=8, num_kv_heads=2, head_dim=64)
    problem = DecodeProblem.from_page_table(b.page_table, 8, 2, 64, "float16",
                                            attention_chunk_size=128)
    plan = plan_fixed_splits(problem, 2, "split_merge")
    with pytest.raises(ValueError, match="attention_chunk_size: the plan was made for "
                                         "attention_chunk_size=128, this call has 64"):
        execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table, attention_chunk_size=64)
    with pytest.raises(ValueError, match="attention_chunk_size=128, this call has 0"):
        check_plan_for_table(plan, b.page_table, attention_chunk_size=0)
    with pytest.raises(ValueError, match="chunked attention takes one query row a request"):
        execute_plan_cpu(plan, np.repeat(b.q, 2, axis=0), b.k_cache, b.v_cache, b.page_table,
                         qo_indptr=[0, 2, 4])
    for bad, error in ((-1, ValueError), (1.5, TypeError), ("8192", TypeError)):
        with pytest.raises(error, match="attention_chunk_size"):
            DecodeProblem([100], 8, 2, 64, 16, attention_chunk_size=bad)
        with pytest.raises(error, match="attention_chunk_size"):
            reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, attention_chunk_size=bad)
