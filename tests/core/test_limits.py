"""The size limits of the host API (``validation.MAX_*``), the profile argument, and errors that
name the argument actually wrong: each refused up front with a ValueError or TypeError naming
the argument, before any large array is made."""

import os
import tracemalloc
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from splitkv import (DecodeProblem, PageTable, execute_plan_cpu, plan_chunk_tokens,
                     plan_fixed_splits, plan_from_chunk_counts, reference_decode)
from splitkv.core import validation as V
from splitkv.planner import choose_plan
from splitkv.planner.profile_lookup import load_profile
from splitkv.planner.profiles import ProfileError
from helpers.batches import host_decode_inputs

BIG = V.MAX_KV_LEN                  # the longest request there may be: 2**31 - 1 tokens


def problem(lens, hq=8, hk=8, page_size=16):
    return DecodeProblem(np.asarray(lens, dtype=np.int64), hq, hk, 128, page_size)


def test_the_limits():
    assert V.MAX_KV_LEN == np.iinfo(np.int32).max == V.MAX_PAGE_SIZE
    assert V.MAX_HEADS == 2**16 - 1 and V.MAX_CHUNKS == V.MAX_BATCH_SIZE == 2**24
    assert V.MAX_TOTAL_PAGES == 2**31 - 1
    # every total stays far inside int64 (and chunk totals inside int32)
    assert V.MAX_BATCH_SIZE * V.MAX_KV_LEN < 2**55 and V.MAX_CHUNKS < 2**31


def assert_tiles(plan):
    """Non-negative chunks that cover every token of every request exactly once, in order."""
    lens = plan.problem.kv_lens
    start, end = plan.chunk_start.astype(np.int64), plan.chunk_end.astype(np.int64)
    assert (start >= 0).all() and (start <= end).all()
    assert (end <= lens[plan.chunk_request]).all()
    for b in range(lens.size):
        lo, hi = plan.merge_indptr[b], plan.merge_indptr[b + 1]
        assert hi > lo and start[lo] == 0 and end[hi - 1] == lens[b]
        assert (start[lo + 1:hi] == end[lo:hi - 1]).all()


# ---- arrays NumPy cannot read as integers -----------------------------------------------------

@pytest.mark.parametrize("make, name", [
    (lambda: DecodeProblem([[1, 2], [3]], 8, 8, 128, 16), "kv_lens"),
    (lambda: PageTable.from_flashinfer([[0], [1, 2]], [0], [1], 16), "kv_indptr"),
    (lambda: PageTable.from_block_table([[0, 1], [2]], [5, 5], 16), "block_table"),
    (lambda: plan_from_chunk_counts(problem([5, 5]), [[1], [1, 2]], "fused"), "chunks_per_request"),
])
def test_ragged_nesting_is_a_type_error_naming_the_argument(make, name):
    # not NumPy's own ValueError ("setting an array element with a sequence"), which names nothing
    with pytest.raises(TypeError, match=f"{name}: expected a .-d integer array"):
        make()


# ---- tokens per request ------------------------------------------------------------------------

@pytest.mark.parametrize("lens", [[2**31], [5, 2**31 + 7], [2**62, 2**62], [2**63 - 1]])
def test_requests_past_int32_are_refused(lens):
    # 2**31 tokens would wrap chunk_end to -2**31 in int32; 2**62 twice overflows an int64 total
    with pytest.raises(ValueError, match="kv_lens: request .* MAX_KV_LEN=2147483647"):
        problem(lens)


def test_lengths_that_do_not_fit_int64_are_refused():
    with pytest.raises(ValueError, match="kv_lens: value .* does not fit in int64"):
        DecodeProblem(np.array([2**63], dtype=np.uint64), 8, 8, 128, 16)


