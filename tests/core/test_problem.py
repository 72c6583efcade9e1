"""PageTable (the three ways to build one agree) and DecodeProblem."""

import numpy as np
import pytest

from splitkv import DecodeProblem, PageTable


def assert_same_table(a: PageTable, b: PageTable):
    assert a.page_size == b.page_size
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_block_table_flashinfer_and_contiguous_agree():
    # Contiguous cache [3, 20, ...] = one page of 20 tokens per request.
    lens = [20, 0, 7]
    contiguous = PageTable.contiguous(lens, 20)
    by_blocks = PageTable.from_block_table([[0], [1], [2]], lens, 20)
    by_flashinfer = PageTable.from_flashinfer([0, 1, 1, 2], [0, 2], [20, 0, 7], 20)
    assert_same_table(contiguous, by_blocks)
    assert_same_table(contiguous, by_flashinfer)


def test_block_table_and_flashinfer_agree_on_scattered_pages():
    block_table = np.array([[7, 2, 9, -1], [4, -1, -1, -1], [0, 0, 0, 0], [3, 1, 5, 8]])
    seq_lens = np.array([33, 16, 0, 49])
    a = PageTable.from_block_table(block_table, seq_lens, 16, num_pages=10)
    b = PageTable.from_flashinfer([0, 3, 4, 4, 8], [7, 2, 9, 4, 3, 1, 5, 8], [1, 16, 0, 1], 16,
                                  num_pages=10)
    assert_same_table(a, b)
    np.testing.assert_array_equal(a.kv_lens, seq_lens)
    assert a.batch_size == 4


def test_direct_construction_equals_from_flashinfer():
    args = ([0, 2, 3], [5, 1, 0], [3, 16], 16)
    assert_same_table(PageTable(*args), PageTable.from_flashinfer(*args))


def test_block_table_padding_beyond_the_length_is_never_read():
    lens = [17, 1]
    a = PageTable.from_block_table([[2, 0, -5, 99], [1, -1, -1, -1]], lens, 16, num_pages=3)
    b = PageTable.from_block_table([[2, 0, 0, 0], [1, 0, 0, 0]], lens, 16, num_pages=3)
    assert_same_table(a, b)


def test_plans_take_a_block_table_padded_with_minus_one():
    """vLLM pads a row past its length with -1 (or stale ids): what plan(block_table=...) reads
    through from_layout is the table of the entries inside the lengths only."""
    padded = np.array([[2, 0, -1, -1], [1, -1, -1, -1], [-1, -1, -1, -1]], dtype=np.int32)
    lens = np.array([20, 3, 0])
    table = PageTable.from_layout(None, 16, block_table=padded, seq_lens=lens)
    assert table.kv_indices.tolist() == [2, 0, 1]
    assert table.kv_lens.tolist() == [20, 3, 0]


def test_token_slots_follow_the_pages():
    pt = PageTable.from_block_table([[3, 1]], [5], 4)
    np.testing.assert_array_equal(pt.token_slots(0), [12, 13, 14, 15, 4])


@pytest.mark.parametrize("length, pages, last", [(1, 1, 1), (15, 1, 15), (16, 1, 16), (17, 2, 1),
                                                  (32, 2, 16), (0, 0, 0)])
def test_last_page_length(length, pages, last):
    pt = PageTable.from_block_table(np.arange(3)[None], [length], 16)
    assert pt.kv_indptr[-1] == pages and pt.kv_last_page_len[0] == last
    assert pt.kv_lens[0] == length


def test_empty_batch():
    for pt in (PageTable.from_flashinfer([0], [], [], 16),
               PageTable.from_block_table(np.zeros((0, 4), dtype=np.int64), [], 16),
               PageTable.contiguous(np.zeros(0, dtype=np.int64), 8)):
        assert pt.batch_size == 0 and pt.kv_lens.shape == (0,)


def test_tables_are_frozen_and_do_not_freeze_the_callers_arrays():
    indptr = np.array([0, 1, 2])
    indices = np.array([0, 1])
    last = np.array([4, 4])
    pt = PageTable(indptr, indices, last, 16)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens"):
        with pytest.raises(ValueError):
            getattr(pt, name)[0] = 1
    indices[0] = 1                    # the caller's array is still theirs, and copied
    assert pt.kv_indices[0] == 0
    with pytest.raises(AttributeError):
        pt.page_size = 8


def test_tables_never_share_the_callers_arrays():
    """A table copies what the caller holds (and nothing it converted itself), so later writes
    to the caller's arrays never reach a plan."""
    for dtype in (np.int32, np.int64):
        given = [np.array(a, dtype) for a in ([0, 1, 2], [0, 1], [4, 4])]
        pt = PageTable(*given, 16)
        for array, name in zip(given, ("kv_indptr", "kv_indices", "kv_last_page_len")):
            assert array.flags.writeable and not np.shares_memory(array, getattr(pt, name))
    block, lens = np.array([[3, 1]]), np.array([20])
    pt = PageTable.from_block_table(block, lens, 16)
    block[0, 0], lens[0] = 9, 5
    assert pt.kv_indices.tolist() == [3, 1] and pt.kv_lens.tolist() == [20]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
