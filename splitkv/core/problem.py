"""The decode batch: which pages hold each request's KV, and the shapes of the attention.

``PageTable`` is built from what users already have (FlashInfer's ``kv_indptr`` /
``kv_indices`` / ``kv_last_page_len``, vLLM's ``block_table`` / ``seq_lens``, or a contiguous
cache) and always stored the FlashInfer way. ``DecodeProblem`` is what the planner sees: the
lengths and the shapes, no page indices.

Conventions: a zero-length request attends to nothing; its output is all zeros and its
log-sum-exp is ``-inf``. An empty batch (``batch_size == 0``) gives empty outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import validation as V
from .variants import read_begin


def _own(array: np.ndarray, given) -> np.ndarray:
    """``array``, ``host_int_array``'s reading of ``given``, as an array no one else holds: as
    it is where that made it (from a list, or converting another integer dtype), else a copy."""
    if array is not given and array.base is None and (
            isinstance(given, (list, tuple)) or isinstance(given, np.ndarray)):
        return array
    return array.copy()


@dataclass(frozen=True, eq=False)
class PageTable:
    """Pages of each request, FlashInfer layout, on the host.

    kv_indptr: int64 [batch_size + 1]; request b owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]].
    kv_indices: int64 [total_pages]; indices into the first axis of the KV cache.
    kv_last_page_len: int64 [batch_size]; tokens in the last page (1..page_size), 0 for no pages.
    """

    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    page_size: int
    kv_lens: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        # Checked here so a directly built table is as safe as one from the constructors below;
        # copied, once checked, so that freezing the table never freezes the caller's arrays.
        page_size = V.check_page_size(self.page_size)
        indptr = V.host_int_array("kv_indptr", self.kv_indptr, 1)
        indices = V.host_int_array("kv_indices", self.kv_indices, 1)
        last = V.host_int_array("kv_last_page_len", self.kv_last_page_len, 1)
        lens = V.check_page_table(indptr, indices, last, page_size)
        indptr, indices, last = (_own(indptr, self.kv_indptr), _own(indices, self.kv_indices),
                                 _own(last, self.kv_last_page_len))
        for name, value in (("page_size", page_size), ("kv_indptr", indptr), ("kv_indices", indices),
                            ("kv_last_page_len", last), ("kv_lens", lens)):
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
            object.__setattr__(self, name, value)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.size - 1

    @classmethod
    def from_flashinfer(cls, kv_indptr, kv_indices, kv_last_page_len, page_size: int,
                        num_pages: int | None = None) -> "PageTable":
        """The layout FlashInfer's paged decode takes. ``num_pages`` bounds the indices if given."""
        table = cls(kv_indptr, kv_indices, kv_last_page_len, page_size)
        if num_pages is not None:
            V.check_page_indices(table.kv_indices, num_pages)
        return table

    @classmethod
    def from_block_table(cls, block_table, seq_lens, page_size: int,
                         num_pages: int | None = None) -> "PageTable":
        """vLLM layout: ``block_table[b, i]`` is the i-th page of request b; only the first
        ``ceil(seq_lens[b] / page_size)`` entries of a row are read, so the rest may hold any
        padding (-1 included). A bad entry among those read is named by row and column."""
        page_size = V.check_page_size(page_size)
        # the table in its own dtype: only the entries read are converted (plan() runs on every
        # step, and the table's padding may be most of it)
        table = V.host_int_array("block_table", block_table, 2, as_int64=False)
        lens = V.host_int_array("seq_lens", seq_lens, 1)
        rows, width = table.shape
        if lens.size != rows:
            raise ValueError(f"seq_lens: expected {rows} elements (one per block_table row), "
                             f"got {lens.size}")
        V.check_seq_lens(lens, width * page_size, page_size)
        pages = -(-lens // page_size)
        indptr = np.empty(rows + 1, np.int64)
        indptr[0] = 0
        np.cumsum(pages, out=indptr[1:])
        total = int(indptr[-1])
        if total > V.MAX_TOTAL_PAGES:
            raise ValueError(f"kv_indices: {total} pages; at most MAX_TOTAL_PAGES="
                             f"{V.MAX_TOTAL_PAGES} are supported (the kernel's page-table "
                             "offsets are int)")
        # entry e of request b is column e - indptr[b] of row b: b x width + that, row-major
        flat = np.arange(total, dtype=np.int64)
        flat += np.repeat(np.arange(rows, dtype=np.int64) * width - indptr[:-1], pages)
        indices = table.ravel().take(flat).astype(np.int64, copy=False)

        def position(i: int) -> str:          # where entry i sits in block_table
            b = int(np.searchsorted(indptr, i, side="right")) - 1
            return (f"[{b}, {i - indptr[b]}] (request {b} reads {pages[b]} pages for its "
                    f"{lens[b]} tokens)")

        # only the entries read are checked, and a bad one is named by its row and column
        V.check_page_indices(indices, num_pages, "block_table", position=position)
        last = lens - np.maximum(pages - 1, 0) * page_size      # 0 for an empty request
        # built and checked here (the lengths against the table, the entries read): nothing
        # for the constructor to check again
        return cls._trusted(indptr, indices, last, page_size, lens.copy())

    @classmethod
    def _trusted(cls, kv_indptr, kv_indices, kv_last_page_len, page_size: int,
                 kv_lens) -> "PageTable":
        """A table whose arrays this module built and checked (int64, its own): frozen as
        they are, without the constructor's checks and copies."""
        table = object.__new__(cls)
        for arr in (kv_indptr, kv_indices, kv_last_page_len, kv_lens):
            arr.setflags(write=False)
        table.__dict__.update(kv_indptr=kv_indptr, kv_indices=kv_indices,
                              kv_last_page_len=kv_last_page_len, page_size=page_size,
                              kv_lens=kv_lens)
        return table

    @classmethod
    def from_layout(cls, page_table: "PageTable | None", page_size: int, *, kv_indptr=None,
                    kv_indices=None, kv_last_page_len=None, block_table=None,
                    seq_lens=None) -> "PageTable":
        """The page table of exactly one of: a ``PageTable``; FlashInfer's ``kv_indptr``,
        ``kv_indices``, ``kv_last_page_len``; vLLM's ``block_table`` and ``seq_lens`` (host
        arrays: NumPy, lists, or CPU tensors). What a ``plan()`` takes."""
        if (page_table is not None and kv_indptr is None and kv_indices is None
                and kv_last_page_len is None and block_table is None and seq_lens is None):
            V.check_instance("page_table", page_table, cls)   # plan()'s common call
            return page_table
        flashinfer = (kv_indptr, kv_indices, kv_last_page_len)
        vllm = (block_table, seq_lens)
        given = [name for name, parts in (("page_table", (page_table,)),
                                          ("kv_indptr/kv_indices/kv_last_page_len", flashinfer),
                                          ("block_table/seq_lens", vllm))
                 if any(p is not None for p in parts)]
        if len(given) != 1:
            raise TypeError("page_table: give exactly one of a PageTable, FlashInfer's kv_indptr/"
                            "kv_indices/kv_last_page_len, or vLLM's block_table/seq_lens; got "
                            + (" and ".join(given) or "none"))
        if page_table is not None:
            V.check_instance("page_table", page_table, cls)
            return page_table
        if given[0] == "block_table/seq_lens":
            missing = [n for n, v in zip(("block_table", "seq_lens"), vllm) if v is None]
            if missing:
                raise TypeError(f"{missing[0]}: vLLM's layout needs block_table and seq_lens")
            return cls.from_block_table(block_table, seq_lens, page_size)
        missing = [n for n, v in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), flashinfer)
                   if v is None]
        if missing:
            raise TypeError(f"{missing[0]}: FlashInfer's layout needs kv_indptr, kv_indices and "
                            "kv_last_page_len")
        return cls.from_flashinfer(kv_indptr, kv_indices, kv_last_page_len, page_size)

    @classmethod
    def contiguous(cls, seq_lens, max_len: int) -> "PageTable":
        """A contiguous cache ``[batch, max_len, kv_heads, head_dim]`` seen as one page per request
        of ``page_size = max_len``: pass that array itself as the KV cache."""
        max_len = V.check_int("max_len", max_len, 1, V.MAX_KV_LEN, "MAX_KV_LEN")
        lens = V.host_int_array("seq_lens", seq_lens, 1)
        V.check_seq_lens(lens, max_len, max_len)
        table = np.arange(lens.size, dtype=np.int64)[:, None]
        return cls.from_block_table(table, lens, max_len)

    def token_slots(self, b: int) -> np.ndarray:
        """Flat slot (page * page_size + offset) of every token of request b, in order."""
        pages = self.kv_indices[self.kv_indptr[b]:self.kv_indptr[b + 1]]
        n = int(self.kv_lens[b])
        t = np.arange(n)
        return pages[t // self.page_size] * self.page_size + t % self.page_size


@dataclass(frozen=True, eq=False)
class PageLengths:
    """A page table whose page ids the host does not hold (an engine's table on the device):
    ``kv_indptr`` [batch + 1], each request's first entry of that table, and ``kv_lens``
    [batch], checked. Enough to plan and to write the chunk records; nothing reads page ids."""

    kv_indptr: np.ndarray
    kv_lens: np.ndarray
    page_size: int
    kv_indices = None

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.size)


