"""Fuzzing (hypothesis) of merge_states, merge_states_n, reference_decode and execute_plan_cpu.

Each example draws a valid call (sizes, dtypes, values with NaN and +-Inf mixed in at random)
and, most of the time, spoils one argument: something that is not an array, a wrong dtype, a
wrong shape, a mix of dtypes. The only outcomes allowed:

- the result of the slow float64 computation written here, one row at a time, with the rule for
  non-finite values (README, "Conventions"); or
- a TypeError or ValueError raised before any work, whose message starts with the name of an
  argument and names the spoilt one.

Anything else (another exception type, an accepted bad input, a wrong value) fails. The counts
are in docs/RELIABILITY.md; ``SPLITKV_FUZZ_EXAMPLES=5000`` runs more examples than CI's 200.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from splitkv import (DecodeProblem, execute_plan_cpu, merge_states, merge_states_n,
                     plan_from_chunk_counts, reference_decode)
from splitkv.core.bfloat16 import float32_to_bits
from splitkv.testing import scattered_page_table

FUZZ = settings(max_examples=int(os.environ.get("SPLITKV_FUZZ_EXAMPLES", "200")), deadline=None,
                derandomize=True, database=None)

SPECIALS = (np.nan, np.inf, -np.inf)
LSE_SPECIALS = (np.nan, np.inf, -np.inf, -np.inf, -np.inf)     # mostly empty states
NOT_ARRAYS = (None, 0, 3, True, 1.5, 2j, "x", b"x", (1.0,), {"x": 1.0})
BAD_DTYPES = (np.int64, np.int32, np.uint8, np.bool_, np.complex128, np.str_, object)

# (spoilt, named in the error): a q whose head_dim differs from the cache's is reported as a
# k_cache shape error by check_attention_arrays (an argument blamed for another's fault, left
# as it is). The only such pair the fuzzing finds.
KNOWN_BLAME = {("q", "k_cache")}


@st.composite
def values(draw, shape, scale, specials=SPECIALS):
    """Uniform in [-scale, scale], with none, a few or many entries replaced by ``specials``."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.uniform(-scale, scale, shape)
    mask = rng.random(shape) < draw(st.sampled_from([0.0, 0.0, 0.0, 0.02, 0.3]))
    x[mask] = rng.choice(specials, size=int(mask.sum()))
    return x


def spoil_array(draw, name, arr):
    """``arr`` made invalid as a NumPy array argument: not an array, a bad dtype, one axis more."""
    kind = draw(st.sampled_from(["not_array", "list", "dtype", "rank"]))
    if kind == "not_array":
        return draw(st.sampled_from(NOT_ARRAYS))
    if kind == "list":
        return arr.tolist()
    if kind == "dtype":
        with np.errstate(invalid="ignore"):                     # NaN cast to an integer
            return arr.astype(draw(st.sampled_from(BAD_DTYPES)))
    return arr[..., None]


def assert_error_names(err: Exception, names, spoilt: str):
    message = str(err)
    event(f"{type(err).__name__} on {spoilt}")       # --hypothesis-show-statistics counts them
    first = message.split(":")[0]
    assert first in names, f"message does not start with an argument name: {message!r}"
    assert (first == spoilt or re.search(rf"\b{re.escape(spoilt)}\b", message)
            or (spoilt, first) in KNOWN_BLAME), f"{spoilt} was spoilt, the error says {message!r}"


def expect_outcome(call, names, spoilt, check) -> None:
    """``call()`` raises a TypeError / ValueError naming ``spoilt`` if an argument was spoilt,
    else returns a result that ``check`` accepts; nothing else."""
    try:
        got = call()
    except (TypeError, ValueError) as err:
        assert spoilt is not None, f"valid input refused: {err}"
        assert_error_names(err, names, spoilt)
        return
    assert spoilt is None, f"spoilt {spoilt} was accepted"
    check(got)


def assert_matches(got, want, rtol, atol, what, nan=None):
    """NaN where ``nan`` (by default: where ``want`` is NaN), non-finite where ``want`` is not
    finite, close where it is finite."""
    got = np.asarray(got, dtype=np.float64)
    event(f"{what}: result with NaN" if np.isnan(want).any() else f"{what}: result")
    assert got.shape == want.shape, what
    nan = np.isnan(want) if nan is None else nan
    fin = np.isfinite(want)
    assert np.all(np.isnan(got[nan])), f"{what}: NaN expected"
    assert not np.any(np.isfinite(got[~fin])), f"{what}: non-finite expected"
    assert np.all(np.isfinite(got[fin])), f"{what}: finite expected"
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=atol, err_msg=what)


