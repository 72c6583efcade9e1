"""Fuzzing the host API with hypothesis: page tables, problems and plans.

Every call either gives a valid result or raises TypeError/ValueError whose message starts with
the name of an argument of that call; never another exception type. A valid plan is checked on
its own terms: int32 arrays, at least one chunk per request, chunks that are non-negative, end
within their request and cover every token exactly once, in order, and within MAX_CHUNKS.

Inputs mix valid values with the edges (0, -1, 2**31 - 1, 2**31, 2**63, 2**64, ...) and with
things of the wrong kind (floats, bools, strings, None, nested and ragged lists, float and
unsigned arrays). Examples are derandomized, so each run tries the same ones; set
SPLITKV_FUZZ_EXAMPLES (default 400 per test) to try more, and SPLITKV_FUZZ_RANDOM=1 for new
ones on every run (hypothesis prints the failing example, to be added as a pinned case).

MAX_CHUNKS is lowered to 2**12 while fuzzing so that every plan is quick to build and the
limit's branch is reached often; its real value is pinned in test_limits.py.
"""

import math
import os
import re
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (python3 -m pip install -e '.[test]')")
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splitkv import (DecodeProblem, PageTable, Plan, plan_chunk_tokens, plan_fixed_splits,
                     plan_from_chunk_counts)
from splitkv.core import validation as V
from splitkv.core.execution import LAUNCH_ORDERS
from splitkv.core.geometry import TILE_TOKENS
from splitkv.planner import choose_plan
from splitkv.planner.profile_lookup import load_profile
from splitkv.planner.profiles import prior_profile

EXAMPLES = int(os.environ.get("SPLITKV_FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="SPLITKV_FUZZ_RANDOM" not in os.environ,
                database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_MAX_CHUNKS = 2**12

SHIPPED = str(resources.files("splitkv.planner").joinpath("profiles", "nvidia-h200.yaml"))


@contextmanager
def small_chunk_limit():
    with mock.patch.object(V, "MAX_CHUNKS", FUZZ_MAX_CHUNKS):
        yield


def outcome(call, names):
    """The call's result, or None when it raised TypeError/ValueError naming one of ``names``
    (the message's first word); any other exception fails the test."""
    try:
        result = call()
    except (TypeError, ValueError) as e:
        first = re.match(r"\w+", str(e))
        assert first and first.group(0) in names, f"{type(e).__name__} names no argument: {e}"
        event(f"{type(e).__name__} naming {first.group(0)}")   # --hypothesis-show-statistics
        return None
    event("valid result")
    return result


# ---- inputs ------------------------------------------------------------------------------------

EDGES = [0, 1, -1, 2, 15, 16, 17, 63, 64, 65, 2**16 - 1, 2**16, 2**24, 2**24 + 1, 2**31 - 1,
         2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, -2**31, -2**63, -2**64, 10**30]
JUNK = [None, 1.0, 2.5, float("nan"), float("inf"), True, False, "4", b"4", [4], (4,),
        np.float32(4), np.array(4), 4 + 0j, object(), {"a": 1}]

small = st.integers(-2, 300)
edge = st.sampled_from(EDGES)
big = st.integers(min_value=-2**70, max_value=2**70)


def numpy_int(value):
    """The value as a NumPy scalar of a type that holds it, or the Python int."""
    for t in (np.int32, np.int64, np.uint64):
        info = np.iinfo(t)
        if info.min <= value <= info.max:
            return t(value)
    return value


ints = st.one_of(small, small, edge, big)
scalars = st.one_of(ints, ints.map(numpy_int), st.sampled_from(JUNK))


def scalar_or(*good):
    """Mostly one of ``good``, else any scalar."""
    return st.one_of(st.sampled_from(good), st.sampled_from(good), scalars)


@st.composite
def int_arrays(draw, ndim=1, values=ints, max_len=6):
    """1-d (or ``ndim``) integer arrays as lists or NumPy arrays of many dtypes; sometimes
    floats, bools, strings, ragged or wrong-rank nesting, a 0-d array or a junk scalar."""
    kind = draw(st.sampled_from(["list", "list", "numpy", "numpy", "float", "bool", "ragged",
                                 "rank", "scalar", "str"]))
    if ndim == 1:
        shape = (draw(st.integers(0, max_len)),)
    else:
        shape = (draw(st.integers(0, 4)), draw(st.integers(0, 4)))
    flat = draw(st.lists(values, min_size=math.prod(shape), max_size=math.prod(shape)))
    if kind == "list":
        return np.array(flat, dtype=object).reshape(shape).tolist()
    if kind == "numpy":
        dtype = draw(st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8,
                                      np.uint32, np.uint64]))
        info = np.iinfo(dtype)
        return np.array([min(max(v, info.min), info.max) for v in flat], dtype=dtype).reshape(shape)
    if kind == "float":
        return np.array([float(v) for v in flat]).reshape(shape)
    if kind == "bool":
        return np.array([bool(v) for v in flat]).reshape(shape)
    if kind == "ragged":
        return [[1, 2], [3]] if ndim == 1 else [[[1]], [2, 3]]
    if kind == "rank":
        return np.zeros((1,) * (ndim + 1), dtype=np.int64)
    if kind == "str":
        return [str(v) for v in flat]
    return draw(st.sampled_from([None, 3, np.array(3), "abc", 2.5]))


