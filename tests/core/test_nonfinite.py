"""NaN and Inf are never hidden as an empty request, on every host path.

The rule (README, Conventions): a (request, query head) with a non-finite score (NaN or Inf in
its q or its kv head's K) gets NaN for its whole output and its LSE; a request with no tokens
gets zeros and -inf whatever its q holds; NaN or Inf in V reaches the output components it is
summed into, the LSE unchanged. ``merge_states`` treats a NaN or +inf LSE as such a state. No
other request or head changes, to the bit.
"""

import numpy as np
import pytest

from splitkv import execute_plan_cpu, merge_states, merge_states_n, plan_fixed_splits, plan_from_chunk_counts, reference_decode

LENS = [20, 33, 0, 17]       # request 1 is poisoned, request 2 is empty
HQ, HK, D = 4, 2, 64         # groups of 2: q heads 0, 1 read kv head 0


def make_plan(problem, strategy):
    if strategy == "single":
        return plan_fixed_splits(problem, 1)
    return plan_from_chunk_counts(problem, [3, 4, 1, 2], strategy)   # poisoned request in 4 chunks


def poison(bt, where, token=21, dim=5):
    """Copies of (q, k_cache, v_cache) with one non-finite value in request 1 (token ``token``,
    kv head 0, or query head 0); returns them and the query heads whose score is non-finite."""
    q, k, v = bt.q.copy(), bt.k_cache.copy(), bt.v_cache.copy()
    slot = bt.page_table.token_slots(1)[token]
    k_flat, v_flat = k.reshape(-1, HK, D), v.reshape(-1, HK, D)
    value = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[where.split("_")[1]]
    if where.startswith("q"):
        q[1, 0, dim] = value
        return (q, k, v), [0]
    if where.startswith("k"):
        k_flat[slot, 0, dim] = value      # +-inf times q's component: a score of +-inf
        return (q, k, v), [0, 1]
    v_flat[slot, 0, dim] = value
    return (q, k, v), []


def run_all(bt, plan, arrays):
    return [reference_decode(*arrays, bt.page_table), execute_plan_cpu(plan, *arrays, bt.page_table)]


@pytest.mark.parametrize("strategy", ["single", "split_merge", "fused"])
@pytest.mark.parametrize("where", ["q_nan", "q_inf", "k_nan", "k_inf", "k_-inf"])
def test_nonfinite_score_gives_nan_for_that_head_only(make_batch, strategy, where):
    bt = make_batch(LENS, num_qo_heads=HQ, num_kv_heads=HK)
    plan = make_plan(bt.problem, strategy)
    clean = run_all(bt, plan, (bt.q, bt.k_cache, bt.v_cache))
    arrays, bad_heads = poison(bt, where)
    good_heads = [h for h in range(HQ) if h not in bad_heads]
    for (out, lse), (clean_out, clean_lse) in zip(run_all(bt, plan, arrays), clean):
        assert np.all(np.isnan(out[1, bad_heads])) and np.all(np.isnan(lse[1, bad_heads]))
        # Isolation: every other request, and the other heads of this one, to the bit.
        others = [0, 2, 3]
        np.testing.assert_array_equal(out[others], clean_out[others])
        np.testing.assert_array_equal(lse[others], clean_lse[others])
        np.testing.assert_array_equal(out[1, good_heads], clean_out[1, good_heads])
        np.testing.assert_array_equal(lse[1, good_heads], clean_lse[1, good_heads])
        assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)


@pytest.mark.parametrize("strategy", ["single", "split_merge", "fused"])
@pytest.mark.parametrize("where", ["v_nan", "v_inf"])
def test_nonfinite_value_reaches_its_output_component(make_batch, strategy, where):
    bt = make_batch(LENS, num_qo_heads=HQ, num_kv_heads=HK)
    plan = make_plan(bt.problem, strategy)
    clean = run_all(bt, plan, (bt.q, bt.k_cache, bt.v_cache))
    arrays, _ = poison(bt, where, dim=5)
    for (out, lse), (clean_out, clean_lse) in zip(run_all(bt, plan, arrays), clean):
        hit = out[1, :2, 5]                           # both query heads of kv head 0
        assert np.all(np.isnan(hit)) if where == "v_nan" else np.all(hit == np.inf)
        np.testing.assert_array_equal(lse, clean_lse)         # V never changes the LSE
        rest = np.ones(out.shape, bool)
        rest[1, :2, 5] = False
        assert np.all(np.isfinite(out[rest]))
        np.testing.assert_allclose(out[rest], clean_out[rest], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(out[[0, 2, 3]], clean_out[[0, 2, 3]])


@pytest.mark.parametrize("strategy", ["single", "split_merge", "fused"])
def test_empty_request_stays_empty_whatever_its_q(make_batch, strategy):
    bt = make_batch(LENS, num_qo_heads=HQ, num_kv_heads=HK)
    q = bt.q.copy()
    q[2] = np.nan                                  # request 2 has no tokens: no score to be NaN
    for out, lse in run_all(bt, make_plan(bt.problem, strategy), (q, bt.k_cache, bt.v_cache)):
        assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)
        assert np.all(np.isfinite(out[[0, 1, 3]]))


