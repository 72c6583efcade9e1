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
        indptr, indices, last = indptr.copy(), indices.copy(), last.copy()
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
        table = V.host_int_array("block_table", block_table, 2)
        lens = V.host_int_array("seq_lens", seq_lens, 1)
        if lens.size != table.shape[0]:
            raise ValueError(f"seq_lens: expected {table.shape[0]} elements (one per block_table row), "
                             f"got {lens.size}")
        V.check_seq_lens(lens, table.shape[1] * page_size, page_size)
        pages = -(-lens // page_size)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int64)
        rows = np.repeat(np.arange(lens.size), pages)
        cols = np.arange(indptr[-1]) - np.repeat(indptr[:-1], pages)
        indices = table[rows, cols].astype(np.int64)
        # only the entries read are checked, and a bad one is named by its row and column
        V.check_page_indices(indices, num_pages, "block_table",
                             position=lambda i: f"[{rows[i]}, {cols[i]}] (request {rows[i]} "
                                                f"reads {pages[rows[i]]} pages for its "
                                                f"{lens[rows[i]]} tokens)")
        last = np.where(pages > 0, lens - (pages - 1) * page_size, 0)
        return cls.from_flashinfer(indptr, indices, last, page_size)

    @classmethod
    def from_layout(cls, page_table: "PageTable | None", page_size: int, *, kv_indptr=None,
                    kv_indices=None, kv_last_page_len=None, block_table=None,
                    seq_lens=None) -> "PageTable":
        """The page table of exactly one of: a ``PageTable``; FlashInfer's ``kv_indptr``,
        ``kv_indices``, ``kv_last_page_len``; vLLM's ``block_table`` and ``seq_lens`` (host
        arrays: NumPy, lists, or CPU tensors). What a ``plan()`` takes."""
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


@dataclass(frozen=True, eq=False)
class DecodeProblem:
    """What the planner needs to know about one decode call: lengths and shapes, no pages.

    window_left: a sliding window (``core.variants``): the query, at each request's last
    position, sees only its last window_left + 1 tokens; a plan then covers just those
    (``kv_begin`` .. ``kv_lens``), so its cost follows the window. -1: no window."""

    kv_lens: np.ndarray
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"
    window_left: int = -1

    def __post_init__(self):
        lens = V.host_int_array("kv_lens", self.kv_lens, 1)
        V.check_kv_lens("kv_lens", lens)
        lens = lens.copy()
        lens.setflags(write=False)
        object.__setattr__(self, "kv_lens", lens)
        self._check_shapes()

    def _check_shapes(self) -> None:
        hq, hk = V.check_heads(self.num_qo_heads, self.num_kv_heads)
        object.__setattr__(self, "num_qo_heads", hq)
        object.__setattr__(self, "num_kv_heads", hk)
        object.__setattr__(self, "head_dim", V.check_head_dim(self.head_dim))
        object.__setattr__(self, "page_size", V.check_page_size(self.page_size))
        object.__setattr__(self, "dtype", V.check_dtype("dtype", self.dtype))
        window = V.check_int("window_left", self.window_left, -1, V.MAX_KV_LEN, "MAX_KV_LEN")
        object.__setattr__(self, "window_left", window)
        if window >= 0:
            begin = np.maximum(self.kv_lens - 1 - window, 0)
            begin.setflags(write=False)
            read = self.kv_lens - begin
            read.setflags(write=False)
        else:
            begin, read = None, self.kv_lens
        object.__setattr__(self, "_kv_begin", begin)
        object.__setattr__(self, "read_lens", read)

    @classmethod
    def from_page_table(cls, page_table: PageTable, num_qo_heads: int, num_kv_heads: int,
                        head_dim: int, dtype="bfloat16", window_left: int = -1) -> "DecodeProblem":
        """The problem of a page table. Its lengths are shared, not copied or checked again:
        the table already holds them checked and read-only (plan() runs on every step)."""
        V.check_instance("page_table", page_table, (PageTable, PageLengths), "a PageTable")
        problem = cls.__new__(cls)
        for name, value in (("kv_lens", page_table.kv_lens), ("num_qo_heads", num_qo_heads),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("page_size", page_table.page_size), ("dtype", dtype),
                            ("window_left", window_left)):
            object.__setattr__(problem, name, value)
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
        """[batch] each request's first token a call reads (0 without a window)."""
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
                + (f", window_left={self.window_left})" if self.windowed else ")"))