# --- merge ----------------------------------------------------------------------------------

def merge_oracle(o, lse):
    """o [n, ..., d], lse [n, ...] -> (out [..., d], lse [...]), float64, row by row."""
    n, d, rows = o.shape[0], o.shape[-1], lse.shape[1:]
    o2, l2 = o.astype(np.float64).reshape(n, -1, d), lse.astype(np.float64).reshape(n, -1)
    out, lse_out = np.empty((o2.shape[1], d)), np.empty(o2.shape[1])
    for r in range(o2.shape[1]):
        ls = [float(x) for x in l2[:, r]]
        if any(math.isnan(x) or x == math.inf for x in ls):      # a non-finite state: NaN row
            out[r], lse_out[r] = math.nan, math.nan
        elif all(x == -math.inf for x in ls):                      # only empty states
            out[r] = [0.0 if np.all(np.isfinite(o2[:, r, j])) else math.nan for j in range(d)]
            lse_out[r] = -math.inf
        else:
            m = max(ls)
            w = [math.exp(x - m) for x in ls]
            total = math.fsum(w)
            for j in range(d):
                out[r, j] = sum(float(o2[i, r, j]) * (w[i] / total) for i in range(n))
            lse_out[r] = m + math.log(total)
    return out.reshape(*rows, d), lse_out.reshape(rows)


@st.composite
def merge_inputs(draw, min_states=1):
    n = draw(st.integers(min_states, 4))
    rows = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    d = draw(st.integers(1, 5))
    o_dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    lse_dtype = draw(st.sampled_from([np.float32, np.float64]))
    lse_scale = draw(st.sampled_from([1.0, 30.0, 1e4]))
    o = draw(values((n, *rows, d), 100.0)).astype(o_dtype)
    lse = draw(values((n, *rows), lse_scale, LSE_SPECIALS)).astype(lse_dtype)
    return o, lse


def check_merge_result(o, lse, got):
    """``got`` against the oracle, computed in the documented dtype (float64 for float64 o,
    float32 otherwise, with lse rounded to it)."""
    acc = np.float64 if o.dtype == np.float64 else np.float32
    want_o, want_lse = merge_oracle(o, lse.astype(acc))
    out, lse_out = got
    assert out.dtype == o.dtype and lse_out.dtype == acc
    finite_o = np.abs(o[np.isfinite(o)].astype(np.float64))
    scale = 1.0 + (finite_o.max() if finite_o.size else 0.0)
    rtol = {np.float64: 1e-10, np.float32: 1e-4, np.float16: 2e-3}[o.dtype.type]
    assert_matches(out, want_o, rtol, rtol * scale, "o")
    lse_tol = 1e-12 if acc == np.float64 else 1e-6
    assert_matches(lse_out, want_lse, lse_tol, lse_tol, "lse")


@FUZZ
@given(st.data())
def test_fuzz_merge_states_n(data):
    o, lse = data.draw(merge_inputs())
    args = {"o": o, "lse": lse}
    spoilt = data.draw(st.sampled_from([None, None, "o", "lse", "no_states"]))
    if spoilt == "no_states":
        args, spoilt = {"o": o[:0], "lse": lse[:0]}, "o"
    elif spoilt == "lse" and data.draw(st.booleans()):
        args["lse"] = lse.astype(np.float16)               # float16 is no dtype for an LSE
    elif spoilt is not None:
        args[spoilt] = spoil_array(data.draw, spoilt, args[spoilt])
    expect_outcome(lambda: merge_states_n(**args), ("o", "lse"), spoilt,
                   lambda got: check_merge_result(o, lse, got))


