"""Plans: how requests are cut into chunks, and what a plan promises about its arrays."""

import numpy as np
import pytest

from splitkv import DecodeProblem, Plan, plan_chunk_tokens, plan_fixed_splits, plan_from_chunk_counts


def make_problem(kv_lens, hq=8, hk=2, page_size=16):
    return DecodeProblem(np.asarray(kv_lens), hq, hk, 64, page_size)


def assert_tiles(plan: Plan):
    """The invariants every plan keeps: chunks sorted by request, contiguous, covering each
    request exactly, at least one per request, merge_indptr consistent with chunk_request."""
    lens = plan.problem.kv_lens
    counts = np.diff(plan.merge_indptr)
    assert plan.merge_indptr[0] == 0 and plan.merge_indptr[-1] == plan.num_chunks
    assert np.all(counts >= 1)
    np.testing.assert_array_equal(plan.chunk_request, np.repeat(np.arange(lens.size), counts))
    for b in range(lens.size):
        lo, hi = plan.merge_indptr[b], plan.merge_indptr[b + 1]
        starts, ends = plan.chunk_start[lo:hi], plan.chunk_end[lo:hi]
        assert starts[0] == 0 and ends[-1] == lens[b]
        np.testing.assert_array_equal(starts[1:], ends[:-1])
        if lens[b]:
            assert np.all(ends > starts), "no empty chunk in a non-empty request"


