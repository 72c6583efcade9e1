"""Every bad input is refused with the right error type and a message naming the argument."""

import re

import numpy as np
import pytest

from splitkv import (DecodeProblem, PageTable, Plan, execute_plan_cpu, plan_chunk_tokens,
                     plan_fixed_splits, plan_from_chunk_counts, reference_decode)
from helpers.batches import host_decode_inputs


class FakeDeviceArray:
    """Looks like a CuPy/Torch CUDA array: has __cuda_array_interface__, no host data."""

    def __init__(self, host):
        self.shape, self.dtype = host.shape, host.dtype
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": host.dtype.str,
                                         "data": (0, False), "version": 3}


class FakeCupyArray:
    __module__ = "cupy._core.core"

    def __init__(self, host):
        self.shape, self.dtype = host.shape, host.dtype


GOOD = dict(kv_indptr=[0, 2, 3], kv_indices=[4, 0, 1], kv_last_page_len=[5, 16], page_size=16)


def flashinfer(**changes):
    args = {**GOOD, **changes}
    return PageTable.from_flashinfer(args["kv_indptr"], args["kv_indices"],
                                     args["kv_last_page_len"], args["page_size"], num_pages=5)


# ---- page tables -------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, error, name", [
    (dict(kv_indices=[4, 0, -1]), ValueError, "kv_indices"),            # negative page
    (dict(kv_indices=[4, 0, 5]), ValueError, "kv_indices"),             # past the pool
    (dict(kv_indices=[4, 0]), ValueError, "kv_indices"),                # indptr says 3 pages
    (dict(kv_indptr=[1, 2, 3]), ValueError, "kv_indptr"),               # must start at 0
    (dict(kv_indptr=[0, 3, 2], kv_last_page_len=[5, 0]), ValueError, "kv_indptr"),  # decreasing
    (dict(kv_indptr=[]), ValueError, "kv_indptr"),
    (dict(kv_last_page_len=[0, 16]), ValueError, "kv_last_page_len"),   # below 1
    (dict(kv_last_page_len=[5, 17]), ValueError, "kv_last_page_len"),   # above page_size
    (dict(kv_last_page_len=[5]), ValueError, "kv_last_page_len"),       # one per request
    (dict(kv_indptr=[0, 3, 3], kv_last_page_len=[5, 1]), ValueError, "kv_last_page_len"),  # empty
    (dict(kv_indptr=[[0, 2, 3]]), ValueError, "kv_indptr"),             # rank
    (dict(kv_indices=[4.0, 0.0, 1.0]), TypeError, "kv_indices"),        # float pages
    (dict(kv_last_page_len=[True, True]), TypeError, "kv_last_page_len"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(page_size=16.0), TypeError, "page_size"),
])
def test_bad_flashinfer_tables(changes, error, name):
    with pytest.raises(error, match=name):
        flashinfer(**changes)


def test_good_flashinfer_table_is_accepted():
    assert flashinfer().kv_lens.tolist() == [21, 16]


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="kv_last_page_len"):
        PageTable([0, 1], [0], [17], 16)


@pytest.mark.parametrize("fake", [FakeDeviceArray, FakeCupyArray])
@pytest.mark.parametrize("name", ["kv_indptr", "kv_indices", "kv_last_page_len"])
def test_device_arrays_are_refused_as_page_tables(fake, name):
    with pytest.raises(TypeError, match=f"{name}: expected a host"):
        flashinfer(**{name: fake(np.asarray(GOOD[name]))})


@pytest.mark.parametrize("fake", [FakeDeviceArray, FakeCupyArray])
def test_device_block_tables_are_refused(fake):
    with pytest.raises(TypeError, match="block_table"):
        PageTable.from_block_table(fake(np.zeros((2, 2), np.int32)), [1, 1], 16)
    with pytest.raises(TypeError, match="seq_lens"):
        PageTable.from_block_table([[0], [1]], fake(np.ones(2, np.int32)), 16)
    with pytest.raises(TypeError, match="kv_lens"):
        DecodeProblem(fake(np.ones(2, np.int32)), 8, 8, 128, 16)