@FUZZ
@given(st.data())
def test_fuzz_merge_states(data):
    o, lse = data.draw(merge_inputs(min_states=2))
    args = [o[0], lse[0], o[1], lse[1]]
    if lse.ndim == 1 and data.draw(st.booleans()):
        args[1], args[3] = lse[0].dtype.type(lse[0]), lse[1].dtype.type(lse[1])   # NumPy scalars
    names = ("o_a", "lse_a", "o_b", "lse_b")
    spoilt = data.draw(st.sampled_from([None, None, *names, "mixed_o", "mixed_lse", "shape_b"]))
    if spoilt == "mixed_o":
        args[2] = args[2].astype(np.float64 if o.dtype != np.float64 else np.float32)
        spoilt = "o_b"
    elif spoilt == "mixed_lse":
        args[3] = np.asarray(args[3]).astype(np.float64 if lse.dtype != np.float64 else np.float32)
        spoilt = "lse_b"
    elif spoilt == "shape_b":                                   # a valid state of another shape
        args[2], args[3] = np.stack([args[2]] * 2), np.stack([np.asarray(args[3])] * 2)
        spoilt = "o_b"
    elif spoilt is not None:
        i = names.index(spoilt)
        args[i] = spoil_array(data.draw, spoilt, np.asarray(args[i]))
    expect_outcome(lambda: merge_states(*args), names, spoilt,
                   lambda got: check_merge_result(o[:2], lse[:2], got))


# --- reference_decode and execute_plan_cpu ----------------------------------------------------

def to_float64(arr: np.ndarray) -> np.ndarray:
    if arr.dtype == np.uint16:                                  # bfloat16 bits
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return arr.astype(np.float64)


def dense_oracle(q, k_cache, v_cache, page_table, sm_scale):
    """Decode attention one (request, query head) at a time, from the FlashInfer arrays."""
    q, k, v = to_float64(q), to_float64(k_cache), to_float64(v_cache)
    batch, hq, d = q.shape
    page_size, hk = k.shape[1], k.shape[2]
    sm_scale = 1 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    out, lse = np.zeros((batch, hq, d)), np.full((batch, hq), -np.inf)
    indptr, indices, last = (page_table.kv_indptr, page_table.kv_indices,
                             page_table.kv_last_page_len)
    for b in range(batch):
        pages = indices[indptr[b]:indptr[b + 1]]
        tokens = [(p, t) for i, p in enumerate(pages)
                  for t in range(page_size if i < len(pages) - 1 else last[b])]
        for h in range(hq):
            if not tokens:
                continue
            kh = h // (hq // hk)
            with np.errstate(all="ignore"):
                s = [sm_scale * float(np.dot(q[b, h], k[p, t, kh])) for p, t in tokens]
                if not all(math.isfinite(x) for x in s):
                    out[b, h], lse[b, h] = np.nan, np.nan
                    continue
                m = max(s)
                w = [math.exp(x - m) for x in s]
                total = math.fsum(w)
                out[b, h] = sum(wi * v[p, t, kh] for wi, (p, t) in zip(w, tokens)) / total
            lse[b, h] = m + math.log(total)
    return out, lse


@st.composite
def decode_inputs(draw, head_dim):
    batch = draw(st.integers(0, 3))
    lens = draw(st.lists(st.integers(0, 20), min_size=batch, max_size=batch))
    page_size = draw(st.sampled_from([1, 2, 3, 5, 8]))
    hk, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hq, d = hk * group, draw(head_dim)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table, num_pages = scattered_page_table(np.array(lens, dtype=np.int64), page_size, rng,
                                            draw(st.integers(0, 2)))
    scale = draw(st.sampled_from([1.0, 4.0, 30.0]))
    q = draw(values((batch, hq, d), scale))
    k, v = (draw(values((num_pages, page_size, hk, d), scale)) for _ in range(2))
    dtype = draw(st.sampled_from(["float16", "float32", "float64", "uint16"]))
    if dtype == "uint16":
        q, k, v = (float32_to_bits(x.astype(np.float32)) for x in (q, k, v))
    else:
        q, k, v = (x.astype(dtype) for x in (q, k, v))
    sm_scale = draw(st.one_of(st.none(), st.floats(1e-3, 10.0), st.integers(1, 3),
                              st.floats(1e-3, 10.0).map(np.float32)))
    return {"q": q, "k_cache": k, "v_cache": v, "page_table": table, "sm_scale": sm_scale}