@pytest.mark.parametrize("make", [
    lambda p: plan_fixed_splits(p, 1),
    lambda p: plan_fixed_splits(p, 3),
    lambda p: plan_fixed_splits(p, 7, align=64),
    lambda p: plan_chunk_tokens(p, 2**30, "fused"),
    lambda p: plan_from_chunk_counts(p, [1, 5, 3], "split_merge", align=16),
    lambda p: choose_plan(p),
    lambda p: choose_plan(p, num_splits=4),
])
def test_the_longest_request_plans_exactly(make):
    plan = make(problem([BIG, 1, BIG - 100]))
    assert_tiles(plan)
    assert plan.chunk_end.max() == BIG


def test_page_tables_past_the_limit_are_refused():
    half = 2**30
    with pytest.raises(ValueError, match=r"kv_indptr: request 0 holds 2147483649 tokens \(3 "
                                         r"pages of 1073741824\); at most MAX_KV_LEN"):
        PageTable.from_flashinfer([0, 3], [0, 1, 2], [1], half)
    with pytest.raises(ValueError, match="kv_indptr: request 0 holds 2147483648 tokens"):
        PageTable.from_flashinfer([0, 2], [0, 1], [half], half)     # 2 pages, full: 2**31
    assert PageTable.from_flashinfer([0, 2], [0, 1], [half - 1], half).kv_lens[0] == BIG
    with pytest.raises(ValueError, match="seq_lens: request 0 has 2147483648 tokens"):
        PageTable.from_block_table([[0, 1]], [2**31], BIG)
    with pytest.raises(ValueError, match="max_len: .*MAX_KV_LEN"):
        PageTable.contiguous([3], 2**31)


def test_total_pages_limit(monkeypatch):
    # 2**31 pages need 16 GiB of indices to try; the check is the same at a lower limit
    monkeypatch.setattr(V, "MAX_TOTAL_PAGES", 4)
    PageTable.from_flashinfer([0, 2, 4], [0, 1, 2, 3], [1, 1], 16)
    with pytest.raises(ValueError, match="kv_indices: 5 pages; at most MAX_TOTAL_PAGES=4"):
        PageTable.from_flashinfer([0, 2, 5], [0, 1, 2, 3, 4], [1, 1], 16)


def test_batch_size_limit():
    lens = np.broadcast_to(np.int64(1), (V.MAX_BATCH_SIZE + 1,))    # a view: no 128 MB array
    with pytest.raises(ValueError, match="kv_lens: 16777217 requests; at most MAX_BATCH_SIZE"):
        DecodeProblem(lens, 8, 8, 128, 16)
    with pytest.raises(ValueError, match="kv_indptr: 16777217 requests"):
        PageTable(np.broadcast_to(np.int64(0), (V.MAX_BATCH_SIZE + 2,)), [], [0], 16)


# ---- heads and page size -----------------------------------------------------------------------

@pytest.mark.parametrize("hq, hk, name", [
    (2**31, 2**31, "num_qo_heads"), (2**16, 1, "num_qo_heads"), (2**16, 2**16, "num_qo_heads"),
    (8, 2**40, "num_kv_heads"), (2**64, 8, "num_qo_heads"),
])
def test_head_counts_past_the_limit_are_refused(hq, hk, name):
    with pytest.raises(ValueError, match=f"{name}: expected an integer <= 65535 \\(MAX_HEADS\\)"):
        DecodeProblem(np.array([4]), hq, hk, 128, 16)


def test_the_most_heads_are_accepted():
    p = DecodeProblem(np.array([4]), V.MAX_HEADS, V.MAX_HEADS, 128, 16)
    assert p.group_size == 1


@pytest.mark.parametrize("make", [
    lambda ps: DecodeProblem(np.array([4]), 8, 8, 128, ps),
    lambda ps: PageTable([0, 1], [0], [4], ps),
    lambda ps: PageTable.from_flashinfer([0, 1], [0], [4], ps),
    lambda ps: PageTable.from_block_table([[0]], [4], ps),
    lambda ps: PageTable.from_layout(None, ps, block_table=[[0]], seq_lens=[4]),
])
@pytest.mark.parametrize("page_size", [2**31, 2**64, 10**30])
def test_huge_page_sizes_are_a_value_error(make, page_size):
    # 2**64 is refused by name, not with NumPy's OverflowError
    with pytest.raises(ValueError, match="page_size: .*MAX_PAGE_SIZE"):
        make(page_size)