@pytest.mark.parametrize("table, lens, error, name", [
    ([[0, 1]], [33], ValueError, "seq_lens"),              # 33 tokens do not fit 2 pages of 16
    ([[0, 1]], [-1], ValueError, "seq_lens"),
    ([[0, 1]], [5, 5], ValueError, "seq_lens"),             # one length per row
    ([[0, 1]], [[5]], ValueError, "seq_lens"),
    ([0, 1], [5], ValueError, "block_table"),               # rank
    ([[0.0, 1.0]], [5], TypeError, "block_table"),
    # a bad entry among those read is named by its row and column in block_table
    ([[0, 7]], [20], ValueError, re.escape("block_table[0, 1] (request 0 reads 2 pages for its 20 "
                                           "tokens): expected a page index in 0..3 (num_pages=4), "
                                           "got 7")),
    ([[-1, 0]], [20], ValueError, r"block_table\[0, 0\] .*got -1"),   # padding inside the length
    ([[0, 1], [2, -1]], [20, 20], ValueError, r"block_table\[1, 1\] \(request 1 reads 2 pages"),
])
def test_bad_block_tables(table, lens, error, name):
    with pytest.raises(error, match=name):
        PageTable.from_block_table(table, lens, 16, num_pages=4)


def test_num_pages_below_one_is_named_before_the_entries():
    """num_pages=0 (or less) under a table that reads pages is refused as itself, before any
    entry is checked (not as an entry outside an empty range); a pool of no pages suits a
    table that reads none, a negative one none."""
    for num_pages in (0, -3, np.int64(0)):
        message = re.escape(f"num_pages: expected an integer >= 1, got {int(num_pages)}")
        for table in ([[0, 1]], [[-1, 7]]):
            with pytest.raises(ValueError, match=f"^{message}$"):
                PageTable.from_block_table(table, [20], 16, num_pages=num_pages)
        with pytest.raises(ValueError, match=f"^{message}$"):
            PageTable.from_flashinfer([0, 1], [0], [3], 16, num_pages=num_pages)
    for table, lens in (([[-1]], [0]), (np.zeros((0, 2), int), [])):
        assert PageTable.from_block_table(table, lens, 16, num_pages=0).kv_indices.size == 0
        with pytest.raises(ValueError, match=r"^num_pages: expected an integer >= 0, got -1$"):
            PageTable.from_block_table(table, lens, 16, num_pages=-1)
    with pytest.raises(TypeError, match=r"^num_pages: expected an integer, got float 4\.0$"):
        PageTable.from_block_table([[0, 1]], [20], 16, num_pages=4.0)


def test_bad_contiguous():
    with pytest.raises(ValueError, match="seq_lens"):
        PageTable.contiguous([3, 9], 8)
    with pytest.raises(ValueError, match="max_len"):
        PageTable.contiguous([3, 9], 0)


# ---- problems ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, error, name", [
    (([4], 12, 8, 128, 16), ValueError, "num_qo_heads"),     # not a multiple of kv heads
    (([4], 8, 16, 128, 16), ValueError, "num_qo_heads"),
    (([4], 0, 1, 128, 16), ValueError, "num_qo_heads"),
    (([4], 8, 0, 128, 16), ValueError, "num_kv_heads"),
    (([4], 8.0, 8, 128, 16), TypeError, "num_qo_heads"),
    (([4], 8, 8, 80, 16), ValueError, "head_dim"),           # unsupported head_dim
    (([4], 8, 8, 512, 16), ValueError, "head_dim"),
    (([4], 8, 8, 128, 0), ValueError, "page_size"),
    (([-1], 8, 8, 128, 16), ValueError, "kv_lens"),
    (([[4]], 8, 8, 128, 16), ValueError, "kv_lens"),
    (([4.5], 8, 8, 128, 16), TypeError, "kv_lens"),
    (([4], 8, 8, 128, 16, "float32"), TypeError, "dtype"),    # unsupported dtype
    (([4], 8, 8, 128, 16, np.int8), TypeError, "dtype"),
])
def test_bad_problems(args, error, name):
    with pytest.raises(error, match=name):
        DecodeProblem(*args)


