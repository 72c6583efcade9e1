"""Fuzzing ``BatchDecodeWrapper.run`` on the GPU with hypothesis: each example takes a
valid call and changes one or two of its arguments (shapes, dtypes, strides and views, host
arrays, other kinds of objects, pages past the pool, the variants' arrays). The only outcomes
allowed: the reference's answer for the arrays as given (a view the kernels can read is read
in place), or a TypeError/ValueError whose message starts with the name of the argument,
raised before any launch (the poisoned output is untouched, and the device has no error).

SPLITKV_FUZZ_EXAMPLES sets the examples per test (default 200)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (python3 -m pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, random_device_array,
                                       scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("SPLITKV_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
HQ, HK, D, PAGE = 8, 2, 64, 16
LENS = [100, 37, 0, 300]
ARGS = ("q", "k_cache", "v_cache", "out", "lse", "sinks", "k_scale", "v_scale", "stream")


def padded(arr, axis, pad=8):
    """The same values as a strided view into a larger buffer (``axis`` padded), on the host
    for a host array (two changes may compose: a host out, then strided)."""
    shape = list(arr.shape)
    shape[axis] += pad
    big = cupy.get_array_module(arr).zeros(shape, arr.dtype)
    index = [slice(None)] * arr.ndim
    index[axis] = slice(0, arr.shape[axis])
    big[tuple(index)] = arr
    return big[tuple(index)]


def misaligned(arr):
    """The same values in a buffer 8 bytes off 16-byte alignment."""
    buf = cupy.get_array_module(arr).empty(arr.size + 8, arr.dtype)
    view = buf[4:4 + arr.size].reshape(arr.shape)
    view[...] = arr
    return view


# Each change: (argument, function of the call's dict of arguments -> the changed value).
CHANGES = {
    "q: a row short": ("q", lambda a: a["q"][:-1]),
    "q: float32": ("q", lambda a: a["q"].astype(cupy.float32)),
    "q: a host array": ("q", lambda a: a["q"].get()),
    "q: transposed view": ("q", lambda a: cupy.ascontiguousarray(
        a["q"].transpose(1, 0, 2)).transpose(1, 0, 2)),
    "q: padded dims": ("q", lambda a: padded(a["q"], 2)),
    "q: a list": ("q", lambda a: a["q"].get().tolist()),
    "q: None": ("q", lambda a: None),
    "k: too few pages": ("k_cache", lambda a: a["k_cache"][:3]),
    "k: padded tokens": ("k_cache", lambda a: padded(a["k_cache"], 1)),
    "k+v: padded heads": ("k_cache", lambda a: padded(a["k_cache"], 2)),
    "k: float16": ("k_cache", lambda a: a["k_cache"].view(cupy.float16)),
    "k: odd dims view": ("k_cache", lambda a: padded(a["k_cache"], 3, pad=1)),
    "k: 3-d": ("k_cache", lambda a: a["k_cache"][0]),
    "v: another page size": ("v_cache", lambda a: a["v_cache"][:, :8]),
    "v: padded tokens": ("v_cache", lambda a: padded(a["v_cache"], 1)),
    "v: misaligned": ("v_cache", lambda a: misaligned(a["v_cache"])),
    "out: wrong shape": ("out", lambda a: cupy.full((len(LENS), HQ, D + 1), 0xFFFF, cupy.uint16)),
    "out: float32": ("out", lambda a: cupy.full((len(LENS), HQ, D), np.nan, cupy.float32)),
    "out: strided": ("out", lambda a: padded(a["out"], 2)),
    "out: host": ("out", lambda a: a["out"].get()),
    "lse: wrong shape": ("lse", lambda a: cupy.full((len(LENS), HQ + 1), np.nan, cupy.float32)),
    "lse: float16": ("lse", lambda a: cupy.full((len(LENS), HQ), np.nan, cupy.float16)),
    "sinks: wrong length": ("sinks", lambda a: cupy.zeros(HQ + 1, cupy.float32)),
    "sinks: float64": ("sinks", lambda a: cupy.zeros(HQ, cupy.float64)),
    "sinks: host": ("sinks", lambda a: np.zeros(HQ, np.float32)),
    "sinks: valid": ("sinks", lambda a: cupy.asarray(np.linspace(-2, 2, HQ), cupy.float32)),
    "k_scale: on a 16-bit wrapper": ("k_scale", lambda a: 2.0),
    "v_scale: an array on a 16-bit wrapper": ("v_scale", lambda a: cupy.ones(1, cupy.float32)),
    "stream: a string": ("stream", lambda a: "stream"),
    "stream: a new stream": ("stream", lambda a: cupy.cuda.Stream(non_blocking=True)),
}


@pytest.fixture(scope="module")
def call():
    rng = np.random.default_rng(17)
    pt, num_pages = scattered_page_table(LENS, PAGE, rng)
    q = random_device_array((len(LENS), HQ, D), "bfloat16", rng)
    k, v = (random_device_array((num_pages, PAGE, HK, D), "bfloat16", rng) for _ in range(2))
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16")
    return w, pt, {"q": q, "k_cache": k, "v_cache": v}


@FUZZ
@given(names=st.lists(st.sampled_from(sorted(CHANGES)), min_size=1, max_size=2,
                      unique_by=lambda name: CHANGES[name][0]),   # one change an argument
       strategy=st.sampled_from([("single", 1), ("split_merge", 3), ("fused", 3), ("fused", 2)]))
def test_run_answers_right_or_names_the_argument(call, names, strategy):
    w, pt, base = call
    w.plan(pt, num_splits=strategy[1], strategy=strategy[0])
    args = dict(base, out=cupy.full(base["q"].shape, 0xFFFF, cupy.uint16),
                lse=cupy.full(base["q"].shape[:2], np.nan, cupy.float32))
    for name in names:
        arg, change = CHANGES[name]
        args[arg] = change(args)
        if name == "k+v: padded heads":
            args["v_cache"] = padded(args["v_cache"], 2)
    poison = {k: args[k].copy() for k in ("out", "lse") if isinstance(args[k], cupy.ndarray)}
    cupy.cuda.runtime.deviceSynchronize()
    try:
        w.run(**args)
    except (TypeError, ValueError) as exc:
        first = re.split(r"[:\s]", str(exc), maxsplit=1)[0]
        assert first in ARGS, f"{names}: the message does not start with an argument: {exc}"
        cupy.cuda.runtime.deviceSynchronize()        # no launch error either
        for k, before in poison.items():             # nothing launched: outputs untouched
            assert cupy.array_equal(args[k].view(cupy.uint8), before.view(cupy.uint8)), names
        return
    cupy.cuda.runtime.deviceSynchronize()
    host = {k: (None if args.get(k) is None else np.asarray(cupy.asnumpy(args[k]), np.float64))
            for k in ("sinks", "k_scale", "v_scale")}
    # the scales too: an argument the wrapper took must have had its effect
    ref_o, ref_lse = reference_decode(cupy.asnumpy(args["q"]), cupy.asnumpy(args["k_cache"]),
                                      cupy.asnumpy(args["v_cache"]), pt, **host)
    assert_matches_reference(to_float64(cupy.asnumpy(args["out"])), cupy.asnumpy(args["lse"]),
                             ref_o, ref_lse, 1e-2, f"{names}, {strategy}")


PLAN_ARGS = ("page_table", "kv_indptr", "kv_indices", "kv_last_page_len", "block_table",
             "seq_lens", "num_splits", "strategy", "plan", "sm_scale", "stream", "window_left",
             "logits_soft_cap", "qo_indptr", "num_qo_heads")
# Each change of a valid plan() call: (argument, value or function of the page table).
PLAN_CHANGES = {
    "num_splits 0": ("num_splits", 0), "num_splits -1": ("num_splits", -1),
    "num_splits 2.0": ("num_splits", 2.0), "num_splits 10**9": ("num_splits", 10**9),
    "num_splits 5": ("num_splits", 5),
    "strategy bad": ("strategy", "fast"), "strategy single": ("strategy", "single"),
    "strategy fused": ("strategy", "fused"),
    "window -2": ("window_left", -2), "window 1.5": ("window_left", 1.5),
    "window 50": ("window_left", 50), "window 2**40": ("window_left", 2**40),
    "cap -1": ("logits_soft_cap", -1.0), "cap nan": ("logits_soft_cap", float("nan")),
    "cap str": ("logits_soft_cap", "30"), "cap 5": ("logits_soft_cap", 5.0),
    "sm_scale 0": ("sm_scale", 0.0), "sm_scale nan": ("sm_scale", float("nan")),
    "sm_scale 0.2": ("sm_scale", 0.2),
    "qo bad length": ("qo_indptr", lambda pt: np.arange(pt.batch_size)),
    "qo too many rows": ("qo_indptr", lambda pt: np.arange(pt.batch_size + 1) * 17),
    "qo floats": ("qo_indptr", lambda pt: np.arange(pt.batch_size + 1) * 1.0),
    "qo 2 rows, short request": ("qo_indptr", lambda pt: np.arange(pt.batch_size + 1) * 2),
    "qo one each": ("qo_indptr", lambda pt: np.arange(pt.batch_size + 1)),
    "qo ragged": ("qo_indptr", lambda pt: np.array([0, 2, 5, 6, 10])),   # 2, 3, 1 (no KV), 4
    "stream str": ("stream", "s"),
    "plan str": ("plan", "plan"),
    "table None": ("page_table", lambda pt: None),
    "indptr as well": ("kv_indptr", lambda pt: pt.kv_indptr),
    "table of another page size": ("page_table", lambda pt: type(pt).from_block_table(
        np.zeros((pt.batch_size, 4), np.int64), pt.kv_lens.clip(0, 32), 8)),
}


@FUZZ
@given(names=st.lists(st.sampled_from(sorted(PLAN_CHANGES)), min_size=1, max_size=2,
                      unique=True))
def test_plan_answers_right_or_names_the_argument(call, names):
    """plan()'s arguments changed one or two at a time: a plan whose run gives the reference's
    answer for those options, or a TypeError/ValueError naming an argument before any upload."""
    w, pt, base = call
    kwargs = {"page_table": pt}
    for name in names:
        arg, value = PLAN_CHANGES[name]
        kwargs[arg] = value(pt) if callable(value) else value
    try:
        w.plan(**kwargs)
    except (TypeError, ValueError) as exc:
        first = re.split(r"[:\s]", str(exc), maxsplit=1)[0]
        assert first in PLAN_ARGS, f"{names}: the message does not start with an argument: {exc}"
        return
    qo = kwargs.get("qo_indptr")
    rows = base["q"].shape[0] if qo is None else int(np.asarray(qo)[-1])
    rng = np.random.default_rng(len(names))
    q = random_device_array((rows, HQ, D), "bfloat16", rng)
    out, lse = w.run(q, base["k_cache"], base["v_cache"], return_lse=True)
    cupy.cuda.runtime.deviceSynchronize()
    ref_o, ref_lse = reference_decode(q.get(), base["k_cache"].get(), base["v_cache"].get(), pt,
                                      sm_scale=kwargs.get("sm_scale"), qo_indptr=qo,
                                      window_left=kwargs.get("window_left", -1),
                                      logits_soft_cap=kwargs.get("logits_soft_cap"))
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2, str(names))