def test_float_overflow_of_a_score_is_nan_not_empty(make_batch):
    """Finite inputs whose product leaves the float64 range: a non-finite score too."""
    bt = make_batch([5, 9])
    q, k = bt.q.copy(), bt.k_cache.copy()
    q[0] = 1e200
    k.reshape(-1, 2, 64)[bt.page_table.token_slots(0)[3]] = 1e200     # q.k = 6.4e401
    for out, lse in run_all(bt, plan_fixed_splits(bt.problem, 2), (q, k, bt.v_cache)):
        assert np.all(np.isnan(out[0])) and np.all(np.isnan(lse[0]))
        assert np.all(np.isfinite(out[1])) and np.all(np.isfinite(lse[1]))


def test_float16_inputs_with_nan(make_batch):
    bt = make_batch(LENS, num_qo_heads=HQ, num_kv_heads=HK, dtype=np.float16)
    arrays, bad = poison(bt, "k_nan")
    for out, lse in run_all(bt, make_plan(bt.problem, "fused"), arrays):
        assert np.all(np.isnan(lse[1, bad])) and np.all(np.isfinite(lse[[0, 3]]))


# --- merge_states / merge_states_n ----------------------------------------------------------

def test_nan_lse_merges_to_nan_not_empty():
    """A NaN LSE merged with a finite state gives NaN, not the empty state (zeros, -inf)."""
    o = np.ones((1, 4))
    out, lse = merge_states(o, np.array([np.nan]), o, np.array([1.0]))
    assert np.all(np.isnan(out)) and np.isnan(lse[0])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("others", [[1.0, -2.0], [-np.inf, -np.inf], [np.inf, -np.inf]])
def test_nan_or_plus_inf_lse_poisons_its_row_only(rng, bad, others):
    o = rng.standard_normal((3, 4, 8))
    lse = rng.standard_normal((3, 4))
    clean_out, clean_lse = merge_states_n(o, lse)
    lse[0, 2] = bad
    lse[1:, 2] = others
    out, lse_out = merge_states_n(o, lse)
    assert np.all(np.isnan(out[2])) and np.isnan(lse_out[2])
    rows = [0, 1, 3]
    np.testing.assert_array_equal(out[rows], clean_out[rows])
    np.testing.assert_array_equal(lse_out[rows], clean_lse[rows])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nan_lse_in_low_precision(dtype):
    o = np.ones((2, 3, 4), dtype)
    lse = np.zeros((2, 3), np.float32)
    lse[1, 0] = np.nan
    out, lse_out = merge_states_n(o, lse)
    assert out.dtype == dtype and np.all(np.isnan(out[0])) and np.isnan(lse_out[0])
    assert np.all(out[1:] == 1)


def test_nan_in_o_reaches_its_component_even_from_an_empty_state(rng):
    o = rng.standard_normal((2, 3, 8))
    lse = np.array([[0.5, -np.inf, -np.inf], [1.5, 2.0, -np.inf]])
    clean_out, clean_lse = merge_states_n(o, lse)
    o[1, 0, 3] = np.nan        # a state of weight > 0
    o[0, 1, 4] = np.nan        # an empty state, merged with a non-empty one
    o[0, 2, 6] = np.inf        # every state of the row empty
    out, lse_out = merge_states_n(o, lse)
    assert np.isnan(out[0, 3]) and np.isnan(out[1, 4]) and np.isnan(out[2, 6])
    np.testing.assert_array_equal(lse_out, clean_lse)
    assert lse_out[2] == -np.inf
    mask = np.ones(out.shape, bool)
    mask[0, 3] = mask[1, 4] = mask[2, 6] = False
    np.testing.assert_array_equal(out[mask], clean_out[mask])
    assert np.all(out[2][mask[2]] == 0)