def spoil_decode(draw, args):
    """One argument of ``args`` made invalid; returns its name, or None for a valid call."""
    spoilt = draw(st.sampled_from([None, None, "q", "k_cache", "v_cache", "page_table",
                                   "sm_scale"]))
    if spoilt is None:
        return None
    value = args[spoilt]
    if spoilt == "page_table":
        args[spoilt] = draw(st.sampled_from([None, "table", 0, value.kv_indices]))
    elif spoilt == "sm_scale":
        args[spoilt] = draw(st.sampled_from(["0.1", 1j, True, [0.1], 0, -1, 0.0, -0.5, math.nan,
                                             math.inf, -math.inf, np.float64(np.nan)]))
    elif draw(st.booleans()):
        args[spoilt] = spoil_array(draw, spoilt, value)
    else:
        batch, heads, d = args["q"].shape
        if spoilt == "q":
            shape = draw(st.sampled_from([(batch + 1, heads, d), (batch, heads, d + 1)]))
        elif spoilt == "k_cache":
            shape = (value.shape[0], value.shape[1] + 1, *value.shape[2:])
        else:
            other = np.float32 if value.dtype != np.float32 else np.float64
            # (a cache with more pages than the other is valid: their page counts may differ)
            shape = value.shape if draw(st.booleans()) else (value.shape[0], value.shape[1] + 1,
                                                             *value.shape[2:])
            args[spoilt] = np.zeros(shape, other if shape == value.shape else value.dtype)
            return spoilt
        args[spoilt] = np.zeros(shape, value.dtype)
    return spoilt


def check_decode_result(args, got):
    want_o, want_lse = dense_oracle(**args)
    out, lse = got
    assert out.dtype == lse.dtype == np.float64
    v = to_float64(args["v_cache"])
    scale = 1.0 + (np.abs(v[np.isfinite(v)]).max() if np.isfinite(v).any() else 0.0)
    # A row with a non-finite score is NaN throughout. Elsewhere an Inf in V may give Inf or NaN
    # (Inf times a weight that underflows to 0 in one order of summation and not in another).
    nan_rows = np.broadcast_to(np.isnan(want_lse)[..., None], want_o.shape)
    assert_matches(out, want_o, 1e-9, 1e-9 * scale, "out", nan=nan_rows)
    assert_matches(lse, want_lse, 1e-9, 1e-9, "lse")


@FUZZ
@given(st.data())
def test_fuzz_reference_decode(data):
    args = data.draw(decode_inputs(st.integers(1, 8)))
    valid = dict(args)
    spoilt = spoil_decode(data.draw, args)
    expect_outcome(lambda: reference_decode(**args), tuple(args), spoilt,
                   lambda got: check_decode_result(valid, got))


@FUZZ
@given(st.data())
def test_fuzz_execute_plan_cpu(data):
    args = data.draw(decode_inputs(st.just(64)))
    table, (batch, hq, d), hk = args["page_table"], args["q"].shape, args["k_cache"].shape[2]
    problem = DecodeProblem.from_page_table(table, hq, hk, d)
    strategy = data.draw(st.sampled_from(["single", "split_merge", "fused"]))
    counts = ([1] * batch if strategy == "single"
              else data.draw(st.lists(st.integers(1, 6), min_size=batch, max_size=batch)))
    plan = plan_from_chunk_counts(problem, counts, strategy, align=data.draw(st.sampled_from([1, 4])))
    valid = dict(args)
    if data.draw(st.integers(0, 6)) == 0:                       # the plan spoilt
        bad_plans = [None, "plan", problem]
        if batch:                                               # a plan for other lengths
            other = DecodeProblem(table.kv_lens + 1, hq, hk, d, table.page_size)
            bad_plans.append(plan_from_chunk_counts(other, counts, "fused"))
        bad_plan = data.draw(st.sampled_from(bad_plans))
        args, spoilt = {"plan": bad_plan, **args}, "plan"
    else:
        spoilt = spoil_decode(data.draw, args)
        args = {"plan": plan, **args}
    expect_outcome(lambda: execute_plan_cpu(**args), tuple(args), spoilt,
                   lambda got: check_decode_result(valid, got))


# --- found by the fuzzing: exception types other than TypeError/ValueError (strict xfail) ---

@pytest.mark.xfail(strict=True, raises=OverflowError,
                   reason="check_sm_scale: float() of an int past the float range")
def test_huge_integer_sm_scale_is_a_value_error(make_batch):
    bt = make_batch([3])
    with pytest.raises(ValueError, match="^sm_scale"):
        reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table, sm_scale=10**400)


@pytest.mark.xfail(strict=True, raises=ZeroDivisionError,
                   reason="check_sm_scale: the default 1 / sqrt(head_dim) for head_dim 0")
def test_head_dim_zero_is_a_value_error(make_batch):
    bt = make_batch([3])
    with pytest.raises(ValueError, match="^q"):
        reference_decode(bt.q[..., :0], bt.k_cache[..., :0], bt.v_cache[..., :0], bt.page_table)