LENS = [1, 15, 16, 17, 100, 0, 1000, 3]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_fixed_splits(num_splits, align):
    plan = plan_fixed_splits(make_problem(LENS), num_splits, align=align)
    assert_tiles(plan)
    lens = np.array(LENS)
    want = np.clip(num_splits, 1, np.maximum(1, -(-lens // align)))
    np.testing.assert_array_equal(plan.chunks_per_request, want)
    assert plan.num_splits == want.max()
    assert plan.strategy == ("single" if num_splits == 1 else "split_merge")


@pytest.mark.parametrize("align", [1, 8, 16])
def test_aligned_boundaries(align):
    plan = plan_fixed_splits(make_problem(LENS), 5, "fused", align=align)
    lens = plan.problem.kv_lens[plan.chunk_request]
    inner = plan.chunk_end < lens
    assert np.all(plan.chunk_end[inner] % align == 0)


def test_near_equal_chunks():
    plan = plan_fixed_splits(make_problem([1000]), 7)
    sizes = plan.chunk_end - plan.chunk_start
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 1000


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 64, 5000])
def test_chunk_tokens(chunk_tokens):
    plan = plan_chunk_tokens(make_problem(LENS), chunk_tokens, "split_merge")
    assert_tiles(plan)
    sizes = plan.chunk_end - plan.chunk_start
    assert sizes.max() <= chunk_tokens
    lens = np.array(LENS)
    np.testing.assert_array_equal(plan.chunks_per_request, np.maximum(1, -(-lens // chunk_tokens)))


def test_chunk_tokens_single_never_splits():
    plan = plan_chunk_tokens(make_problem(LENS), 4, "single")
    assert plan.num_chunks == len(LENS) and plan.num_splits == 1


def test_chunk_counts_are_clipped_to_what_a_request_can_hold():
    plan = plan_from_chunk_counts(make_problem([3, 0, 50]), [10, 4, 1], "split_merge")
    np.testing.assert_array_equal(plan.chunks_per_request, [3, 1, 1])
    assert_tiles(plan)


@pytest.mark.parametrize("counts", [[10, 4, 0], [1, -1, 1], [0, 0, 0]])
def test_chunk_counts_below_one_are_refused(counts):
    # not raised to 1 silently: every request has at least one chunk, so a count of 0 is a bug
    with pytest.raises(ValueError, match="chunks_per_request: request"):
        plan_from_chunk_counts(make_problem([3, 0, 50]), counts, "split_merge")


def test_zero_length_request_has_one_empty_chunk():
    plan = plan_fixed_splits(make_problem([0, 0]), 4)
    assert plan.num_chunks == 2 and plan.num_splits == 1 and not plan.needs_merge
    assert np.all(plan.chunk_start == 0) and np.all(plan.chunk_end == 0)


def test_empty_batch_plan():
    plan = plan_fixed_splits(make_problem(np.zeros(0, dtype=np.int64)), 4)
    assert plan.num_chunks == 0 and plan.num_splits == 0 and plan.num_work_items == 0
    np.testing.assert_array_equal(plan.merge_indptr, [0])


def test_work_items_and_merge_need():
    plan = plan_fixed_splits(make_problem([64, 64], hq=32, hk=8), 4, "fused")
    assert plan.num_chunks == 8 and plan.num_work_items == 8 * 8 and plan.needs_merge


def test_single_rejects_a_split_request():
    p = make_problem([100, 1])
    with pytest.raises(ValueError, match="strategy"):
        plan_fixed_splits(p, 2, "single")
    with pytest.raises(ValueError, match="strategy"):
        plan_from_chunk_counts(p, [2, 1], "single")
    with pytest.raises(ValueError, match="strategy"):
        Plan(p, "single", [0, 0, 1], [0, 50, 0], [50, 100, 1], [0, 2, 3])
    # A request too short to split is fine under 'single'.
    assert plan_fixed_splits(make_problem([1, 1]), 2, "single").num_splits == 1


def test_repr_shows_strategy_splits_and_problem():
    plan = plan_fixed_splits(make_problem([100, 40]), 4, "fused")
    for text in (repr(plan), str(plan)):
        assert "strategy=fused" in text and "num_splits=4" in text
        assert "work_items=16" in text and "DecodeProblem(" in text and "predicted=n/a" in text
        assert "merge=ticket" in text
    assert "predicted=12.5 us" in repr(plan.with_prediction(12.5))


def test_summary():
    s = plan_fixed_splits(make_problem([100, 40]), 4, "fused").summary()
    assert s == {"strategy": "fused", "num_splits": 4, "num_chunks": 8, "num_work_items": 16,
                 "chunk_tokens_max": 25, "chunk_tokens_min": 10, "merge": "ticket",
                 "cluster_size": 0, "launch_order": "longest_chunks",
                 "workspace_bytes": 8 * 8 * 65 * 4, "predicted_us": None}


def test_workspace_bytes_count_the_partials_a_plan_merges_in_memory():
    """Partials (num_chunks x heads x (head_dim + 1) floats) for merge-kernel and ticket
    merges; nothing for unsplit plans or cluster merges (shared memory)."""
    problem = make_problem([100, 40])
    assert plan_fixed_splits(problem, 1, "single").workspace_bytes == 0
    assert plan_fixed_splits(problem, 3, "split_merge").workspace_bytes == 6 * 8 * 65 * 4
    fused = plan_fixed_splits(make_problem([1024, 1024]), 2, "fused")
    clustered = fused.with_execution(clusters=True)
    assert clustered.merge == "cluster" and clustered.workspace_bytes == 0
    assert fused.workspace_bytes == 4 * 8 * 65 * 4


def test_with_prediction_keeps_the_decomposition():
    plan = plan_fixed_splits(make_problem(LENS), 3)
    pred = plan.with_prediction(3)
    assert pred.predicted_us == 3.0 and isinstance(pred.predicted_us, float)
    assert pred.problem is plan.problem and pred.strategy == plan.strategy
    for name in ("chunk_request", "chunk_start", "chunk_end", "merge_indptr"):
        np.testing.assert_array_equal(getattr(pred, name), getattr(plan, name))


def test_plan_arrays_are_frozen_int32():
    plan = plan_fixed_splits(make_problem(LENS), 3)
    for name in ("chunk_request", "chunk_start", "chunk_end", "merge_indptr"):
        arr = getattr(plan, name)
        assert arr.dtype == np.int32 and arr.flags.c_contiguous
        with pytest.raises(ValueError):
            arr[0] = 1


def test_hand_built_plan():
    p = make_problem([20, 0, 5])
    plan = Plan(p, "split_merge", [0, 0, 0, 1, 2], [0, 1, 16, 0, 0], [1, 16, 20, 0, 5],
                [0, 3, 4, 5])
    assert_tiles(plan)
    np.testing.assert_array_equal(plan.chunks_per_request, [3, 1, 1])
    assert plan.num_splits == 3


@pytest.mark.parametrize("arrays, name", [
    (([0, 0, 1, 2], [0, 10, 0, 0], [10, 20, 0, 5], [0, 2, 3]), "merge_indptr"),   # too short
    (([0, 0, 1, 2], [0, 10, 0, 0], [10, 20, 0, 5], [0, 2, 2, 4]), "merge_indptr"),  # empty count
    (([0, 0, 1, 2], [0, 10, 0, 0], [10, 20, 0, 5], [0, 2, 3, 5]), "merge_indptr"),  # past the end
    (([0, 1, 0, 2], [0, 0, 10, 0], [10, 0, 20, 5], [0, 2, 3, 4]), "chunk_request"),  # unsorted
    (([0, 0, 1, 2], [0, 12, 0, 0], [10, 20, 0, 5], [0, 2, 3, 4]), "chunk_start"),   # gap
    (([0, 0, 1, 2], [0, 8, 0, 0], [10, 20, 0, 5], [0, 2, 3, 4]), "chunk_start"),    # overlap
    (([0, 0, 1, 2], [1, 10, 0, 0], [10, 20, 0, 5], [0, 2, 3, 4]), "chunk_start"),   # not at 0
    (([0, 0, 1, 2], [0, 10, 0, 0], [10, 19, 0, 5], [0, 2, 3, 4]), "chunk_end"),     # short
    (([0, 0, 1, 2], [0, 10, 0, 0], [10, 21, 0, 5], [0, 2, 3, 4]), "chunk_end"),     # past len
    (([0, 0, 1, 2], [0, 10, 0, 0], [10, 20, 0], [0, 2, 3, 4]), "chunk_end"),        # size
    (([0, 0, 1, 2], [0, 10, 0, 3], [10, 20, 0, 2], [0, 2, 3, 4]), "chunk_end"),     # end < start
])
def test_inconsistent_hand_built_plans_are_refused(arrays, name):
    with pytest.raises(ValueError, match=name):
        Plan(make_problem([20, 0, 5]), "split_merge", *arrays)


def test_cluster_variant_names_and_shared_memory():
    import pytest

    from splitkv.runtime.kernel_source import KernelBuild

    plain = KernelBuild("bfloat16", 128, 1)
    clustered = KernelBuild("bfloat16", 128, 1, cluster=8)
    assert clustered.name == plain.name + "_c8" and clustered.defines["CLUSTER"] == 8
    # d128: 3 stages of 64 tokens of K and V, and the record's 24 page ids
    assert plain.shared_bytes == clustered.shared_bytes == 3 * 64 * 128 * 2 * 2 + 24 * 4
    # d256 with 64 rows: the combine buffers (4 warps x 16 rows x (256 + 2) floats) and the
    # CTA's partial state (64 rows x (256 + 1) floats) outgrow the pipeline
    assert KernelBuild("float16", 256, 4, cluster=2).shared_bytes == 4 * 16 * 258 * 4 + 64 * 257 * 4
    with pytest.raises(ValueError, match="cluster"):
        KernelBuild("bfloat16", 128, 1, cluster=16)


def test_chunk_records_carry_each_chunks_first_pages():
    from splitkv.core.geometry import RECORD_PAGES
    from splitkv.core.plan import plan_from_chunk_counts
    from splitkv.core.problem import DecodeProblem, PageTable
    from splitkv.runtime.records import first_pages, pages_fit_record

    lens = [100, 0, 2000]
    rng = np.random.default_rng(0)
    pages = [rng.permutation(1000)[:-(-n // 16)] for n in lens]
    last = [n - 16 * (p.size - 1) if n else 0 for n, p in zip(lens, pages)]
    table = PageTable.from_flashinfer(np.cumsum([0] + [p.size for p in pages]),
                                      np.concatenate(pages), last, 16)
    problem = DecodeProblem.from_page_table(table, 8, 2, 128)
    plan = plan_from_chunk_counts(problem, [1, 1, 4], "fused", align=64)
    got = first_pages(table, plan.chunk_request, plan.chunk_start)
    assert got.shape == (plan.num_chunks, RECORD_PAGES)
    for c in range(plan.num_chunks):
        req, start = plan.chunk_request[c], plan.chunk_start[c]
        own = pages[req][start // 16:]
        n = min(own.size, RECORD_PAGES)
        np.testing.assert_array_equal(got[c, :n], own[:n])
    assert pages_fit_record(plan, 16, stages=3)
    assert not pages_fit_record(plan, 4, stages=3)      # 3 tiles span 48 pages of 4 tokens
    unaligned = plan_from_chunk_counts(problem, [1, 1, 3], "fused", align=1)
    assert np.any(unaligned.chunk_start % 16) and not pages_fit_record(unaligned, 16, stages=3)


def test_chunk_records_in_launch_order_name_their_plan_chunk():
    """Record r holds chunk order[r] whole (request, tokens, page-table start, the request's
    chunk range, its first pages) and that chunk's plan index, where its partials go."""
    from splitkv.core.execution import launch_order
    from splitkv.core.plan import plan_chunk_tokens
    from splitkv.core.problem import DecodeProblem, PageTable
    from splitkv.runtime.kernel_abi import CHUNK_RECORD, RECORD_HAS_PAGES, RECORD_TICKET_MERGE
    from splitkv.runtime.records import chunk_records, first_pages

    lens = [300, 0, 2000, 64]
    rng = np.random.default_rng(1)
    pages = [rng.permutation(1000)[:-(-n // 16)] for n in lens]
    last = [n - 16 * (p.size - 1) if n else 0 for n, p in zip(lens, pages)]
    table = PageTable.from_flashinfer(np.cumsum([0] + [p.size for p in pages]),
                                      np.concatenate(pages), last, 16)
    plan = plan_chunk_tokens(DecodeProblem.from_page_table(table, 8, 2, 128), 512, "fused",
                             align=64)
    order = launch_order(plan.chunk_request, plan.chunk_end - plan.chunk_start, lens)
    assert not np.array_equal(order, np.arange(plan.num_chunks))        # it does reorder
    records = chunk_records(plan, table, order, 4)
    assert records.dtype == CHUNK_RECORD and records.shape == (plan.num_chunks,)
    natural = chunk_records(plan, table, np.arange(plan.num_chunks), 4)
    np.testing.assert_array_equal(records, natural[order])               # rows move whole
    np.testing.assert_array_equal(records["plan_index"], order)
    for r, c in enumerate(order):
        b = plan.chunk_request[c]
        rec = records[r]
        assert (rec["request"], rec["token_begin"], rec["token_end"], rec["page_table_begin"],
                rec["chunk_begin"], rec["chunk_end"]) == (
            b, plan.chunk_start[c], plan.chunk_end[c], table.kv_indptr[b], plan.merge_indptr[b],
            plan.merge_indptr[b + 1])
    np.testing.assert_array_equal(
        records["first_pages"][:, :4],
        first_pages(table, plan.chunk_request[order], plan.chunk_start[order], 4))
    assert not records["first_pages"][:, 4:].any()                         # only what was asked
    no_pages = chunk_records(plan, table, order, 0)
    assert not no_pages["first_pages"].any()
    # flags: the plan merges by ticket (built without clusters); page ids only where written
    assert (records["flags"] == RECORD_TICKET_MERGE | RECORD_HAS_PAGES).all()
    assert (no_pages["flags"] == RECORD_TICKET_MERGE).all()
    split_merge = chunk_records(plan_chunk_tokens(plan.problem, 512, "split_merge", align=64),
                                table, order, 0)
    assert not split_merge["flags"].any()


def test_idle_records_are_request_minus_one():
    from splitkv.runtime.records import idle_records

    idle = idle_records(3)
    assert (idle["request"] == -1).all() and not idle["flags"].any() and idle.size == 3