# ---- plans -------------------------------------------------------------------------------------

@pytest.fixture
def problem():
    return DecodeProblem(np.array([40, 0, 9]), 8, 2, 64, 16)


@pytest.mark.parametrize("make", [
    lambda p: plan_fixed_splits(p, 2, "splitmerge"),
    lambda p: plan_chunk_tokens(p, 8, "Fused"),
    lambda p: plan_from_chunk_counts(p, [1, 1, 1], None),
])
def test_bad_strategy(problem, make):
    with pytest.raises(ValueError, match="strategy"):
        make(problem)


@pytest.mark.parametrize("make, error, name", [
    (lambda p: plan_fixed_splits(p, 0), ValueError, "num_splits"),
    (lambda p: plan_fixed_splits(p, 2.0), TypeError, "num_splits"),
    (lambda p: plan_chunk_tokens(p, 0, "fused"), ValueError, "chunk_tokens"),
    (lambda p: plan_fixed_splits(p, 2, align=0), ValueError, "align"),
    (lambda p: plan_chunk_tokens(p, 4, "fused", align=-16), ValueError, "align"),
    (lambda p: plan_from_chunk_counts(p, [1, 1], "fused"), ValueError, "chunks_per_request"),
    (lambda p: plan_from_chunk_counts(p, [1.5, 1, 1], "fused"), TypeError, "chunks_per_request"),
    (lambda p: plan_fixed_splits(p, 3, "single"), ValueError, "strategy"),
    (lambda p: plan_fixed_splits(p.kv_lens, 3), TypeError, "problem"),
])
def test_bad_plan_arguments(problem, make, error, name):
    with pytest.raises(error, match=name):
        make(problem)


# ---- the host paths (reference and CPU executor) -----------------------------------------------

@pytest.fixture
def inputs(rng):
    return host_decode_inputs(rng, [20, 5])


def call_both(inputs, **changes):
    args = {**inputs, **changes}
    yield lambda: reference_decode(args["q"], args["k_cache"], args["v_cache"], args["page_table"])
    yield lambda: execute_plan_cpu(args["plan"], args["q"], args["k_cache"], args["v_cache"],
                                   args["page_table"])


@pytest.mark.parametrize("change, error, name", [
    (lambda x: dict(q=x["q"][0]), ValueError, "q"),                            # rank 2
    (lambda x: dict(q=x["q"][:1]), ValueError, "q"),                           # batch 1, table 2
    (lambda x: dict(q=x["q"].astype(np.int32)), TypeError, "q"),
    (lambda x: dict(q=x["q"].tolist()), TypeError, "q"),                        # not an array
    (lambda x: dict(q=x["q"][:, :7]), ValueError, "num_qo_heads|q: "),          # 7 % 2 != 0
    (lambda x: dict(k_cache=x["k_cache"][:, :8]), ValueError, "k_cache"),      # page size 8
    (lambda x: dict(k_cache=x["k_cache"][..., :32]), ValueError, "k_cache"),   # head_dim 32
    (lambda x: dict(k_cache=x["k_cache"][0]), ValueError, "k_cache"),          # rank 3
    (lambda x: dict(k_cache=x["k_cache"].astype(np.complex128)), TypeError, "k_cache"),
    (lambda x: dict(v_cache=x["v_cache"][:2]), ValueError, "v_cache"),        # misses page 2
    (lambda x: dict(v_cache=x["v_cache"].astype(np.float32)), TypeError, "v_cache"),
    (lambda x: dict(k_cache=x["k_cache"][:2], v_cache=x["v_cache"][:2]), ValueError,
     "k_cache, v_cache: the page table references page 2"),
    (lambda x: dict(page_table="pages"), TypeError, "page_table"),
])
def test_bad_host_inputs(inputs, change, error, name):
    for call in call_both(inputs, **change(inputs)):
        with pytest.raises(error, match=name):
            call()


