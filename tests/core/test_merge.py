"""merge_states / merge_states_n: exact combination of attention over disjoint KV segments."""

import re

import numpy as np
import pytest

from splitkv import merge_states, merge_states_n
from splitkv.core.reference import attend

TOL = dict(rtol=1e-12, atol=1e-12)


def segment_states(rng, sizes, heads=3, d=64, scale=1.0):
    """Attention of the same queries over consecutive KV segments, and over their union."""
    q = scale * rng.standard_normal((heads, d))
    k = rng.standard_normal((sum(sizes), d))
    v = rng.standard_normal((sum(sizes), d))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    parts = [attend(q, k[lo:hi], v[lo:hi], 0.125) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return parts, attend(q, k, v, 0.125)


def test_two_segments_merge_to_attention_over_both(rng):
    (a, b), whole = segment_states(rng, [30, 11])
    o, lse = merge_states(*a, *b)
    np.testing.assert_allclose(o, whole[0], **TOL)
    np.testing.assert_allclose(lse, whole[1], **TOL)


def test_commutative(rng):
    (a, b), _ = segment_states(rng, [5, 50])
    ab, ba = merge_states(*a, *b), merge_states(*b, *a)
    np.testing.assert_allclose(ab[0], ba[0], **TOL)
    np.testing.assert_allclose(ab[1], ba[1], **TOL)


def test_associative(rng):
    (a, b, c), whole = segment_states(rng, [7, 1, 40])
    left = merge_states(*merge_states(*a, *b), *c)
    right = merge_states(*a, *merge_states(*b, *c))
    for got in (left, right):
        np.testing.assert_allclose(got[0], whole[0], **TOL)
        np.testing.assert_allclose(got[1], whole[1], **TOL)


def test_n_way_merge_in_any_order_and_grouping(rng):
    parts, whole = segment_states(rng, [3, 9, 1, 27, 14, 2])
    o = np.stack([p[0] for p in parts])
    lse = np.stack([p[1] for p in parts])
    for order in (np.arange(6), rng.permutation(6), rng.permutation(6)):
        got = merge_states_n(o[order], lse[order])
        np.testing.assert_allclose(got[0], whole[0], **TOL)
        np.testing.assert_allclose(got[1], whole[1], **TOL)
    grouped = merge_states(*merge_states_n(o[:4], lse[:4]), *merge_states_n(o[4:], lse[4:]))
    np.testing.assert_allclose(grouped[0], whole[0], **TOL)
    np.testing.assert_allclose(grouped[1], whole[1], **TOL)


def test_single_state_is_returned_unchanged(rng):
    (a,), _ = segment_states(rng, [12])
    o, lse = merge_states_n(a[0][None], a[1][None])
    np.testing.assert_allclose(o, a[0], rtol=1e-15)
    np.testing.assert_array_equal(lse, a[1])


def test_empty_state_is_the_identity(rng):
    (a,), _ = segment_states(rng, [12])
    empty = (np.zeros_like(a[0]), np.full_like(a[1], -np.inf))
    for got in (merge_states(*a, *empty), merge_states(*empty, *a)):
        np.testing.assert_allclose(got[0], a[0], rtol=1e-15)
        np.testing.assert_array_equal(got[1], a[1])


def test_all_empty_gives_zeros_and_minus_inf():
    o = np.zeros((4, 2, 3, 64))
    lse = np.full((4, 2, 3), -np.inf)
    out, lse_out = merge_states_n(o, lse)
    assert out.shape == (2, 3, 64) and lse_out.shape == (2, 3)
    assert np.all(out == 0) and np.all(lse_out == -np.inf)
    out, lse_out = merge_states(o[0], lse[0], o[1], lse[1])
    assert np.all(out == 0) and np.all(lse_out == -np.inf)


def test_mixed_empty_and_full_rows(rng):
    # Row 0 of each state is empty, row 1 is not: rows are merged independently.
    (a, b), whole = segment_states(rng, [8, 8], heads=2)
    a[1][0] = b[1][0] = -np.inf
    a[0][0] = b[0][0] = 0
    o, lse = merge_states(*a, *b)
    assert np.all(o[0] == 0) and lse[0] == -np.inf
    np.testing.assert_allclose(o[1], whole[0][1], **TOL)


@pytest.mark.parametrize("scale", [1e2, 1e4])
def test_huge_lse_gaps_are_finite_and_exact(rng, scale):
    (a, b, c), whole = segment_states(rng, [20, 20, 20], scale=scale)
    assert np.abs(whole[1]).max() > scale / 10
    o, lse = merge_states_n(np.stack([a[0], b[0], c[0]]), np.stack([a[1], b[1], c[1]]))
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    np.testing.assert_allclose(o, whole[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-14)


def test_equal_lse_averages(rng):
    o = rng.standard_normal((2, 5, 64))
    lse = np.full((2, 5), 3.0)
    out, lse_out = merge_states_n(o, lse)
    np.testing.assert_allclose(out, o.mean(axis=0), rtol=1e-14)
    np.testing.assert_allclose(lse_out, 3.0 + np.log(2), rtol=1e-15)


def test_low_precision_keeps_output_dtype(rng):
    (a, b), whole = segment_states(rng, [10, 10])
    o, lse = merge_states(a[0].astype(np.float16), a[1].astype(np.float32),
                          b[0].astype(np.float16), b[1].astype(np.float32))
    assert o.dtype == np.float16 and lse.dtype == np.float32
    np.testing.assert_allclose(o, whole[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-6)


def test_batched_leading_axes(rng):
    o = rng.standard_normal((3, 4, 2, 8, 64))
    lse = rng.standard_normal((3, 4, 2, 8))
    out, lse_out = merge_states_n(o, lse)
    assert out.shape == (4, 2, 8, 64) and lse_out.shape == (4, 2, 8)
    one = merge_states_n(o[:, 1, 0, 5], lse[:, 1, 0, 5])
    np.testing.assert_allclose(out[1, 0, 5], one[0], rtol=1e-15)


def test_shape_errors_name_the_argument(rng):
    o, lse = np.zeros((2, 3, 64)), np.zeros((2, 3))
    with pytest.raises(ValueError, match="lse_a"):
        merge_states(o, lse[:, :2], o, lse)
    with pytest.raises(ValueError, match="lse_b"):
        merge_states(o, lse, o, lse[:1])
    with pytest.raises(ValueError, match="o_b"):
        merge_states(o, lse, o[:1], lse[:1])
    with pytest.raises(ValueError, match="lse"):
        merge_states_n(o, lse[:, :1])
    with pytest.raises(ValueError, match="o: expected at least one state"):
        merge_states_n(np.zeros((0, 3, 64)), np.zeros((0, 3)))


# --- inputs: every bad one a TypeError / ValueError naming it, before any work ---------------

class FakeCupyArray:
    """Looks like a CuPy array to the checks (its type comes from the cupy package)."""
    __module__ = "cupy._core.core"

    def __init__(self, arr):
        self.shape, self.dtype, self.ndim = arr.shape, arr.dtype, arr.ndim


def good_states(rng):
    return rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3))


@pytest.mark.parametrize("bad", [None, 1, True, 1.5, 2 + 1j, "0.5", [0.5, 1.0], (1.0,), {"a": 1}],
                         ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("position", [0, 1, 2, 3])
def test_merge_states_refuses_non_arrays(rng, bad, position):
    o, lse = good_states(rng)
    args = [o[0], lse[0], o[1], lse[1]]
    args[position] = bad
    name = ("o_a", "lse_a", "o_b", "lse_b")[position]
    with pytest.raises(TypeError, match=f"^{name}: expected a NumPy or CuPy array"):
        merge_states(*args)


def test_lists_are_refused_not_an_attribute_error(rng):
    o, lse = good_states(rng)
    with pytest.raises(TypeError, match="^o: expected a NumPy or CuPy array, got list"):
        merge_states_n(o.tolist(), lse)
    with pytest.raises(TypeError, match="^lse: expected a NumPy or CuPy array, got list"):
        merge_states_n(o, lse.tolist())


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.uint16, np.bool_, np.complex128, np.str_,
                                   object])