_SHAPE_FIELDS = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype",
                 "window_left", "attention_chunk_size")
_CHECKED_SHAPES: dict = {}        # (type, value) of each shape field -> the checked values


def _checked_shape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                   window_left, attention_chunk_size) -> tuple:
    """The shape fields of a ``DecodeProblem``, checked (``_SHAPE_FIELDS`` order). A decode loop
    plans one shape on every step, so a shape that passed is remembered, keyed by each value's
    type too (True == 1, but a bool is no head count)."""
    key = (type(num_qo_heads), num_qo_heads, type(num_kv_heads), num_kv_heads, type(head_dim),
           head_dim, type(page_size), page_size, type(dtype), dtype, type(window_left),
           window_left, type(attention_chunk_size), attention_chunk_size)
    try:
        return _CHECKED_SHAPES[key]
    except TypeError:                   # unhashable: checked every time
        key = None
    except KeyError:
        pass
    hq, hk = V.check_heads(num_qo_heads, num_kv_heads)
    checked = (hq, hk, V.check_head_dim(head_dim), V.check_page_size(page_size),
               V.check_dtype("dtype", dtype),
               V.check_int("window_left", window_left, -1, V.MAX_KV_LEN, "MAX_KV_LEN"),
               V.check_int("attention_chunk_size", attention_chunk_size, 0, V.MAX_KV_LEN,
                           "MAX_KV_LEN"))
    if key is not None:
        if len(_CHECKED_SHAPES) >= 1024:
            _CHECKED_SHAPES.clear()
        _CHECKED_SHAPES[key] = checked
    return checked