def test_bad_sm_scale(inputs):
    for bad, error in ((0.0, ValueError), (-1.0, ValueError), (np.inf, ValueError), ("x", TypeError)):
        with pytest.raises(error, match="sm_scale"):
            reference_decode(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                             inputs["page_table"], sm_scale=bad)


def test_executor_checks_the_plan_matches(inputs):
    x = inputs
    other = PageTable.from_block_table([[2, 0], [1, 3]], [20, 6], 16)
    with pytest.raises(ValueError, match="page_table"):
        execute_plan_cpu(x["plan"], x["q"], x["k_cache"], x["v_cache"], other)
    mha_plan = plan_fixed_splits(DecodeProblem.from_page_table(x["page_table"], 8, 8, 64), 2)
    with pytest.raises(ValueError, match="k_cache"):          # the cache has 2 kv heads, not 8
        execute_plan_cpu(mha_plan, x["q"], x["k_cache"], x["v_cache"], x["page_table"])
    with pytest.raises(TypeError, match="plan"):
        execute_plan_cpu("plan", x["q"], x["k_cache"], x["v_cache"], x["page_table"])
    small_pages = PageTable.from_block_table([[2, 0, 1], [3, 0, 0]], [20, 5], 8)
    with pytest.raises(ValueError, match="page_size"):
        execute_plan_cpu(x["plan"], x["q"], x["k_cache"], x["v_cache"], small_pages)


@pytest.mark.parametrize("fake", [FakeDeviceArray, FakeCupyArray])
def test_hand_built_plan_refuses_device_arrays(problem, fake):
    with pytest.raises(TypeError, match="chunk_start"):
        Plan(problem, "single", [0, 1, 2], fake(np.array([0, 0, 0])), [40, 0, 9], [0, 1, 2, 3])


def test_wrapper_options_are_checked():
    from splitkv.runtime.experiments import PDL_TRIGGERS, DecodeExperiments
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    for option in ("pdl", "use_clusters"):
        for bad in ("sometimes", "early", 1):
            with pytest.raises(TypeError, match=option):
                BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", **{option: bad})
        for value in (None, True, False):
            w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", **{option: value})
            assert getattr(w, option) is value
    with pytest.raises(TypeError, match="experiments"):
        BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", experiments={"stages": 2})
    for trigger in PDL_TRIGGERS:
        assert DecodeExperiments(pdl_trigger=trigger).pdl_trigger == trigger
    for bad, error, name in (({"pdl_trigger": "sometimes"}, ValueError, "pdl_trigger"),
                             ({"stages": 1}, ValueError, "stages"),
                             ({"max_registers": -1}, ValueError, "max_registers"),
                             ({"pdl_spread": "yes"}, TypeError, "pdl_spread")):
        with pytest.raises(error, match=name):
            DecodeExperiments(**bad)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16",
                           experiments=DecodeExperiments(stages=2, max_registers=168))
    assert (w.base_build.stages, w.base_build.max_registers) == (2, 168)


def test_graph_stable_capacity_is_checked():
    """use_cuda_graph needs its capacity; a capacity without it, or one that cannot hold a batch,
    is refused, each naming the argument (no GPU needed)."""
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    with pytest.raises(ValueError, match="max_num_pages"):
        BatchDecodeWrapper(8, 2, 128, 16, use_cuda_graph=True, max_batch_size=4)
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchDecodeWrapper(8, 2, 128, 16, use_cuda_graph=True, max_num_pages=100)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        BatchDecodeWrapper(8, 2, 128, 16, max_batch_size=4)
    with pytest.raises(ValueError, match="max_chunks"):
        BatchDecodeWrapper(8, 2, 128, 16, use_cuda_graph=True, max_batch_size=4,
                           max_num_pages=100, max_chunks=3)
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchDecodeWrapper(8, 2, 128, 16, use_cuda_graph=True, max_batch_size=0,
                           max_num_pages=100)
    with pytest.raises(TypeError, match="use_cuda_graph"):
        BatchDecodeWrapper(8, 2, 128, 16, use_cuda_graph="yes")
    w = BatchDecodeWrapper(8, 2, 128, 16, use_cuda_graph=True, max_batch_size=4,
                           max_num_pages=100, max_chunks=32)
    assert w.max_chunks == 32 and BatchDecodeWrapper(8, 2, 128, 16).max_chunks is None