@pytest.mark.parametrize("name", ["o", "lse"])
def test_merge_states_n_refuses_non_float_dtypes(rng, dtype, name):
    o, lse = good_states(rng)
    args = {"o": o, "lse": lse}
    args[name] = args[name].astype(dtype)
    with pytest.raises(TypeError, match=f"^{name}: dtype .* is not supported; expected one of"):
        merge_states_n(**args)


def test_lse_must_be_float32_or_float64(rng):
    o, lse = good_states(rng)
    with pytest.raises(TypeError, match=r"^lse: dtype 'float16' is not supported"):
        merge_states_n(o, lse.astype(np.float16))


@pytest.mark.parametrize("position, dtype, message", [
    (2, np.float32, "o_b: expected dtype float64 (the dtype of o_a), got float32"),
    (0, np.float16, "o_b: expected dtype float16 (the dtype of o_a), got float64"),
    (3, np.float32, "lse_b: expected dtype float64 (the dtype of lse_a), got float32"),
])
def test_merge_states_refuses_mixed_dtypes(rng, position, dtype, message):
    o, lse = good_states(rng)
    args = [o[0], lse[0], o[1], lse[1]]
    args[position] = args[position].astype(dtype)
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        merge_states(*args)


def test_a_mix_of_numpy_and_cupy_arrays_is_refused(rng):
    o, lse = good_states(rng)
    with pytest.raises(TypeError, match="^o_b: expected a NumPy array like o_a, got a CuPy array"):
        merge_states(o[0], lse[0], FakeCupyArray(o[1]), FakeCupyArray(lse[1]))
    with pytest.raises(TypeError, match="^lse: expected a CuPy array like o, got a NumPy array"):
        merge_states_n(FakeCupyArray(o), lse)


def test_rank_errors(rng):
    with pytest.raises(ValueError, match="^o_a: expected at least 1 dimension"):
        merge_states(np.float64(1.0), np.zeros(()), np.zeros(1), np.zeros(()))
    with pytest.raises(ValueError, match=r"^o: expected \[num_states, ..., head_dim\]"):
        merge_states_n(np.zeros(8), np.zeros(()))


def test_numpy_scalars_are_accepted_as_lse(rng):
    """One row of a state: lse[i] is a NumPy scalar, not a 0-d array."""
    (a, b), whole = segment_states(rng, [6, 9], heads=2)
    o, lse = merge_states(a[0][1], a[1][1], b[0][1], b[1][1])
    assert o.shape == (64,) and lse.shape == ()
    np.testing.assert_allclose(o, whole[0][1], **TOL)
    np.testing.assert_allclose(lse, whole[1][1], **TOL)