@pytest.mark.parametrize("layout", ["rows", "columns", "strided", "lists"])
def test_block_tables_of_any_layout_and_dtype_read_the_entries_inside_the_lengths(dtype, layout):
    lens = np.array([33, 0, 16, 1, 70])
    table = np.random.default_rng(0).integers(0, 50, (5, 6)).astype(dtype)
    wanted = [int(table[b, i]) for b, n in enumerate(lens) for i in range(-(-n // 16))]
    wide = np.zeros((5, 12), dtype)
    wide[:, ::2] = table
    given = {"rows": table, "columns": np.asfortranarray(table), "strided": wide[:, ::2],
             "lists": table.tolist()}[layout]
    pt = PageTable.from_block_table(given, lens, 16, num_pages=50)
    assert pt.kv_indices.dtype == np.int64 and pt.kv_indices.tolist() == wanted
    assert_same_table(pt, PageTable.from_flashinfer(pt.kv_indptr.tolist(), wanted,
                                                    [1, 0, 16, 1, 6], 16))


def test_any_integer_dtype_is_accepted():
    a = PageTable.from_flashinfer(np.array([0, 1], np.int32), np.array([2], np.uint8),
                                  np.array([3], np.int16), 4)
    assert a.kv_indices.dtype == np.int64 and a.kv_lens[0] == 3


def test_decode_problem_properties():
    p = DecodeProblem(np.array([10, 0, 300]), 32, 8, 128, 16, "float16")
    assert p.batch_size == 3 and p.group_size == 4 and p.total_tokens == 310
    assert p.kv_bytes == 310 * 8 * 128 * 2 * 2
    assert "heads=32/8" in repr(p) and "[10, 0, 300]" in repr(p) and "float16" in repr(p)
    with pytest.raises(ValueError):
        p.kv_lens[0] = 1


def test_decode_problem_from_page_table():
    pt = PageTable.from_block_table([[0, 1], [2, 3]], [20, 3], 16)
    p = DecodeProblem.from_page_table(pt, 10, 2, 64, dtype="bfloat16")
    np.testing.assert_array_equal(p.kv_lens, [20, 3])
    assert (p.page_size, p.group_size, p.dtype, p.head_dim) == (16, 5, "bfloat16", 64)


def test_decode_problem_repr_summarises_big_batches():
    p = DecodeProblem(np.arange(1, 101), 8, 8, 64, 16)
    assert "100 requests" in repr(p) and "1..100" in repr(p)


@pytest.mark.parametrize("alias, canon", [("fp16", "float16"), ("bf16", "bfloat16"),
                                          (np.float16, "float16"), ("half", "float16")])
def test_dtype_aliases(alias, canon):
    assert DecodeProblem([4], 8, 8, 64, 16, alias).dtype == canon


def test_empty_decode_problem():
    p = DecodeProblem(np.zeros(0, dtype=np.int64), 8, 2, 128, 16)
    assert p.batch_size == 0 and p.total_tokens == 0 and p.kv_bytes == 0


def test_problem_from_a_page_table_shares_its_checked_lengths_and_checks_its_shapes():
    table = PageTable.from_block_table(np.array([[3, 1], [2, 0]]), np.array([20, 5]), 16)
    problem = DecodeProblem.from_page_table(table, 32, 8, 128, "float16")
    assert problem.kv_lens is table.kv_lens and not problem.kv_lens.flags.writeable
    assert (problem.page_size, problem.dtype, problem.batch_size) == (16, "float16", 2)
    with pytest.raises(ValueError, match="num_kv_heads|num_qo_heads"):
        DecodeProblem.from_page_table(table, 32, 7, 128)
    with pytest.raises(ValueError, match="head_dim"):
        DecodeProblem.from_page_table(table, 32, 8, 100)
    with pytest.raises(TypeError, match="page_table"):
        DecodeProblem.from_page_table(np.array([20, 5]), 32, 8, 128)


def test_from_layout_takes_exactly_one_layout():
    """What plan() accepts: a PageTable, FlashInfer's three arrays or vLLM's two, never a mix."""
    table = PageTable.from_block_table([[3, 1], [2, 0]], [20, 7], 16)
    same = [PageTable.from_layout(table, 16),
            PageTable.from_layout(None, 16, kv_indptr=[0, 2, 3], kv_indices=[3, 1, 2],
                                  kv_last_page_len=[4, 7]),
            PageTable.from_layout(None, 16, block_table=[[3, 1], [2, 0]], seq_lens=[20, 7])]
    for t in same:
        np.testing.assert_array_equal(t.kv_indices, table.kv_indices)
        np.testing.assert_array_equal(t.kv_lens, table.kv_lens)
    with pytest.raises(TypeError, match="exactly one"):
        PageTable.from_layout(table, 16, seq_lens=[20, 7])
    with pytest.raises(TypeError, match="exactly one"):
        PageTable.from_layout(None, 16)
    with pytest.raises(TypeError, match="seq_lens"):
        PageTable.from_layout(None, 16, block_table=[[3, 1]])
    with pytest.raises(TypeError, match="kv_last_page_len"):
        PageTable.from_layout(None, 16, kv_indptr=[0, 1], kv_indices=[0])
    with pytest.raises(TypeError, match="page_table"):
        PageTable.from_layout("table", 16)