def test_the_soft_cap_reaches_the_kernels_in_base_2_as_a_float32():
    """plan(logits_soft_cap=) as DecodeParams holds it: cap x log2(e) as a float32 (the scores
    are base 2), 0 for none; a cap float32 cannot hold is named, not wrapped to inf or 0."""
    from splitkv.runtime.params import soft_cap_log2 as to_kernel

    assert to_kernel(None) == 0.0 and to_kernel(0) == 0.0
    assert to_kernel(30.0) == float(np.float32(30.0 * 1.4426950408889634))
    for bad, kind in ((-1.0, ValueError), (float("nan"), ValueError), ("30", TypeError),
                      (True, TypeError), (1e39, ValueError), (1e-46, ValueError),
                      (1e-39, ValueError)):     # cap x log2(e) a float32 subnormal
        with pytest.raises(kind, match="logits_soft_cap"):
            to_kernel(bad)


def test_the_warps_experiment_is_checked_and_reaches_the_variant():
    from splitkv.runtime.experiments import DecodeExperiments
    from splitkv.runtime.records import record_pages_needed
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    w = BatchDecodeWrapper(8, 2, 128, 16, experiments=DecodeExperiments(warps=8))
    assert w.base_build.num_warps == 8 and w.base_build.tile_tokens == 128
    assert BatchDecodeWrapper(8, 2, 128, 16).base_build.num_warps == 4
    assert record_pages_needed(16, 3, 128) == 24 and record_pages_needed(16, 3) == 12
    with pytest.raises(ValueError, match="warps: expected 4 or 8"):
        DecodeExperiments(warps=6)
    with pytest.raises(ValueError, match="warps: expected an integer >= 4"):
        DecodeExperiments(warps=0)
    for bad in (True, 8.0):
        with pytest.raises(TypeError, match="warps: expected an integer"):
            DecodeExperiments(warps=bad)


def test_max_q_len_is_a_checked_graph_stable_capacity():
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    graph = dict(use_cuda_graph=True, max_batch_size=4, max_num_pages=100)
    # CTAs a kv head for max_q_len x the group rows, 64 a CTA
    assert BatchDecodeWrapper(32, 8, 128, 16, max_q_len=16, **graph).ctas_per_kv_head == 1
    assert BatchDecodeWrapper(64, 2, 128, 16, max_q_len=4, **graph).ctas_per_kv_head == 2
    assert BatchDecodeWrapper(64, 2, 128, 16, max_q_len=16, **graph).ctas_per_kv_head == 8
    assert BatchDecodeWrapper(32, 8, 128, 16, **graph).ctas_per_kv_head == 1
    with pytest.raises(ValueError, match="max_q_len: a capacity is for a graph-stable"):
        BatchDecodeWrapper(32, 8, 128, 16, max_q_len=4)
    for bad, kind in ((0, ValueError), (17, ValueError), (2.0, TypeError), (True, TypeError),
                      ("4", TypeError)):
        with pytest.raises(kind, match="max_q_len"):
            BatchDecodeWrapper(32, 8, 128, 16, max_q_len=bad, **graph)


def test_host_integer_arrays_refuse_strings_and_bools_among_integers():
    """NumPy reads [0, True, 2] as integers and 'abc' as a 0-d array: both are mistakes, named
    as such."""
    from splitkv.core import validation as V

    with pytest.raises(TypeError, match="qo_indptr: expected integers, got a bool among them"):
        V.host_int_array("qo_indptr", [0, True, 2], 1)
    with pytest.raises(TypeError, match="seq_lens: expected integers, got a bool"):
        V.host_int_array("seq_lens", [[1, 2], [np.True_, 3]], 2)
    with pytest.raises(TypeError, match="kv_indptr: expected a 1-d integer array, got str"):
        V.host_int_array("kv_indptr", "abc", 1)
    assert V.host_int_array("kv_indptr", (0, 3, 5), 1).tolist() == [0, 3, 5]