def test_the_largest_page_size_is_accepted():
    table = PageTable.from_block_table([[0]], [4], V.MAX_PAGE_SIZE)
    assert table.kv_lens.tolist() == [4] and table.page_size == V.MAX_PAGE_SIZE


# ---- chunk counts: bounded before anything is allocated ----------------------------------------

def peak_bytes(call):
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("make, name", [
    (lambda p: plan_fixed_splits(p, V.MAX_CHUNKS), "num_splits"),          # 2 x 2**24 chunks
    (lambda p: plan_chunk_tokens(p, 1, "fused"), "chunk_tokens"),          # 2**32 chunks
    (lambda p: plan_chunk_tokens(p, 64, "fused"), "chunk_tokens"),
    (lambda p: plan_from_chunk_counts(p, [2**40, 1], "fused"), "chunks_per_request"),
    (lambda p: plan_from_chunk_counts(p, [2**62, 2**62], "fused"), "chunks_per_request"),
    (lambda p: choose_plan(p, num_splits=V.MAX_CHUNKS), "num_splits"),
])
def test_huge_splits_fail_before_allocating(make, name):
    # once: gigabytes of plan arrays (2**30 chunks of a 2**30-token request) before any error
    p = problem([BIG, BIG])
    choose_plan(problem([5]))           # the default profile, read once, outside the count

    def call():
        with pytest.raises(ValueError, match=f"{name}: the plan would have .* MAX_CHUNKS"):
            make(p)

    assert peak_bytes(call) < 1 << 20


@pytest.mark.parametrize("make, name", [
    (lambda p: plan_fixed_splits(p, 2**30), "num_splits"),
    (lambda p: plan_fixed_splits(p, 2**100), "num_splits"),
    (lambda p: choose_plan(p, num_splits=2**100), "num_splits"),
    (lambda p: plan_chunk_tokens(p, 2**40, "fused"), "chunk_tokens"),
    (lambda p: plan_fixed_splits(p, 2, align=2**64), "align"),
    (lambda p: plan_from_chunk_counts(p, [1, 1], "fused", align=2**31), "align"),
])
def test_out_of_range_integers_are_a_value_error(make, name):
    with pytest.raises(ValueError, match=f"{name}: expected an integer <="):
        make(problem([100, 5]))


def test_counts_above_a_requests_tiles_are_still_reduced():
    # documented: a count may exceed what a request can take, and is cut to its tiles
    plan = plan_from_chunk_counts(problem([100, 0, 3]), [2**62, 9, 5], "fused", align=16)
    assert plan.chunks_per_request.tolist() == [7, 1, 1]
    assert_tiles(plan)


def test_a_max_chunks_past_the_limit_still_plans():
    plan = choose_plan(problem([5000, 9]), max_chunks=2**40)
    assert_tiles(plan)


# ---- the profile argument of choose_plan -------------------------------------------------------

SHIPPED = resources.files("splitkv.planner").joinpath("profiles", "nvidia-h200.yaml")