@dataclass(frozen=True, eq=False)
class DecodeProblem:
    """What the planner needs to know about one decode call: lengths and shapes, no pages.

    window_left: a sliding window (``core.variants``): the query, at each request's last
    position, sees only its last window_left + 1 tokens; a plan then covers just those
    (``kv_begin`` .. ``kv_lens``), so its cost follows the window. -1: no window.
    attention_chunk_size: chunked local attention (``core.variants``): the query sees only the
    keys of its own chunk of that many tokens, and a plan covers just those; 0: none."""

    kv_lens: np.ndarray
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"
    window_left: int = -1
    attention_chunk_size: int = 0

    def __post_init__(self):
        lens = V.host_int_array("kv_lens", self.kv_lens, 1)
        V.check_kv_lens("kv_lens", lens)
        lens = lens.copy()
        lens.setflags(write=False)
        object.__setattr__(self, "kv_lens", lens)
        self._check_shapes()

    def _check_shapes(self) -> None:
        chunk = 0 if self.attention_chunk_size is None else self.attention_chunk_size
        checked = _checked_shape(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                 self.page_size, self.dtype, self.window_left, chunk)
        self.__dict__.update(zip(_SHAPE_FIELDS, checked))
        begin = read_begin(self.kv_lens, *checked[-2:])
        if begin is not None:
            begin.setflags(write=False)
            read = self.kv_lens - begin
            read.setflags(write=False)
        else:
            begin, read = None, self.kv_lens
        object.__setattr__(self, "_kv_begin", begin)
        object.__setattr__(self, "read_lens", read)

    @classmethod
    def from_page_table(cls, page_table: PageTable, num_qo_heads: int, num_kv_heads: int,
                        head_dim: int, dtype="bfloat16", window_left: int = -1,
                        attention_chunk_size: int = 0) -> "DecodeProblem":
        """The problem of a page table. Its lengths are shared, not copied or checked again:
        the table already holds them checked and read-only (plan() runs on every step)."""
        V.check_instance("page_table", page_table, (PageTable, PageLengths), "a PageTable")
        problem = cls.__new__(cls)
        problem.__dict__.update(kv_lens=page_table.kv_lens, num_qo_heads=num_qo_heads,
                                num_kv_heads=num_kv_heads, head_dim=head_dim,
                                page_size=page_table.page_size, dtype=dtype,
                                window_left=window_left,
                                attention_chunk_size=attention_chunk_size)
        problem._check_shapes()
        return problem

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.size)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def kv_begin(self) -> np.ndarray:
        """[batch] each request's first token a call reads (0 without a window or chunks)."""
        if self._kv_begin is None:
            return np.zeros(self.batch_size, np.int64)
        return self._kv_begin

    @property
    def windowed(self) -> bool:
        return self._kv_begin is not None

    @property
    def total_tokens(self) -> int:
        """Tokens one call reads (the windows' with a window)."""
        return int(self.read_lens.sum())

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V that one call must read."""
        return self.total_tokens * self.num_kv_heads * self.head_dim * 2 * 2

    def __repr__(self) -> str:
        lens = self.kv_lens
        if lens.size <= 6:
            lens_s = str(lens.tolist())
        else:
            lens_s = f"[{lens.size} requests, {lens.min()}..{lens.max()}, mean {lens.mean():.0f}]"
        return (f"DecodeProblem(kv_lens={lens_s}, heads={self.num_qo_heads}/{self.num_kv_heads}, "
                f"head_dim={self.head_dim}, page_size={self.page_size}, dtype={self.dtype}"
                + (f", window_left={self.window_left}" if self.window_left >= 0 else "")
                + (f", attention_chunk_size={self.attention_chunk_size}"
                   if self.attention_chunk_size else "") + ")")