def test_the_pow2_pages_experiment_refuses_other_page_sizes():
    from splitkv.runtime.experiments import DecodeExperiments
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    with pytest.raises(ValueError, match="^experiments: pow2_pages needs a page_size"):
        BatchDecodeWrapper(32, 8, 128, 12, "bfloat16",
                           experiments=DecodeExperiments(pow2_pages=True))
    with pytest.raises(TypeError, match="^pow2_pages: expected None, True or False"):
        DecodeExperiments(pow2_pages=1)
    assert BatchDecodeWrapper(32, 8, 128, 1, "bfloat16", experiments=DecodeExperiments(
        pow2_pages=True)).base_build.pow2_pages == 1


def test_the_rows_per_cta_experiment_takes_16_32_or_64_on_per_shape_wrappers():
    from splitkv.core.geometry import ctas_per_kv_head
    from splitkv.runtime.experiments import DecodeExperiments
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    for bad in (8, 48, True, "16"):
        with pytest.raises(ValueError, match="^rows_per_cta: expected 16, 32 or 64"):
            DecodeExperiments(rows_per_cta=bad)
    with pytest.raises(ValueError, match="^experiments: rows_per_cta is for per-shape"):
        BatchDecodeWrapper(64, 2, 128, 16, "bfloat16", use_cuda_graph=True, max_batch_size=2,
                           max_num_pages=8, experiments=DecodeExperiments(rows_per_cta=16))
    assert ctas_per_kv_head(32) == 1 and ctas_per_kv_head(32, 16) == 2
    assert ctas_per_kv_head(33, 32) == 2 and ctas_per_kv_head(128) == 2


def test_tile_per_warp_is_16_or_32():
    from splitkv.runtime.experiments import DecodeExperiments

    for bad in (8, 64, True):
        with pytest.raises(ValueError, match="tile_per_warp: expected 16 or 32"):
            DecodeExperiments(tile_per_warp=bad)
    assert DecodeExperiments(tile_per_warp=32).tile_per_warp == 32


def test_dim_split_is_1_or_2_and_16_bit_only():
    from splitkv.runtime.experiments import DecodeExperiments
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    for bad in (3, 0, True):
        with pytest.raises(ValueError, match="dim_split: expected 1 or 2"):
            DecodeExperiments(dim_split=bad)
    w = BatchDecodeWrapper(16, 8, 256, 16, "bfloat16", experiments=DecodeExperiments(dim_split=2))
    assert (w.base_build.num_warps, w.base_build.dim_split, w.base_build.tile_tokens) == (8, 2, 64)
    with pytest.raises(ValueError, match="^dim_split: 16-bit K/V"):
        BatchDecodeWrapper(16, 8, 256, 16, "bfloat16", kv_dtype="float8_e4m3fn",
                           experiments=DecodeExperiments(dim_split=2))


def test_compact_merge_is_an_option():
    from splitkv.runtime.experiments import DecodeExperiments

    with pytest.raises(TypeError, match="compact_merge: expected None, True or False"):
        DecodeExperiments(compact_merge=1)
    assert DecodeExperiments(compact_merge=True).compact_merge is True


def test_a_plan_run_on_another_batch_says_how_it_differs(rng):
    inp = host_decode_inputs(rng, [20, 9])
    q, k, v, plan = inp["q"], inp["k_cache"], inp["v_cache"], inp["plan"]
    longer = PageTable.from_block_table([[2, 0], [1, 3]], [20, 10], 16, num_pages=4)
    with pytest.raises(ValueError, match=r"page_table: .*\(request 1: 10 tokens, the plan's 9\)"):
        execute_plan_cpu(plan, q, k, v, longer)
    one = PageTable.from_block_table([[2, 0]], [20], 16, num_pages=4)
    with pytest.raises(ValueError, match="page_table: a batch of 1, the plan was made for a "
                                         "batch of 2"):
        execute_plan_cpu(plan, q[:1], k, v, one)


