"""ALiBi (``alibi_slopes``): a query at position p adds m_h * (j - p) to its scaled score of key
j, before the soft cap. Its float64 meaning against a direct softmax, the paper's slopes, the
CPU executor's answer on every strategy (the bias of a chunk's keys is the same wherever the
plan cuts), with windows, chunks, the cap and multi-token rows, and the checks."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import DecodeProblem, execute_plan_cpu, plan_fixed_splits, reference_decode
from splitkv.core import variants as VA

from helpers.batches import build_batch

HQ, HK, D = 8, 2, 64


def test_the_papers_slopes():
    np.testing.assert_allclose(VA.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    twelve = VA.alibi_slopes(12)            # 8 of their own, then every other one of 16's
    np.testing.assert_allclose(twelve[:8], 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(twelve[8:], 2.0 ** -(np.arange(1, 8, 2) / 2))
    assert VA.alibi_slopes(1).tolist() == [2.0 ** -8]
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError),
                       (None, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="num_heads: expected an integer"):
            VA.alibi_slopes(bad)


def test_the_reference_adds_the_bias_to_the_scaled_scores(rng):
    b = build_batch(rng, [1, 50, 0, 130], num_qo_heads=HQ, num_kv_heads=HK, head_dim=D,
                    page_size=16)
    slopes = rng.uniform(-0.3, 0.3, HQ)
    out, lse = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, alibi_slopes=slopes,
                                logits_soft_cap=7.0)
    k_all = b.k_cache.reshape(-1, HK, D).astype(np.float64)
    v_all = b.v_cache.reshape(-1, HK, D).astype(np.float64)
    for r, n in enumerate(b.page_table.kv_lens):
        if n == 0:
            assert np.all(out[r] == 0) and np.all(np.isneginf(lse[r]))
            continue
        slots = b.page_table.token_slots(r)
        for h in range(HQ):
            s = k_all[slots, h // 4] @ b.q[r, h].astype(np.float64) / np.sqrt(D)
            s = s + slopes[h] * (np.arange(n) - (n - 1))
            s = 7.0 * np.tanh(s / 7.0)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[r, h], p @ v_all[slots, h // 4] / p.sum(),
                                       rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[r, h], s.max() + np.log(p.sum()), rtol=1e-12)
    plain = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, logits_soft_cap=7.0)
    assert not np.allclose(plain[0][3], out[3])
    zero = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, logits_soft_cap=7.0,
                            alibi_slopes=np.zeros(HQ))
    np.testing.assert_array_equal(zero[0], plain[0])


@pytest.mark.parametrize("extra", [{}, {"window_left": 40}, {"attention_chunk_size": 64},
                                   {"logits_soft_cap": 5.0}], ids=["plain", "window", "chunks",
                                                                   "cap"])
@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 5)])
def test_the_executor_runs_alibi_plans_to_the_reference(rng, strategy, splits, extra):
    b = build_batch(rng, [300, 1, 129, 0, 700], num_qo_heads=HQ, num_kv_heads=HK, head_dim=D)
    slopes = VA.alibi_slopes(HQ)
    shape = {k: v for k, v in extra.items() if k in ("window_left", "attention_chunk_size")}
    problem = DecodeProblem.from_page_table(b.page_table, HQ, HK, D, "float16", **shape)
    plan = plan_fixed_splits(problem, splits, strategy)
    out, lse = execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table,
                                alibi_slopes=slopes, **extra)
    want_o, want_lse = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table,
                                        alibi_slopes=slopes, **extra)
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_multi_token_rows_each_take_their_own_position(rng):
    b = build_batch(rng, [300, 5, 129], num_qo_heads=HQ, num_kv_heads=HK, head_dim=D)
    qo_indptr = np.array([0, 3, 4, 6])
    q = rng.standard_normal((6, HQ, D)).astype(np.float16)
    slopes = VA.alibi_slopes(HQ)
    problem = DecodeProblem.from_page_table(b.page_table, HQ, HK, D, "float16")
    out, lse = execute_plan_cpu(plan_fixed_splits(problem, 3, "split_merge"), q, b.k_cache,
                                b.v_cache, b.page_table, qo_indptr=qo_indptr,
                                alibi_slopes=slopes)
    want_o, want_lse = reference_decode(q, b.k_cache, b.v_cache, b.page_table,
                                        qo_indptr=qo_indptr, alibi_slopes=slopes)
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("slopes,error,match", [
    (np.ones(HQ - 1), ValueError, r"alibi_slopes: expected shape \[8\]"),
    ("slopes", TypeError, "alibi_slopes: expected 8 numbers"),
    (np.array([np.nan] + [0.1] * (HQ - 1)), ValueError, "alibi_slopes: expected finite"),
    (np.array([np.inf] + [0.1] * (HQ - 1)), ValueError, "alibi_slopes: expected finite"),
    (np.ones(HQ, complex), TypeError, "alibi_slopes: expected 8 numbers .* of complex128"),
    (np.ones(HQ, bool), TypeError, "alibi_slopes: expected 8 numbers .* of bool"),
    (np.array([None] * HQ), TypeError, "alibi_slopes: expected 8 numbers .* of object"),
])
def test_bad_slopes_are_named(rng, slopes, error, match):
    b = build_batch(rng, [30], num_qo_heads=HQ, num_kv_heads=HK, head_dim=D)
    with pytest.raises(error, match=match):
        reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, alibi_slopes=slopes)