lengths = st.one_of(st.integers(0, 300), st.integers(0, 300), st.sampled_from(EDGES),
                    st.integers(0, V.MAX_KV_LEN))
valid_lengths = st.one_of(st.integers(0, 300), st.integers(0, 300), st.integers(0, V.MAX_KV_LEN),
                          st.sampled_from([e for e in EDGES if 0 <= e <= V.MAX_KV_LEN]))
batches = st.one_of(*[st.lists(valid_lengths, min_size=1, max_size=6)] * 5, st.just([]))


# ---- what a valid result must be ---------------------------------------------------------------

def assert_valid_table(table: PageTable):
    indptr, lens = table.kv_indptr, table.kv_lens
    assert indptr[0] == 0 and (np.diff(indptr) >= 0).all() and indptr[-1] == table.kv_indices.size
    assert lens.dtype == np.int64 and (lens >= 0).all() and (lens <= V.MAX_KV_LEN).all()
    assert (table.kv_indices >= 0).all() and 1 <= table.page_size <= V.MAX_PAGE_SIZE
    pages = np.diff(indptr)
    np.testing.assert_array_equal(-(-lens // table.page_size), pages)   # no page to spare


def assert_valid_plan(plan: Plan):
    lens = plan.problem.kv_lens
    arrays = (plan.chunk_request, plan.chunk_start, plan.chunk_end, plan.merge_indptr)
    assert all(a.dtype == np.int32 for a in arrays)
    req, start, end, indptr = (a.astype(np.int64) for a in arrays)
    assert 0 <= plan.num_chunks <= V.MAX_CHUNKS
    assert indptr.size == lens.size + 1 and indptr[0] == 0 and indptr[-1] == req.size
    counts = np.diff(indptr)
    assert (counts >= 1).all()
    np.testing.assert_array_equal(req, np.repeat(np.arange(lens.size), counts))
    assert (start >= 0).all() and (start <= end).all() and (end <= lens[req]).all()
    # every token of every request exactly once: chunk sizes add up and chunks abut
    np.testing.assert_array_equal(np.bincount(req, end - start, lens.size), lens)
    first, last = indptr[:-1], indptr[1:] - 1
    assert (start[first] == 0).all() and (end[last] == lens).all()
    same = req[1:] == req[:-1]
    assert (start[1:][same] == end[:-1][same]).all()
    # a chunk is empty only when its request is
    assert ((end > start) | (lens[req] == 0)).all()
    Plan(plan.problem, plan.strategy, *arrays)            # the hand-built plan's own checks agree


@st.composite
def mutated(draw, valid: dict, fuzzed: dict):
    """Arguments drawn from ``valid`` (name -> value), then none, one or two of them replaced by
    a draw from ``fuzzed`` (name -> strategy): about half the calls are valid."""
    args = dict(valid)
    n = draw(st.sampled_from([0, 0, 1, 1, 2]))
    for name in draw(st.lists(st.sampled_from(sorted(fuzzed)), min_size=n, max_size=n,
                              unique=True)):
        args[name] = draw(fuzzed[name])
    return args


# ---- page tables -------------------------------------------------------------------------------

page_sizes = scalar_or(1, 16, 64, 2**20, V.MAX_PAGE_SIZE)


@st.composite
def block_tables(draw):
    """vLLM's layout: valid, then fuzzed (``mutated``)."""
    page_size = draw(st.sampled_from([1, 3, 16]))
    seq_lens = draw(st.lists(st.integers(0, 60), max_size=5))
    width = max([-(-n // page_size) for n in seq_lens] + [0]) + draw(st.integers(0, 2))
    pool = max(width * len(seq_lens), 1)
    table = draw(st.lists(st.lists(st.integers(0, pool - 1), min_size=width, max_size=width),
                          min_size=len(seq_lens), max_size=len(seq_lens)))
    valid = dict(block_table=table, seq_lens=seq_lens, page_size=page_size,
                 num_pages=draw(st.sampled_from([None, pool])))
    return draw(mutated(valid, dict(block_table=int_arrays(ndim=2),
                                    seq_lens=int_arrays(values=lengths), page_size=page_sizes,
                                    num_pages=scalars)))


@FUZZ
@given(block_tables())
def test_fuzz_from_block_table(args):
    table = outcome(lambda: PageTable.from_block_table(**args), set(args))
    if table is not None:
        assert_valid_table(table)
        np.testing.assert_array_equal(table.kv_lens, np.asarray(args["seq_lens"]))
        for b in range(table.batch_size):
            n = -(-table.kv_lens[b] // table.page_size)
            np.testing.assert_array_equal(table.kv_indices[table.kv_indptr[b]:][:n],
                                          np.asarray(args["block_table"])[b, :n])


@st.composite
def flashinfer_tables(draw):
    """FlashInfer's layout: valid, then fuzzed (``mutated``)."""
    page_size = draw(st.sampled_from([1, 5, 16, 2**30]))
    pages = draw(st.lists(st.integers(0, 4), max_size=5))
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(int).tolist()
    indices = draw(st.permutations(range(indptr[-1])))
    last = [draw(st.integers(1, min(page_size, 2**31 - 1))) if p else 0 for p in pages]
    valid = dict(kv_indptr=indptr, kv_indices=list(indices), kv_last_page_len=last,
                 page_size=page_size, num_pages=draw(st.sampled_from([None, indptr[-1]])))
    return draw(mutated(valid, dict(kv_indptr=int_arrays(), kv_indices=int_arrays(),
                                    kv_last_page_len=int_arrays(), page_size=page_sizes,
                                    num_pages=scalars)))


@FUZZ
@given(flashinfer_tables())
def test_fuzz_from_flashinfer(args):
    table = outcome(lambda: PageTable.from_flashinfer(**args), set(args))
    if table is not None:
        assert_valid_table(table)
        np.testing.assert_array_equal(table.kv_indptr, np.asarray(args["kv_indptr"]))


LAYOUT_NAMES = {"flashinfer": ("kv_indptr", "kv_indices", "kv_last_page_len"),
                "vllm": ("block_table", "seq_lens")}


@st.composite
def layouts(draw):
    """Mostly one layout (a PageTable, FlashInfer's or vLLM's), sometimes none, two, or one
    with a part missing; each valid or fuzzed."""
    given = draw(st.sampled_from([["page_table"], ["flashinfer"], ["vllm"], ["flashinfer"],
                                  ["vllm"], ["flashinfer"], ["vllm"], [], ["page_table", "vllm"],
                                  ["flashinfer", "vllm"]]))
    page_table, page_size, kwargs = None, draw(page_sizes), {}
    if "page_table" in given:
        page_table = draw(st.sampled_from([PageTable.from_block_table([[0, 1]], [20], 16),
                                           PageTable.from_block_table([[0, 1]], [20], 16),
                                           "table", 3]))
    for layout in ("flashinfer", "vllm"):
        if layout in given:
            args = draw(flashinfer_tables() if layout == "flashinfer" else block_tables())
            page_size = args["page_size"]
            names = LAYOUT_NAMES[layout]
            if draw(st.integers(0, 5)) == 0:                      # a part left out
                names = names[:draw(st.integers(1, len(names) - 1))]
            kwargs.update({name: args[name] for name in names})
    return page_table, page_size, kwargs


@FUZZ
@given(layouts())
def test_fuzz_from_layout(layout):
    page_table, page_size, kwargs = layout
    names = {"page_table", "page_size", *LAYOUT_NAMES["flashinfer"], *LAYOUT_NAMES["vllm"]}
    table = outcome(lambda: PageTable.from_layout(page_table, page_size, **kwargs), names)
    if table is not None:
        assert_valid_table(table)


# ---- problems ----------------------------------------------------------------------------------

DTYPES = ["bfloat16", "float16", np.float16, "fp16", "bf16"]
BAD_DTYPES = ["float32", "int8", None, 3, np.dtype("float64"), [1], np.float64]


@st.composite
def problem_args(draw):
    """DecodeProblem's arguments: valid, then fuzzed (``mutated``)."""
    hk = draw(st.sampled_from([1, 2, 8]))
    valid = dict(kv_lens=draw(batches),
                 num_qo_heads=hk * draw(st.sampled_from([1, 4, 8])), num_kv_heads=hk,
                 head_dim=draw(st.sampled_from(V.SUPPORTED_HEAD_DIMS)),
                 page_size=draw(st.sampled_from([1, 16, V.MAX_PAGE_SIZE])),
                 dtype=draw(st.sampled_from(DTYPES)))
    return draw(mutated(valid, dict(
        kv_lens=st.one_of(st.lists(lengths, max_size=6), int_arrays(values=lengths)),
        num_qo_heads=scalar_or(1, 7, 64, V.MAX_HEADS), num_kv_heads=scalar_or(1, 3, 8),
        head_dim=scalar_or(32, 64, 80, 512), page_size=page_sizes,
        dtype=st.sampled_from(BAD_DTYPES + DTYPES))))


@FUZZ
@given(problem_args())
def test_fuzz_decode_problem(args):
    p = outcome(lambda: DecodeProblem(**args), set(args))
    if p is not None:
        lens = p.kv_lens
        assert lens.dtype == np.int64 and (lens >= 0).all() and (lens <= V.MAX_KV_LEN).all()
        assert lens.size <= V.MAX_BATCH_SIZE
        assert p.total_tokens == sum(int(n) for n in lens)           # exact, no wrap
        assert p.kv_bytes == p.total_tokens * p.num_kv_heads * p.head_dim * 4
        assert 1 <= p.num_kv_heads <= p.num_qo_heads <= V.MAX_HEADS
        assert p.num_qo_heads % p.num_kv_heads == 0
        assert p.dtype in V.SUPPORTED_DTYPES and p.head_dim in V.SUPPORTED_HEAD_DIMS


@st.composite
def problems(draw):
    """Valid problems, lengths from 0 to MAX_KV_LEN."""
    hk = draw(st.sampled_from([1, 2, 8]))
    return DecodeProblem(np.array(draw(batches), dtype=np.int64),
                         hk * draw(st.sampled_from([1, 4, 8])), hk, 128,
                         draw(st.sampled_from([1, 16])))


STRATEGIES = st.sampled_from(V.STRATEGIES)
BAD_STRATEGIES = st.sampled_from([None, "Fused", "", 3, ["fused"]])
BAD_PROBLEMS = st.sampled_from([None, "problem", np.array([4]), 3])
ALIGNS = st.sampled_from([1, 16, 64, 100])


# ---- plans -------------------------------------------------------------------------------------

def tiles(lens, align):
    return np.maximum(1, -(-lens // align))


@st.composite
def fixed_split_args(draw):
    valid = dict(problem=draw(problems()), num_splits=draw(st.sampled_from([1, 2, 3, 8, 100])),
                 strategy=draw(st.one_of(st.none(), STRATEGIES)), align=draw(ALIGNS))
    return draw(mutated(valid, dict(problem=BAD_PROBLEMS, strategy=BAD_STRATEGIES,
                                    num_splits=scalar_or(FUZZ_MAX_CHUNKS, 2**20), align=scalars)))


@FUZZ
@given(fixed_split_args())
def test_fuzz_plan_fixed_splits(args):
    with small_chunk_limit():
        plan = outcome(lambda: plan_fixed_splits(**args), set(args))
    if plan is not None:
        assert_valid_plan(plan)
        want = np.minimum(int(args["num_splits"]), tiles(plan.problem.kv_lens, int(args["align"])))
        np.testing.assert_array_equal(plan.chunks_per_request, want)


@st.composite
def chunk_token_args(draw):
    valid = dict(problem=draw(problems()), chunk_tokens=draw(st.sampled_from([1, 16, 64, 1000])),
                 strategy=draw(STRATEGIES), align=draw(ALIGNS))
    return draw(mutated(valid, dict(problem=BAD_PROBLEMS, strategy=BAD_STRATEGIES,
                                    chunk_tokens=scalar_or(2**20, V.MAX_KV_LEN), align=scalars)))


@FUZZ
@given(chunk_token_args())
def test_fuzz_plan_chunk_tokens(args):
    with small_chunk_limit():
        plan = outcome(lambda: plan_chunk_tokens(**args), set(args))
    if plan is not None:
        assert_valid_plan(plan)
        lens = plan.problem.kv_lens
        want = np.minimum(np.maximum(1, -(-lens // int(args["chunk_tokens"]))),
                          tiles(lens, int(args["align"])))
        if args["strategy"] == "single":
            want = np.ones_like(want)
        np.testing.assert_array_equal(plan.chunks_per_request, want)


@st.composite
def chunk_count_args(draw):
    problem = draw(problems())
    n = problem.batch_size
    counts = st.lists(st.one_of(st.integers(1, 9), st.integers(-2, 3), st.integers(-2, 3), edge),
                      min_size=n, max_size=n)
    valid = dict(problem=problem, chunks_per_request=draw(st.lists(st.integers(1, 9),
                                                                   min_size=n, max_size=n)),
                 strategy=draw(STRATEGIES), align=draw(ALIGNS))
    return draw(mutated(valid, dict(problem=BAD_PROBLEMS, strategy=BAD_STRATEGIES,
                                    chunks_per_request=st.one_of(counts, counts, int_arrays()),
                                    align=scalars)))


@FUZZ
@given(chunk_count_args())
def test_fuzz_plan_from_chunk_counts(args):
    with small_chunk_limit():
        plan = outcome(lambda: plan_from_chunk_counts(**args), set(args))
    if plan is not None:
        assert_valid_plan(plan)
        want = np.minimum(np.asarray(args["chunks_per_request"], dtype=np.int64),
                          tiles(plan.problem.kv_lens, int(args["align"])))
        np.testing.assert_array_equal(plan.chunks_per_request, want)


PROFILES = [None, load_profile(path=SHIPPED), load_profile(path=SHIPPED).cost_model(), SHIPPED,
            Path(SHIPPED), prior_profile("NVIDIA H100", 132)]
BAD_PROFILES = ["/no/such/profile.yaml", "", 3, b"x", [SHIPPED]]


@st.composite
def choose_args(draw):
    valid = dict(problem=draw(problems()), profile=draw(st.sampled_from(PROFILES)),
                 num_splits=draw(st.sampled_from([None, None, 1, 2, 5, 64])),
                 strategy=draw(st.one_of(st.none(), STRATEGIES)),
                 launch_order=draw(st.sampled_from(LAUNCH_ORDERS)),
                 max_chunks=draw(st.sampled_from([None, None, 8, 100, 2**40])))
    return draw(mutated(valid, dict(
        problem=BAD_PROBLEMS, profile=st.sampled_from(BAD_PROFILES), num_splits=scalars,
        strategy=BAD_STRATEGIES, launch_order=st.sampled_from(["longest", None, 1]),
        max_chunks=scalars)))


@FUZZ
@given(choose_args())
def test_fuzz_choose_plan(args):
    with small_chunk_limit():
        plan = outcome(lambda: choose_plan(**args), set(args))
    if plan is not None:
        assert_valid_plan(plan)
        assert plan.predicted_us is not None
        # cluster grids keep plan order (execution.decide)
        want_order = "plan" if plan.merge == "cluster" else args["launch_order"]
        assert plan.launch_order == want_order
        if args["strategy"] is not None:
            assert plan.strategy == args["strategy"]
        if args["max_chunks"] is not None:
            assert plan.num_chunks <= int(args["max_chunks"])
        num_splits = args["num_splits"]
        if num_splits is not None and num_splits > 1 and plan.problem.batch_size:
            want = np.minimum(int(num_splits), tiles(plan.problem.kv_lens, TILE_TOKENS))
            np.testing.assert_array_equal(plan.chunks_per_request, want)


def test_outcome_refuses_other_exceptions():
    # the property itself: a KeyError, or an error naming no argument, fails it
    with pytest.raises(AssertionError):
        outcome(lambda: (_ for _ in ()).throw(ValueError("something went wrong")), {"x"})
    with pytest.raises(KeyError):
        outcome(lambda: {}["x"], {"x"})