def test_host_paths_name_the_arrays_whose_head_counts_disagree(rng):
    inp = host_decode_inputs(rng, [20, 9])
    q3 = rng.standard_normal((2, 3, 64))                   # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match=r"q: its 3 query heads \(axis 1\) are not a multiple "
                                         r"of the 2 kv heads of k_cache"):
        reference_decode(q3, inp["k_cache"], inp["v_cache"], inp["page_table"])
    k0 = np.zeros((4, 16, 0, 64))                           # no kv heads at all
    with pytest.raises(ValueError, match=r"k_cache: expected at least one head \(axis 2\), got "
                                         r"shape \(4, 16, 0, 64\)"):
        reference_decode(inp["q"], k0, k0, inp["page_table"])


def test_q_may_be_a_fused_qkv_slice_but_nothing_else():
    """run()'s q is read in place: contiguous, or a slice of a fused QKV projection (heads
    head_dim apart, rows further); other views are named, before any launch."""
    from types import SimpleNamespace

    from splitkv.core import validation as V

    def q(strides, ptr=0, rows=4):
        return SimpleNamespace(shape=(rows, 8, 64), strides=strides, ptr=ptr)

    assert V.check_query_strides(q((512, 64, 1)), 8, 64) == 512
    assert V.check_query_strides(q(((8 + 2 * 2) * 64, 64, 1)), 8, 64) == 768   # qkv[:, :512]
    assert V.check_query_strides(q((0, 64, 1), rows=1), 8, 64) == 512   # one row: any stride
    assert V.check_query_strides(q((0, 0, 0), rows=0), 8, 64) == 512   # empty: CuPy's zero strides
    for strides in ((64, 256, 1), (512, 64, 2), (256, 64, 1), (-512, 64, 1)):
        with pytest.raises(ValueError, match=r"q: expected \[rows, num_qo_heads, head_dim\]"):
            V.check_query_strides(q(strides), 8, 64)
    with pytest.raises(ValueError, match="q: expected a 4-byte aligned start"):
        V.check_query_strides(q((769, 64, 1)), 8, 64)
    with pytest.raises(ValueError, match="q: expected a 4-byte aligned start"):
        V.check_query_strides(q((768, 64, 1), ptr=2), 8, 64)


def test_head_dim_96_plans_and_fp8_at_96_is_refused_by_name(rng):
    """Head dim 96 (Phi-3) runs 16-bit K/V: a wrapper of it is made and the host planner and CPU
    executor take it; fp8 K/V has no build at 96 and every entry point that would make one says
    so by name, before any GPU work."""
    from splitkv.core.builds import Build
    from splitkv.runtime.precompile_jobs import Configuration
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    BatchDecodeWrapper(32, 8, 96, 16, "bfloat16")
    table = PageTable.contiguous([700, 5, 0], 704)
    q = rng.standard_normal((3, 32, 96))
    k, v = (rng.standard_normal((3, 704, 8, 96)) for _ in range(2))
    plan = plan_chunk_tokens(DecodeProblem.from_page_table(table, 32, 8, 96), 256, "split_merge")
    out, _ = execute_plan_cpu(plan, q, k, v, table)
    np.testing.assert_allclose(out, reference_decode(q, k, v, table)[0], atol=1e-9)
    for make in (lambda: BatchDecodeWrapper(32, 8, 96, 16, "bfloat16", kv_dtype="fp8_e4m3"),
                 lambda: Configuration(32, 8, 96, 16, "bfloat16", kv_dtype="float8_e5m2")):
        with pytest.raises(ValueError, match=r"kv_dtype: fp8 K/V \('float8_e\w+'\) is not "
                                             r"supported at head_dim 96"):
            make()
    with pytest.raises(ValueError, match="kv_dtype: fp8 K/V has no build at head_dim 96"):
        Build("bfloat16", 96, 1, kv_dtype="float8_e4m3fn")