@pytest.mark.parametrize("as_path", [str, Path, os.fspath])
def test_choose_plan_reads_a_profile_path(as_path):
    p = problem([5000, 100, 17])
    want = choose_plan(p, profile=load_profile(path=str(SHIPPED)))
    got = choose_plan(p, profile=as_path(Path(str(SHIPPED))))
    assert got.summary() == want.summary()
    for name in ("chunk_request", "chunk_start", "chunk_end", "merge_indptr"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_choose_plan_bad_profiles(tmp_path):
    p = problem([50])
    with pytest.raises(ProfileError, match="profile .*missing.yaml: cannot read it"):
        choose_plan(p, profile=tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("{not: [valid")
    with pytest.raises(ValueError, match="profile .*bad.yaml: not valid YAML"):
        choose_plan(p, profile=str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="profile: .* got an empty path"):
        choose_plan(p, profile="")
    for bad in (3, b"nvidia-h200.yaml", [str(SHIPPED)], {"num_sms": 132}):
        with pytest.raises(TypeError, match="profile: expected a Profile, a fitted CostModel, "
                                            "a path"):
            choose_plan(p, profile=bad)


# ---- the argument blamed is the one that is wrong (host paths) ---------------------------------

@pytest.fixture
def inputs(rng):
    return host_decode_inputs(rng, [20, 17])


def both_paths(x, **changes):
    a = {**x, **changes}
    return (lambda: reference_decode(a["q"], a["k_cache"], a["v_cache"], a["page_table"]),
            lambda: execute_plan_cpu(a["plan"], a["q"], a["k_cache"], a["v_cache"],
                                     a["page_table"]))


@pytest.mark.parametrize("change, blamed", [
    # K short and V right: K is named, not V
    (lambda x: dict(k_cache=x["k_cache"][:3]), "k_cache: the page table references page 3 but "
                                               "k_cache has 3 pages"),
    (lambda x: dict(v_cache=x["v_cache"][:3]), "v_cache: the page table references page 3 but "
                                               "v_cache has 3 pages"),
    (lambda x: dict(k_cache=x["k_cache"][:1], v_cache=x["v_cache"][:3]), "k_cache: .* 1 pages"),
    # K and V agree and q is the odd one: q is named, not K
    (lambda x: dict(q=x["q"][..., :32]), r"q: expected shape \[2, \*, 64\]|q: expected shape "
                                         r"\[2, 8, 64\]"),
    (lambda x: dict(k_cache=x["k_cache"][..., :32]), "k_cache: expected shape"),
    (lambda x: dict(v_cache=x["v_cache"][..., :32]), "v_cache: expected shape"),
    (lambda x: dict(v_cache=x["v_cache"][:, :, :1]), "v_cache: expected shape"),
    (lambda x: dict(v_cache=x["v_cache"][:, :8]), "v_cache: expected shape"),
    # both caches too short: the caches are named, not kv_indices, which the caller may not pass
    (lambda x: dict(k_cache=x["k_cache"][:2], v_cache=x["v_cache"][:2]),
     r"k_cache, v_cache: the page table references page 3 but the caches have 2 pages"),
])
def test_the_wrong_argument_is_named(inputs, change, blamed):
    for call in both_paths(inputs, **change(inputs)):
        with pytest.raises(ValueError, match=blamed):
            call()


def test_caches_with_more_pages_than_the_table_needs(inputs):
    # each cache needs every page of the table; beyond that their page counts may differ
    x = inputs
    k5 = np.concatenate([x["k_cache"], x["k_cache"][:1]])
    want, _ = reference_decode(x["q"], x["k_cache"], x["v_cache"], x["page_table"])
    for call in both_paths(x, k_cache=k5):
        np.testing.assert_allclose(call()[0], want, rtol=1e-12, atol=1e-12)


# ---- and on the GPU path's checks (descriptors only: no GPU needed) ----------------------------

def device_array(shape, dtype="bfloat16"):
    from splitkv.runtime.arrays import DeviceArray

    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return DeviceArray(0, tuple(shape), tuple(reversed(strides)), dtype, 0, None)


@pytest.mark.parametrize("q, k, v, blamed", [
    ((2, 8, 64), (3, 16, 2, 64), (4, 16, 2, 64), "k_cache: the plan's page table references page 3"),
    ((2, 8, 64), (4, 16, 2, 64), (3, 16, 2, 64), "v_cache: the plan's page table references page 3"),
    ((2, 8, 32), (4, 16, 2, 64), (4, 16, 2, 64), "q: expected shape"),
    ((2, 8, 64), (4, 16, 2, 32), (4, 16, 2, 64), "k_cache: expected shape"),
    ((2, 8, 64), (4, 16, 2, 64), (4, 16, 2, 32), "v_cache: expected shape"),
    ((2, 8, 64), (4, 8, 2, 64), (4, 16, 2, 64), "k_cache: expected shape"),
])
def test_the_wrong_device_argument_is_named(q, k, v, blamed):
    with pytest.raises(ValueError, match=blamed):
        V.check_device_decode_arrays(device_array(q), device_array(k), device_array(v),
                                     batch_size=2, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                                     page_size=16, dtype="bfloat16", max_page=3, device=0)


def test_a_page_of_2_gib_or_more_is_refused_before_any_launch():
    """The kernels address a page's tokens in 32 bits: a page stride (or page_size token
    strides) of 2 GiB or more is named, not wrapped around."""
    from dataclasses import replace

    q, k = device_array((2, 8, 64)), device_array((4, 16, 2, 64))
    kw = dict(batch_size=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
              dtype="bfloat16", max_page=3, device=0)
    V.check_device_decode_arrays(q, k, k, **kw)
    huge_pages = replace(k, strides=(2**30, 128, 64, 1))          # 2 GiB of bf16 per page
    with pytest.raises(ValueError, match="k_cache: expected a page to span under 2 GiB"):
        V.check_device_decode_arrays(q, huge_pages, huge_pages, **kw)
    huge_tokens = replace(k, strides=(2**16 * 16, 2**27, 64, 1))  # 16 tokens of 256 MiB
    with pytest.raises(ValueError, match="k_cache: expected a page to span under 2 GiB"):
        V.check_device_decode_arrays(q, huge_tokens, huge_tokens, **kw)


def test_head_strides_are_free_but_each_head_row_contiguous_and_aligned():
    """K/V are NHD views with any head stride (an HND cache, or padded heads), as long as a
    head's values are contiguous, rows are 16-byte aligned and V's strides are K's."""
    from dataclasses import replace

    q, k = device_array((2, 8, 64)), device_array((4, 16, 2, 64))
    kw = dict(batch_size=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
              dtype="bfloat16", max_page=3, device=0)
    hnd = replace(k, strides=(2048, 64, 1024, 1))           # [pages, heads, page, dim] seen as NHD
    V.check_device_decode_arrays(q, hnd, hnd, **kw)
    padded = replace(k, strides=(4096, 256, 72, 1))         # heads padded to 72 values
    V.check_device_decode_arrays(q, padded, padded, **kw)
    with pytest.raises(ValueError, match="k_cache: expected each head's 64 values to be contiguous"):
        V.check_device_decode_arrays(q, replace(k, strides=(2048, 128, 1, 2)), k, **kw)
    with pytest.raises(ValueError, match="k_cache: expected 16-byte aligned pages, tokens and heads"):
        V.check_device_decode_arrays(q, replace(k, strides=(4096, 256, 68, 1)), k, **kw)
    with pytest.raises(ValueError, match="v_cache: expected the same strides as k_cache"):
        V.check_device_decode_arrays(q, k, hnd, **kw)


def test_a_launch_past_cudas_grid_limit_is_refused_before_any_work():
    """CUDA launches at most 2**31 - 1 CTAs in a 1-D grid: a graph-stable wrapper whose fixed
    grid (max_chunks x kv heads) or merge grid (max_batch_size x heads) would pass it is refused
    when it is made, naming the capacity; plan() checks a per-shape plan's grids the same way
    (V.check_grid_ctas) before its upload."""
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    V.check_grid_ctas("page_table", V.MAX_GRID_CTAS, "at the limit")
    with pytest.raises(ValueError, match=r"^page_table: the launch would have 2147483648 CTAs"):
        V.check_grid_ctas("page_table", 2**31, "one past")
    stable = dict(use_cuda_graph=True, max_num_pages=1)
    with pytest.raises(ValueError, match=r"^max_chunks: the launch would have \d+ CTAs"):
        BatchDecodeWrapper(65535, 65535, 128, 16, "bfloat16", max_chunks=2**24, max_batch_size=1,
                           **stable)
    with pytest.raises(ValueError, match=r"^max_batch_size: the launch would have \d+ CTAs "
                                         r"\(the merge kernel's"):
        BatchDecodeWrapper(65535, 65535, 128, 16, "bfloat16", max_batch_size=2**24, **stable)
    BatchDecodeWrapper(64, 8, 128, 16, "bfloat16", max_batch_size=4096, **stable)   # in range
