"""The planner on the device chooses what the host planner chooses and writes the same records.

``kernels_cu/device_plan.cuh`` built with the host compiler (one thread) against the host planner
(``choose_plan`` + ``chunk_records`` + a graph-stable wrapper's merge_indptr) on random batches
of every kind; the argument struct against its ctypes mirror; invalid device values; the host
checks of ``plan_on_device``'s arrays. The kernel itself: test_gpu_device_plan.py.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from splitkv.core.execution import LAUNCH_ORDERS
from splitkv.planner.profile_lookup import load_profile
from splitkv.runtime.device_planner import DevicePlanParams, device_batch, plan_params, source
from splitkv.runtime.records import idle_records
from splitkv.testing import scattered_page_table

from helpers.device_plan_reference import (HostRun, comparable_records, compiler, expected, host_library,
                                   layout_arrays, records_equal)

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler (g++)")

MODEL = load_profile(device_name="NVIDIA H200", num_sms=132).cost_model().with_clusters(False)
SHAPES = [(32, 8, 128), (32, 32, 128), (64, 8, 128), (8, 1, 64), (256, 2, 256), (16, 4, 256),
          (28, 4, 64)]
STAGES = {64: 4, 128: 3, 256: 2}


def random_lengths(rng, kind: int) -> np.ndarray:
    """Ragged, equal, tiny, with empty requests, or few and long."""
    batch = int(rng.integers(1, 8 if kind == 4 else 300))
    if kind == 0:
        return rng.lognormal(np.log(2048), 1.2, batch).clip(0, 40000).astype(np.int64)
    if kind == 1:
        return np.full(batch, int(rng.integers(0, 20000)))
    if kind == 2:
        return rng.integers(0, 2049, batch)
    if kind == 3:
        return np.where(rng.random(batch) < 0.3, 0, rng.integers(1, 5000, batch))
    return rng.integers(1, 140000, batch)


def compare(rng, lens, *, shape, page_size, layout, max_batch, max_chunks, launch_order,
            run: HostRun | None = None, model=MODEL):
    """Plan ``lens`` both ways; assert the same plan, records, merge_indptr and prediction.
    Returns the host run (to plan again with its buffers) and the plan."""
    hq, hk, d = shape
    table, _ = scattered_page_table(lens, page_size, rng, 2)
    if run is None:
        run = HostRun(plan_params(model, num_qo_heads=hq, num_kv_heads=hk, head_dim=d,
                                  page_size=page_size, stages=STAGES[d], max_batch=max_batch,
                                  max_chunks=max_chunks, launch_order=launch_order))
    arrays = layout_arrays(table, layout, rng, spare_columns=int(rng.integers(0, 3)))
    got = run.plan(layout, arrays)
    plan, want, merge_indptr = expected(table, model, num_qo_heads=hq, num_kv_heads=hk,
                                        head_dim=d, stages=STAGES[d], max_batch=max_batch,
                                        max_chunks=max_chunks, launch_order=launch_order)
    n = plan.num_chunks
    have, want = comparable_records(got.records[:n], want, table, layout, arrays)
    what = f"{layout} lens={lens.tolist()[:8]}... page={page_size} shape={shape} {launch_order}"
    assert got.state["error"] == 0, what
    assert got.state["num_chunks"] == n, what
    assert got.predicted_us == plan.predicted_us, what
    assert ("single", "split_merge", "fused")[got.state["strategy"]] == plan.strategy, what
    assert records_equal(have, want), what
    assert records_equal(got.records[n:], idle_records(max_chunks - n)), what
    assert np.array_equal(got.merge_indptr, merge_indptr), what
    return run, plan, got


@pytest.mark.parametrize("seed", range(6))
def test_chooses_the_host_planners_plan(seed):
    """On 80 random batches per seed (every length kind, shape, page size, layout, launch order
    and capacity), the same plan bit for bit; every row kind is met (every strategy too, under
    the random models of the next test: the shipped profile may fuse none of a seed's 80)."""
    rng = np.random.default_rng(seed)
    seen = collections.Counter()
    for trial in range(80):
        lens = random_lengths(rng, trial % 5)
        max_batch = lens.size + int(rng.integers(0, 5))
        _, plan, got = compare(
            rng, lens, shape=SHAPES[int(rng.integers(len(SHAPES)))],
            page_size=int(rng.choice([1, 16, 64])),
            layout=("flashinfer", "block_table")[trial % 2],
            max_batch=max_batch,
            max_chunks=int(rng.choice([max_batch, 2 * max_batch, 1056, 4096])),
            launch_order=LAUNCH_ORDERS[trial % 3])
        seen[(got.state["kind"], plan.strategy)] += 1
    assert {k for k, _ in seen} == {0, 1, 2} and {"single", "split_merge"} <= {
        s for _, s in seen}, seen


def test_chooses_the_host_planners_plan_under_other_models():
    """Random cost models (non-negative coefficients, some zero), so that every candidate row
    wins somewhere, the tiny chunk sizes (16 and 32 tokens) and the wave-filling ones too, and
    every strategy."""
    from splitkv.planner.cost_model import CostModel
    from splitkv.planner.features import FEATURE_NAMES

    rng = np.random.default_rng(11)
    won, strategies = collections.Counter(), collections.Counter()
    crit_only = np.zeros(len(FEATURE_NAMES))
    crit_only[FEATURE_NAMES.index("crit_us")] = 1.0      # the finest cut wins: tiny chunks
    for trial in range(170):
        coef = rng.exponential(1.0, len(FEATURE_NAMES)) * (rng.random(len(FEATURE_NAMES)) < 0.7)
        model = CostModel.from_coef(crit_only if trial < 20 else coef, num_sms=132)
        lens = rng.integers(0, 2049, int(rng.integers(1, 6))) if trial % 2 else \
            random_lengths(rng, trial % 5)
        if trial < 20:                    # contexts up to TINY_CONTEXT, some past half of it
            lens = rng.integers(1025 if trial % 2 else 1, 2049, int(rng.integers(1, 6)))
        max_batch = lens.size + 2
        _, plan, got = compare(rng, lens, shape=SHAPES[trial % len(SHAPES)],
                               page_size=int(rng.choice([1, 16, 64])),
                               layout=("flashinfer", "block_table")[trial % 2],
                               max_batch=max_batch, max_chunks=max(max_batch, 4096),
                               launch_order=LAUNCH_ORDERS[trial % 3], model=model)
        won["tiny" if got.state["kind"] == 1 and got.state["value"] < 64 else
            ("no split", "chunk tokens", "num splits")[got.state["kind"]]] += 1
        strategies[plan.strategy] += 1
    assert set(won) == {"tiny", "no split", "chunk tokens", "num splits"}, won
    assert set(strategies) == {"single", "split_merge", "fused"}, strategies


def compare_many(rng, model, trials: int) -> collections.Counter:
    """``compare`` on ``trials`` random batches of every kind and shape; the tile counts the
    model's rows saw (its ``build_tile_units`` per shape)."""
    from splitkv.planner.features import build_tile_units

    seen = collections.Counter()
    for trial in range(trials):
        lens = random_lengths(rng, trial % 5)
        max_batch = lens.size + int(rng.integers(0, 5))
        shape, page = SHAPES[trial % len(SHAPES)], int(rng.choice([1, 16, 64]))
        compare(rng, lens, shape=shape, page_size=page,
                layout=("flashinfer", "block_table")[trial % 2], max_batch=max_batch,
                max_chunks=int(rng.choice([max_batch, 2 * max_batch, 4096])),
                launch_order=LAUNCH_ORDERS[trial % 3], model=model)
        seen[build_tile_units(model.tile_rule, *shape, page, model.num_sms)] += 1
    return seen


@pytest.mark.parametrize("multi_token", [False, True], ids=["fp8", "fp8_multi_token"])
def test_a_model_counting_its_builds_tiles_plans_as_on_the_host(multi_token):
    """The per-shape fp8 fit (tile_rule 'fp8', and 'fp8_multi_token' for multi-token plans)
    counts the 128-token tiles its builds run (core.builds): the planner on the device counts
    the same (``build_tile_units`` in its argument, the odd chunks per row) and chooses the
    host's plan, under the shipped fit and random ones. Both sides of one CTA an SM are met,
    and shapes whose every grid runs 128-token tiles."""
    from splitkv.planner.cost_model import CostModel
    from splitkv.planner.features import FEATURE_NAMES

    fp8 = load_profile(device_name="NVIDIA H200", num_sms=132).cost_model("float8_e4m3fn")
    fp8 = fp8.with_clusters(False)
    rng = np.random.default_rng(21 + multi_token)
    models = [fp8] + [CostModel.from_coef(rng.exponential(1.0, len(FEATURE_NAMES))
                                          * (rng.random(len(FEATURE_NAMES)) < 0.7),
                                          num_sms=132, tile_rule="fp8") for _ in range(3)]
    seen = collections.Counter()
    for model in models:
        seen += compare_many(rng, model.for_multi_token() if multi_token else model, 40)
    assert {(2, 2, 2, 2), (1, 1, 2, 2)} <= set(seen) if not multi_token else \
        set(seen) == {(1, 1, 2, 2)}, seen


def test_tiles_that_follow_the_chunks_length_count_alike(monkeypatch):
    """A build that changes with the chunks' mean length (as 16-bit lone grids do) counts the
    same on both sides: every table of 64- and 128-token tiles by grid and chunk length, under
    the shipped model and one that prices the critical path and its tiles (the tiny chunk
    sizes then win)."""
    from splitkv.planner import planner
    from splitkv.planner.cost_model import CostModel
    from splitkv.planner.features import FEATURE_NAMES
    from splitkv.runtime import device_planner

    crit_and_tiles = CostModel.from_coef([{"crit_us": 1.0, "crit_tiles": 0.01}.get(name, 0.0)
                                      for name in FEATURE_NAMES], num_sms=132)
    rng = np.random.default_rng(23)
    for units in ((1, 2, 1, 2), (1, 1, 1, 2), (2, 1, 2, 2), (2, 2, 1, 1), (2, 2, 2, 2)):
        monkeypatch.setattr(planner, "build_tile_units", lambda *_, u=units: u)
        monkeypatch.setattr(device_planner, "build_tile_units", lambda *_, u=units: u)
        compare_many(rng, MODEL, 20)
        for trial in range(20):
            max_batch = int(rng.integers(1, 6))
            compare(rng, rng.integers(1, 2049, max_batch), shape=SHAPES[trial % len(SHAPES)],
                    page_size=16, layout="flashinfer", max_batch=max_batch, max_chunks=4096,
                    launch_order=LAUNCH_ORDERS[0], model=crit_and_tiles)


def test_a_single_candidate_predicts_the_same_bits():
    """Tiny contexts leave one candidate (no split): its prediction summed in feature order on
    both sides (NumPy would sum a lone column pairwise), e.g. lens [0, 2, 2]."""
    rng = np.random.default_rng(2)
    for lens in ([0, 2, 2], [1], [3, 0], [17, 5, 9]):
        for layout in ("flashinfer", "block_table"):
            compare(rng, np.array(lens), shape=(32, 8, 128), page_size=16, layout=layout,
                    max_batch=len(lens), max_chunks=64, launch_order="longest_chunks")


def test_later_plans_idle_what_earlier_ones_used():
    """One run's buffers through a long plan, a short one and a long one again: each time the
    records past the plan are idle and merge_indptr is the new plan's."""
    rng = np.random.default_rng(7)
    kw = dict(shape=(32, 8, 128), page_size=16, layout="block_table", max_batch=40,
              max_chunks=1056, launch_order="longest_chunks")
    run, long_plan, _ = compare(rng, rng.integers(1000, 60000, 40), **kw)
    run, short_plan, got = compare(rng, np.full(3, 100), run=run, **kw)
    assert short_plan.num_chunks < long_plan.num_chunks and got.state["plans"] == 2
    compare(rng, rng.integers(1000, 60000, 33), run=run, **kw)
    _, empty_plan, _ = compare(rng, np.zeros(5, np.int64), run=run, **kw)   # nothing to read
    assert empty_plan.num_chunks == 5


def test_the_candidate_rows_are_the_host_planners():
    """The slots a warp enumerates in parallel, placed, are ``planner._candidates``' rows in
    order: kinds, values and tiny sizes, over batches from one request to past the grid's
    limit, tiny to very long contexts, slot counts of the GPUs and small ones."""
    from splitkv.planner.planner import _candidates

    lib = host_library()
    rng = np.random.default_rng(5)
    out = np.zeros(3 * 64, np.int32)
    kinds = collections.Counter()
    for trial in range(6000):
        batch = int(rng.choice([1, 2, 3, 8, 32, 256, 1024, 5000]))
        top = int(rng.choice([16, 65, 2049, 40_000, 1 << 20, (1 << 31) - 1]))
        max_len = int(rng.integers(0, top + 1)) if trial % 7 else int(rng.integers(0, 70))
        total = max_len + int(rng.integers(0, max(batch - 1, 0) * max_len + 1))
        ipc = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
        slots = int(rng.choice([8, 66, 132, 264, 296, 528]))
        values, split_rows, _, chunk, num_tiny, _ = _candidates(batch, max_len, total, ipc,
                                                                slots, None, None)
        rows = lib.splitkv_candidate_rows(batch, max_len, total, ipc, slots, out.ctypes.data)
        got = out[:3 * rows].reshape(rows, 3)
        want_kinds = [0] + [2 if split_rows.start <= r < split_rows.stop else 1
                            for r in range(1, len(values))]
        want_tiny = [int(r >= len(values) - num_tiny and r > 0) for r in range(len(values))]
        what = (batch, max_len, total, ipc, slots)
        assert got[:, 0].tolist() == list(values), what
        assert got[:, 1].tolist() == want_kinds, what
        assert got[:, 2].tolist() == want_tiny, what
        kinds.update(want_kinds)
        kinds["tiny"] += num_tiny
    assert all(kinds[k] for k in (0, 1, 2, "tiny")), kinds


def test_the_argument_struct_matches_its_mirror():
    import ctypes

    assert host_library().splitkv_plan_params_size() == ctypes.sizeof(DevicePlanParams)


def test_invalid_values_plan_the_request_empty_and_keep_the_first_error():
    """A negative length or a row too short (block table), a bad kv_indptr or last-page length
    (FlashInfer): the request is planned as one empty chunk and the first error is kept with
    its request."""
    rng = np.random.default_rng(3)
    params = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, stages=3,
                  max_batch=8, max_chunks=256, launch_order="longest_chunks")
    lens = np.array([3000, 70, 5000, 1])
    table, _ = scattered_page_table(lens, 16, rng, 0)
    seq_lens, block_table = layout_arrays(table, "block_table", rng)
    cases = {
        "negative length": ("block_table", (np.array([3000, -5, 5000, 1], np.int32),
                                            block_table), 1, 1),
        "row too short": ("block_table", (np.array([3000, 70, 5000 + 16 * 400, 1], np.int32),
                                          block_table), 2, 2),
    }
    indptr, last, indices = layout_arrays(table, "flashinfer")
    bad_indptr = indptr.copy()
    bad_indptr[2] = indptr[1] - 1                     # request 1 ends before it begins
    bad_last = last.copy()
    bad_last[3] = 17
    cases["kv_indptr decreasing"] = ("flashinfer", (bad_indptr, last, indices), 3, 1)
    cases["kv_last_page_len past the page"] = ("flashinfer", (indptr, bad_last, indices), 4, 3)
    for what, (layout, arrays, code, request) in cases.items():
        run = HostRun(plan_params(MODEL, **params))
        got = run.plan(layout, arrays)
        assert (got.state["error"], got.state["error_request"]) == (code, request), what
        records = got.records[:got.state["num_chunks"]]
        mine = records[records["request"] == request]
        assert mine.size == 1 and mine["token_end"][0] == 0, what
        again = run.plan(layout, arrays)          # the first error stays until cleared
        assert again.state["error_request"] == request, what


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_planning_kernel_compiles(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupy_backends.cuda.libs import nvrtc

    from splitkv.runtime.device_planner import PLAN_NVRTC_OPTIONS

    prog = nvrtc.createProgram(source(), "device_plan.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [*PLAN_NVRTC_OPTIONS, f"-arch={arch}"])
        assert nvrtc.getCUBIN(prog)[:4] == b"\x7fELF"
        assert "warning" not in nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


class FakeDeviceArray:
    """An object with __cuda_array_interface__ (no GPU needed for the host checks)."""

    def __init__(self, shape, typestr="<i4", strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (4096, False), "strides": strides, "version": 3}


def test_plan_on_device_arrays_are_checked_on_the_host():
    pytest.importorskip("cupy")
    ok = dict(max_batch=4, device=0)
    lens, table = FakeDeviceArray((3,)), FakeDeviceArray((3, 8))
    batch, _ = device_batch(seq_lens=lens, block_table=table, **ok)
    assert (batch.layout, batch.batch_size, batch.block_table_stride) == ("block_table", 3, 8)
    fi = dict(kv_indptr=FakeDeviceArray((4,)), kv_indices=FakeDeviceArray((20,)),
              kv_last_page_len=FakeDeviceArray((3,)))
    assert device_batch(**fi, **ok)[0].page_table_entries == 20
    with pytest.raises(TypeError, match="seq_lens and block_table, or"):
        device_batch(**ok)
    with pytest.raises(TypeError, match="and kv_indptr"):
        device_batch(seq_lens=lens, block_table=table, kv_indptr=fi["kv_indptr"], **ok)
    with pytest.raises(TypeError, match="block_table: this layout needs"):
        device_batch(seq_lens=lens, **ok)
    with pytest.raises(TypeError, match="seq_lens: expected an int32"):
        device_batch(seq_lens=FakeDeviceArray((3,), "<u4"), block_table=table, **ok)
    with pytest.raises(ValueError, match="block_table: expected a contiguous"):
        device_batch(seq_lens=lens, block_table=FakeDeviceArray((3, 8), strides=(64, 4)), **ok)
    with pytest.raises(ValueError, match="block_table: expected \\[batch, max_pages\\]"):
        device_batch(seq_lens=lens, block_table=FakeDeviceArray((2, 8)), **ok)
    with pytest.raises(ValueError, match="max_batch_size=4"):
        device_batch(seq_lens=FakeDeviceArray((5,)), block_table=FakeDeviceArray((5, 2)), **ok)
    # a table of any width: the kernel reads it in place (max_num_pages sizes plan()'s upload)
    assert device_batch(seq_lens=lens, block_table=FakeDeviceArray((3, 300)), **ok)[0] \
        .page_table_entries == 900
    with pytest.raises(ValueError, match="kv_indptr: expected \\[batch \\+ 1\\]"):
        device_batch(**dict(fi, kv_indptr=FakeDeviceArray((3,))), **ok)
    with pytest.raises(TypeError, match="device array"):
        device_batch(seq_lens=np.zeros(3, np.int32), block_table=table, **ok)


def test_multi_token_query_rows_and_plans_match_the_host_wrappers():
    """A graph-stable wrapper made with max_q_len: the device planner plans the virtual heads
    (max_q_len x num_qo_heads) as plan() does, and writes query_rows as plan() uploads them
    (records.query_rows_array, no window; rows past the batch: none); without qo_indptr, one
    row a request."""
    from splitkv.core import variants as VA
    from splitkv.runtime.records import query_rows_array

    rng = np.random.default_rng(11)
    for trial in range(40):
        hq, hk, d = SHAPES[trial % 3]
        max_q = int(rng.choice([2, 4, 8, 16]))
        lens = random_lengths(rng, trial % 5)
        max_batch = lens.size + int(rng.integers(0, 4))
        q_lens = np.minimum(rng.integers(1, max_q + 1, lens.size), np.maximum(lens, 1))
        qo_indptr = None if trial % 4 == 3 else np.concatenate([[0], np.cumsum(q_lens)])
        heads = hq * max_q
        run = HostRun(plan_params(MODEL, num_qo_heads=heads, num_kv_heads=hk, head_dim=d,
                                  page_size=16, stages=STAGES[d], max_batch=max_batch,
                                  max_chunks=4096, launch_order="longest_chunks"), max_q)
        table, _ = scattered_page_table(lens, 16, rng, 2)
        got = run.plan("flashinfer", layout_arrays(table, "flashinfer"), qo_indptr)
        plan, want, merge_indptr = expected(table, MODEL, num_qo_heads=heads, num_kv_heads=hk,
                                            head_dim=d, stages=STAGES[d], max_batch=max_batch,
                                            max_chunks=4096, launch_order="longest_chunks")
        assert got.state["error"] == 0 and got.state["num_chunks"] == plan.num_chunks
        assert records_equal(got.records[:plan.num_chunks], want)
        rows = query_rows_array(VA.query_rows(qo_indptr, table.kv_lens), table.kv_lens, -1)
        full = np.zeros((max_batch, 4), np.int32)
        full[:, 3] = -1
        full[:lens.size] = rows
        np.testing.assert_array_equal(got.query_rows, full, err_msg=f"trial {trial}")


def test_bad_query_rows_are_kept_as_an_error_and_leave_no_rows():
    """Any bad entry: the error (its first request) and no request with rows, since past a
    decreasing entry the others' rows may overlap."""
    from splitkv.runtime.device_planner import ERRORS

    rng = np.random.default_rng(12)
    lens = np.array([100, 2, 300])
    table, _ = scattered_page_table(lens, 16, rng, 2)
    params = plan_params(MODEL, num_qo_heads=32 * 4, num_kv_heads=8, head_dim=128,
                         page_size=16, stages=3, max_batch=3, max_chunks=64,
                         launch_order="longest_chunks")
    for qo, bad in (([0, 4, 6, 11], 2),         # 5 rows: past max_q_len=4
                    ([0, 2, 2, 3], 1),          # no rows
                    ([1, 2, 3, 4], 0),          # qo_indptr[0] != 0
                    ([0, 1, 4, 5], 1),          # 3 rows for 2 tokens
                    ([0, 3, 1, 2], 1)):         # decreasing: request 2 would overlap request 0
        run = HostRun(params, 4)
        got = run.plan("flashinfer", layout_arrays(table, "flashinfer"), np.array(qo))
        assert got.state["error"] == 5 and got.state["error_request"] == bad, qo
        assert (got.query_rows[:, 1] == 0).all(), (qo, got.query_rows)
    good = HostRun(params, 4).plan("flashinfer", layout_arrays(table, "flashinfer"),
                                   np.array([0, 4, 6, 10]))
    assert good.state["error"] == 0 and good.query_rows[:, 1].tolist() == [4, 2, 4]
    assert ERRORS[5].startswith("qo_indptr:")


def test_plan_on_device_checks_qo_indptr_on_the_host():
    pytest.importorskip("cupy")
    ok = dict(max_batch=8, device=0, seq_lens=FakeDeviceArray((4,)),
              block_table=FakeDeviceArray((4, 8)))
    for bad, kind, message in ((FakeDeviceArray((5,), "<u4"), TypeError, "int32"),
                               (FakeDeviceArray((4,)), ValueError, "\\[batch \\+ 1\\]"),
                               (FakeDeviceArray((5,), strides=(8,)), ValueError, "contiguous"),
                               (np.zeros(5, np.int32), TypeError, "device array")):
        with pytest.raises(kind, match="qo_indptr: .*" + message):
            device_batch(qo_indptr=bad, **ok)
    batch, arrays = device_batch(qo_indptr=FakeDeviceArray((5,)), **ok)
    assert batch.qo_indptr == 4096 and len(arrays) == 3
    assert device_batch(**ok)[0].qo_indptr == 0


def assert_the_host_plan(got, plan, want, merge_indptr, table, layout, arrays, what):
    """The planning kernel's run ``got`` wrote the host plan: its chunk count, prediction,
    records (``want``, the host's) and merge_indptr."""
    n = plan.num_chunks
    have, want = comparable_records(got.records[:n], want, table, layout, arrays)
    assert got.state["error"] == 0 and got.state["num_chunks"] == n, what
    assert got.predicted_us == plan.predicted_us, what
    assert records_equal(have, want), what
    assert np.array_equal(got.merge_indptr, merge_indptr), what


@pytest.mark.parametrize("seed", range(2))
def test_chunked_attention_plans_match_the_host_planners(seed):
    """attention_chunk_size on the device: each request's chunks cover the tokens of its last
    position's chunk (with a window too, the later start), as DecodeProblem plans them."""
    rng = np.random.default_rng(200 + seed)
    for trial in range(30):
        hq, hk, d = SHAPES[trial % len(SHAPES)]
        lens = random_lengths(rng, trial % 5)
        chunk = int(rng.choice([1, 64, 1000, 8192]))
        window = int(rng.choice([-1, -1, 0, 500, 4095]))
        page = int(rng.choice([1, 16, 64]))
        max_batch = lens.size + int(rng.integers(0, 3))
        launch_order = LAUNCH_ORDERS[trial % 3]
        params = plan_params(MODEL, num_qo_heads=hq, num_kv_heads=hk, head_dim=d,
                             page_size=page, stages=STAGES[d], max_batch=max_batch,
                             max_chunks=4096, launch_order=launch_order)
        params.window_left = params.rows_window_left = window
        params.attention_chunk_size = chunk
        run = HostRun(params, 1)
        table, _ = scattered_page_table(lens, page, rng, 2)
        layout = ("flashinfer", "block_table")[trial % 2]
        arrays = layout_arrays(table, layout, rng)
        got = run.plan(layout, arrays, None)
        plan, want, merge_indptr = expected(table, MODEL, num_qo_heads=hq, num_kv_heads=hk,
                                            head_dim=d, stages=STAGES[d], max_batch=max_batch,
                                            max_chunks=4096, launch_order=launch_order,
                                            window_left=window, attention_chunk_size=chunk)
        assert np.all(plan.chunk_start >= plan.problem.kv_begin[plan.chunk_request])
        assert_the_host_plan(got, plan, want, merge_indptr, table, layout, arrays,
                             f"trial {trial}: chunk {chunk}, window {window}, page {page}, "
                             f"{layout}")


@pytest.mark.parametrize("seed", range(3))
def test_windowed_plans_match_the_host_planners(seed):
    """window_left on the device: each request's chunks cover its window, moved to the
    window's first token, as DecodeProblem(window_left=) plans them (with query rows, the
    covering window, and the rows' own window in query_rows)."""
    from splitkv.core import variants as VA
    from splitkv.runtime.records import query_rows_array

    rng = np.random.default_rng(100 + seed)
    for trial in range(30):
        hq, hk, d = SHAPES[trial % len(SHAPES)]
        lens = random_lengths(rng, trial % 5)
        window = int(rng.choice([0, 1, 63, 500, 4095, 30000]))
        max_q = int(rng.choice([1, 1, 4, 8]))
        page = int(rng.choice([1, 16, 64]))
        max_batch = lens.size + int(rng.integers(0, 3))
        launch_order = LAUNCH_ORDERS[trial % 3]
        covering = VA.covering_window_left(window, max_q) if max_q > 1 else window
        heads = hq * max_q
        params = plan_params(MODEL, num_qo_heads=heads, num_kv_heads=hk, head_dim=d,
                             page_size=page, stages=STAGES[d], max_batch=max_batch,
                             max_chunks=4096, launch_order=launch_order)
        params.window_left, params.rows_window_left = covering, window
        run = HostRun(params, max_q)
        table, _ = scattered_page_table(lens, page, rng, 2)
        q_lens = np.minimum(rng.integers(1, max_q + 1, lens.size), np.maximum(lens, 1))
        qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]) if max_q > 1 else None
        layout = ("flashinfer", "block_table")[trial % 2]
        arrays = layout_arrays(table, layout, rng)
        got = run.plan(layout, arrays, qo_indptr)
        plan, want, merge_indptr = expected(table, MODEL, num_qo_heads=heads, num_kv_heads=hk,
                                            head_dim=d, stages=STAGES[d], max_batch=max_batch,
                                            max_chunks=4096, launch_order=launch_order,
                                            window_left=covering)
        what = f"trial {trial}: window {window}, q {max_q}, page {page}, {layout}"
        assert_the_host_plan(got, plan, want, merge_indptr, table, layout, arrays, what)
        if max_q > 1:
            rows = query_rows_array(VA.query_rows(qo_indptr, table.kv_lens), table.kv_lens,
                                    window)
            full = np.zeros((max_batch, 4), np.int32)
            full[:, 3] = -1
            full[:lens.size] = rows
            np.testing.assert_array_equal(got.query_rows, full, err_msg=what)
