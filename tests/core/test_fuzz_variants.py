"""Fuzzing the host paths' arguments, under the host API's rule (``test_fuzz_host``): fp8 KV
(``kv_dtype``, ``k_scale``, ``v_scale``) and the attention variants (``window_left``,
``logits_soft_cap``, ``sinks``, ``qo_indptr``) of ``reference_decode`` and ``execute_plan_cpu``,
and ``DecodeProblem(window_left=)`` with the plan builders.

Each call gets valid values, or one argument spoilt (wrong kind, wrong shape, out of range);
the only outcomes allowed are a result (the executor's equal to the reference's, every
strategy) or a TypeError/ValueError whose message starts with the spoilt argument's name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (python3 -m pip install -e '.[test]')")
from hypothesis import given
from hypothesis import strategies as st

from splitkv import DecodeProblem, execute_plan_cpu, plan_fixed_splits, reference_decode
from splitkv.core import fp8
from splitkv.testing import scattered_page_table

from test_fuzz_merge_reference import FUZZ, assert_matches, expect_outcome

@st.composite
def calls(draw):
    """Arguments of a valid call with some variants and perhaps fp8 KV."""
    batch = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    page = draw(st.sampled_from([1, 4, 16]))
    hk, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hq, d = hk * group, 64
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table, pages = scattered_page_table(np.array(lens, np.int64), page, rng, 1)
    q_lens = [draw(st.integers(1, max(1, min(n, 4)))) for n in lens]
    multi = draw(st.booleans())
    rows = sum(q_lens) if multi else batch
    args = {"q": rng.standard_normal((rows, hq, d)),
            "k_cache": rng.standard_normal((pages, page, hk, d)),
            "v_cache": rng.standard_normal((pages, page, hk, d)), "page_table": table}
    if multi:
        args["qo_indptr"] = np.concatenate([[0], np.cumsum(q_lens)])
    if draw(st.booleans()):
        args["window_left"] = draw(st.integers(-1, 50))
    if draw(st.booleans()):
        args["logits_soft_cap"] = draw(st.floats(0.5, 30.0))
    if draw(st.booleans()):
        args["sinks"] = rng.standard_normal(hq)
    if draw(st.booleans()):
        fmt = draw(st.sampled_from(["fp8_e4m3", "float8_e5m2"]))
        args["kv_dtype"] = fmt
        args["k_cache"] = fp8.quantize(np.clip(args["k_cache"], -8, 8), fmt)
        args["v_cache"] = fp8.quantize(np.clip(args["v_cache"], -8, 8), fmt)
        args["k_scale"] = draw(st.sampled_from([None, 0.5, [2.0] * hk, np.linspace(0.5, 1, hk)]))
        args["v_scale"] = draw(st.sampled_from([None, 3.0]))
    return args, hk


def spoil(draw, args, hk):
    """One of the new arguments made invalid; returns its name, or None (a valid call)."""
    name = draw(st.sampled_from([None, None, "window_left", "logits_soft_cap", "sinks",
                                 "qo_indptr", "kv_dtype", "k_scale", "v_scale"]))
    hq = args["q"].shape[1]
    batch = args["page_table"].batch_size
    bad = {
        "window_left": [-2, 2.5, "3", True, 2**40],
        "logits_soft_cap": [-1.0, math.nan, math.inf, "2", True, [1.0]],
        "sinks": [np.zeros(hq + 1), np.full(hq, np.nan), np.full(hq, np.inf), "x", [None] * hq],
        "qo_indptr": [np.arange(batch), np.array([1] + [1] * batch), np.zeros(batch + 1),
                      np.concatenate([[0], np.full(batch, 17).cumsum()]), "0,1", [0.5] * (batch + 1)],
        "kv_dtype": ["int8", "fp16", 3, "e4m3x"],
        "k_scale": [-1.0, 0.0, math.nan, np.zeros(hk + 2), "1", [1.0, "a"]],
        "v_scale": [math.inf, -2.0, np.ones((hk, 2))],
    }
    if name is None:
        return None
    if name == "kv_dtype" and "kv_dtype" not in args:
        args["k_cache"] = fp8.quantize(np.clip(args["k_cache"], -8, 8), "fp8")
        args["v_cache"] = fp8.quantize(np.clip(args["v_cache"], -8, 8), "fp8")
    args[name] = draw(st.sampled_from(bad[name]))
    return name


def check(args, got, want):
    out, lse = got
    assert_matches(out, want[0], 1e-10, 1e-10, "out")
    assert_matches(lse, want[1], 1e-10, 1e-10, "lse")


@FUZZ
@given(st.data())
def test_fuzz_reference_and_executor_with_variants(data):
    args, hk = data.draw(calls())
    valid = dict(args)
    spoilt = spoil(data.draw, args, hk)
    names = tuple(args)
    want = None if spoilt else reference_decode(**valid)
    expect_outcome(lambda: reference_decode(**args), names, spoilt,
                   lambda got: check(args, got, want))
    table = args["page_table"]
    # a plan made for the call's window when it has one (and one row a request), else plain
    window = valid.get("window_left", -1) if "qo_indptr" not in valid else -1
    problem = DecodeProblem.from_page_table(table, args["q"].shape[1], hk, 64,
                                            window_left=window if spoilt != "window_left" else -1)
    strategy = data.draw(st.sampled_from(["single", "split_merge", "fused"]))
    plan = plan_fixed_splits(problem, 1 if strategy == "single" else data.draw(st.integers(2, 5)),
                             strategy)
    expect_outcome(lambda: execute_plan_cpu(plan, **args), ("plan", *names), spoilt,
                   lambda got: check(args, got, want))


@FUZZ
@given(st.data())
def test_fuzz_windowed_problems_and_plans(data):
    lens = data.draw(st.lists(st.integers(0, 5000), min_size=1, max_size=4))
    window = data.draw(st.one_of(st.integers(-1, 6000), st.sampled_from([-2, 2**31, 1.5, "8",
                                                                          None, True])))
    try:
        problem = DecodeProblem(lens, 8, 2, 64, 16, window_left=window)
    except (TypeError, ValueError) as err:
        assert str(err).startswith("window_left"), err
        return
    splits = data.draw(st.integers(1, 9))
    plan = plan_fixed_splits(problem, splits, "split_merge" if splits > 1 else "single", align=64)
    lens = np.array(lens)
    begin = np.maximum(lens - 1 - window, 0) if window >= 0 else np.zeros_like(lens)
    for b in range(lens.size):
        chunks = slice(plan.merge_indptr[b], plan.merge_indptr[b + 1])
        assert plan.chunk_start[chunks][0] == begin[b] and plan.chunk_end[chunks][-1] == lens[b]
        assert np.all(plan.chunk_start[chunks][1:] == plan.chunk_end[chunks][:-1])
    assert problem.total_tokens == int((lens - begin).sum())
