"""A plan's integer metadata on the device: the chunk records the partial kernel reads (one per
chunk, in grid order, laid out as ``kernel_abi.CHUNK_RECORD``), the page table and merge_indptr,
uploaded together from one pinned buffer with one async copy."""

from __future__ import annotations

import numpy as np

from ..core.geometry import RECORD_PAGES, TILE_TOKENS
from ..core.plan import Plan
from ..core.problem import PageLengths, PageTable
from ..core.unified_max import LOG2E
from .kernel_abi import CHUNK_RECORD, IDLE_REQUEST, RECORD_HAS_PAGES, RECORD_TICKET_MERGE
from .streams import stream_pool_array

_PAGE_STEPS = np.arange(RECORD_PAGES)[:, None]      # first_pages' offsets from the first


def first_pages(page_table: PageTable, chunk_request, chunk_start,
                count: int = RECORD_PAGES) -> np.ndarray:
    """[num_chunks, count] page ids of each chunk's first pages (from the page holding its
    first token), carried in its record so the kernel need not look them up before its first
    copies. Entries past the request's last page repeat that page (never read)."""
    indptr = page_table.kv_indptr
    first = indptr[chunk_request]                      # each chunk's first page's entry
    first += np.asarray(chunk_start) // page_table.page_size
    last = indptr[1:][chunk_request]                   # its request's last entry
    last -= 1
    np.maximum(last, 0, out=last)
    if page_table.kv_indices.size == 0:
        return np.zeros((first.size, count), dtype=np.int32)
    # [count, num_chunks], transposed on return: NumPy adds a column to a long row faster
    # than a short row to each of many
    steps = _PAGE_STEPS[:count] if count <= RECORD_PAGES else np.arange(count)[:, None]
    entries = steps + first
    np.minimum(entries, last, out=entries)
    return page_table.kv_indices[entries].T


def record_pages_needed(page_size: int, stages: int, tile_tokens: int = TILE_TOKENS) -> int:
    """Pages the first ``stages`` tiles (of ``tile_tokens``, the kernel's) of a page-aligned
    chunk span."""
    return -(-stages * tile_tokens // page_size)


def pages_fit_record(plan: Plan, page_size: int, stages: int,
                     tile_tokens: int = TILE_TOKENS) -> bool:
    """Whether the kernel may take its first ``stages`` tiles' page ids from the chunk
    records: every chunk starts on a page boundary and those tiles span at most RECORD_PAGES
    pages."""
    if record_pages_needed(page_size, stages, tile_tokens) > RECORD_PAGES:
        return False
    if page_size & (page_size - 1) == 0:     # a power of two: one reduction over the starts' bits
        return not int(np.bitwise_or.reduce(plan.chunk_start)) & (page_size - 1)
    return not (plan.chunk_start % page_size).any()


def chunk_records(plan: Plan, page_table: PageTable, order, record_pages: int,
                  out: np.ndarray | None = None) -> np.ndarray:
    """[num_chunks] ``CHUNK_RECORD``: the kernel's chunk records, one per CTA row of the grid, in
    ``order`` (plan indices in launch order). Record r describes chunk c = order[r]: its request,
    first and end token, the request's first page-table entry, the request's chunk range (where
    its partials are), c itself (the partial rows it writes), its flags (the ticket merge, and
    whether it carries page ids) and, when ``record_pages`` > 0, the page ids of its first
    ``record_pages`` pages (the rest are 0). ``out``: write into these ``num_chunks`` records
    (e.g. a pinned upload buffer) instead of a new array."""
    order = np.asarray(order, dtype=np.intp)
    req = plan.chunk_request[order]
    start = plan.chunk_start[order]
    if out is None:
        records = np.zeros(plan.num_chunks, dtype=CHUNK_RECORD)
    else:
        records = out
        records["first_pages"] = 0
    records["request"] = req
    records["token_begin"] = start
    records["token_end"] = plan.chunk_end[order]
    records["page_table_begin"] = page_table.kv_indptr[req]
    records["chunk_begin"] = plan.merge_indptr[req]
    records["chunk_end"] = plan.merge_indptr[1:][req]
    records["plan_index"] = order
    records["flags"] = ((RECORD_TICKET_MERGE if plan.merge == "ticket" else 0)
                        | (RECORD_HAS_PAGES if record_pages else 0))
    if record_pages:
        records["first_pages"][:, :record_pages] = first_pages(page_table, req, start, record_pages)
    return records


def idle_records(count: int) -> np.ndarray:
    """[count] ``CHUNK_RECORD`` of idle slots (request -1): a graph-stable grid's CTAs past the
    plan's chunks read one and exit."""
    records = np.zeros(count, dtype=CHUNK_RECORD)
    records["request"] = IDLE_REQUEST
    return records


def query_rows_array(rows, kv_lens: np.ndarray, window_left: int) -> np.ndarray:
    """The multi-token build's DecodeParams::query_rows for ``rows`` (a ``QueryRows``):
    {first row in q, q_len, KV length, window_left (-1: none)} a request, int32 [batch, 4]."""
    out = np.empty((rows.count.size, 4), np.int32)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = rows.first, rows.count, kv_lens, window_left
    return out


def alibi_bits(slopes: np.ndarray) -> np.ndarray:
    """ALiBi's slopes as the kernels read them: slope x log2(e) (the kernels' scores are in
    log2 units) in float32, as int32 bits (they ride the int32 uploads)."""
    return (np.asarray(slopes, np.float64) * LOG2E).astype(np.float32).view(np.int32)


class PlanUpload:
    """The device copy of each plan's records, page table and merge_indptr. Both buffers keep
    their capacity across plans; before the pinned one is rewritten, the previous copy out of it
    must have finished (a host wait on that small copy only): the caller records ``ready`` on the
    stream once the plan's uploads are enqueued (a run on another stream waits on it too).
    The device buffer comes from the plan stream's pool (``streams.stream_pool_array``)."""

    def __init__(self):
        self._capacity = 0          # int32 elements
        self._host = self._device = self.ready = None
        self._stream_ptr = None     # the stream the device buffer was made for

    def upload(self, records: np.ndarray, page_table: PageTable | PageLengths, plan: Plan, stream,
               extra: dict | None = None) -> dict:
        """Copy on ``stream``; returns the device pointers {"records", "kv_indices",
        "merge_indptr"} and one per ``extra`` part (name -> int32 host array), and with a
        "split_requests" part its length as "num_split_requests"."""
        import cupy

        # a table kept on the device (``page_tables``) is read in place: no part of its own
        indices = {} if page_table.kv_indices is None else {"kv_indices": page_table.kv_indices}
        parts = {"records": records.view(np.int32), **indices,
                 "merge_indptr": plan.merge_indptr,
                 **{name: np.ascontiguousarray(a, np.int32).ravel()
                    for name, a in (extra or {}).items()}}
        sizes = [-(-max(1, a.size) // 4) * 4 for a in parts.values()]   # 16-byte aligned parts
        total = int(sum(sizes))
        if total > self._capacity:
            self._capacity = max(total, 2 * self._capacity)
            self._host = cupy.cuda.alloc_pinned_memory(self._capacity * 4)
            self._device = stream_pool_array(
                self._capacity, np.int32, stream,
                replacing_from=None if self._device is None else self._stream_ptr)
            self._stream_ptr = stream.ptr
            self.ready = cupy.cuda.Event(disable_timing=True)
        else:
            self.ready.synchronize()
        host = np.frombuffer(self._host, dtype=np.int32, count=total)
        offset, pointers = 0, {}
        for (name, arr), size in zip(parts.items(), sizes):
            host[offset:offset + arr.size] = arr
            pointers[name] = self._device.data.ptr + offset * 4
            offset += size
        self._device[:total].set(host, stream=stream)
        if "split_requests" in parts:
            pointers["num_split_requests"] = int(parts["split_requests"].size)
        return pointers


class GraphPlanUpload:
    """A graph-stable wrapper's plan buffers: fixed device addresses, sized once for the
    capacity (records, merge_indptr, the query rows of a multi-token or ALiBi grid, ALiBi's
    slopes, page-table entries), so a captured launch reads whatever plan was uploaded last;
    each plan copies the records, merge_indptr (query rows, slopes) and its own entries. Each
    plan is written to one of two pinned host buffers in turn and copied with one async copy on
    the plan's stream; before a host buffer is rewritten, the copy out of it two plans ago must
    have finished (a host wait on that small copy only)."""

    def __init__(self, max_chunks: int, max_num_pages: int, max_batch_size: int, stream,
                 query_rows: bool = False, alibi_heads: int = 0):
        import cupy

        # the page table last: a plan copies only as much of it as it has entries; with
        # ``query_rows`` (a multi-token grid, or ALiBi's positions), four ints a request before
        # it, and with ``alibi_heads``, ALiBi's slopes x log2(e) (float32 bits), one a head
        self.capacity = {"records": max_chunks * CHUNK_RECORD.itemsize // 4,
                         "merge_indptr": max_batch_size + 1,
                         **({"query_rows": 4 * max_batch_size} if query_rows else {}),
                         **({"alibi_slopes_log2": alibi_heads} if alibi_heads else {}),
                         "kv_indices": max_num_pages}
        self._sizes = [-(-max(1, n) // 4) * 4 for n in self.capacity.values()]
        total = int(sum(self._sizes))
        self._device = stream_pool_array(total, np.int32, stream)
        self._hosts = [cupy.cuda.alloc_pinned_memory(total * 4) for _ in range(2)]
        # the event after each host buffer's copy, and whether it was ever recorded
        self._copied = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
        self._used = [False, False]
        self._next = 0
        self._int_views = [np.frombuffer(h, dtype=np.int32, count=total) for h in self._hosts]
        self._records = [v[:self._sizes[0]].view(CHUNK_RECORD)[:max_chunks]
                         for v in self._int_views]
        self._idle = idle_records(max_chunks)
        for records in self._records:
            records[:] = self._idle
        self._filled = [0, 0]               # records of each buffer's last plan (the rest idle)
        self.pointers, self._offsets, offset = {}, {}, 0
        for name, size in zip(self.capacity, self._sizes):
            self.pointers[name] = self._device.data.ptr + offset * 4
            self._offsets[name] = offset
            offset += size
        self.ready = None

    def next_records(self, num_chunks: int) -> np.ndarray:
        """The next upload's first ``num_chunks`` records, in its pinned host buffer, for
        ``chunk_records(..., out=)`` to fill (the rest of the capacity is made idle); waits for
        the copy out of that buffer two plans ago."""
        i = self._next
        if self._used[i]:
            self._copied[i].synchronize()
        records = self._records[i]
        records[num_chunks:self._filled[i]] = self._idle[num_chunks:self._filled[i]]
        self._filled[i] = num_chunks
        return records[:num_chunks]

    def upload(self, kv_indices: np.ndarray, merge_indptr: np.ndarray, stream,
               query_rows: np.ndarray | None = None, alibi_bits: np.ndarray | None = None) -> None:
        """Write the page table and merge_indptr (and the grid's ``query_rows``, the whole
        capacity's, and ALiBi's slopes as ``alibi_bits``, where it has them) next to the records
        ``next_records`` gave (each within its capacity: the caller checks) and copy all on
        ``stream``; ``ready`` is then the event after the copy."""
        i = self._next
        self._next ^= 1
        host = self._int_views[i]
        for name, part in (("query_rows", query_rows), ("alibi_slopes_log2", alibi_bits)):
            if name not in self.capacity:
                continue
            if part is None or part.size != self.capacity[name]:
                raise ValueError(f"{name}: this grid's upload needs its capacity's "
                                 f"{self.capacity[name]} values")
            at = self._offsets[name]
            host[at:at + part.size] = part.ravel()
        indptr_at, pages_at = self._offsets["merge_indptr"], self._offsets["kv_indices"]
        host[indptr_at:indptr_at + merge_indptr.size] = merge_indptr
        host[pages_at:pages_at + kv_indices.size] = kv_indices
        # the rest of the page table is never read (a chunk reads its own request's entries)
        used = pages_at + kv_indices.size
        self._device[:used].set(host[:used], stream=stream)
        self._copied[i].record(stream)
        self._used[i] = True
        self.ready = self._copied[i]

    def write_alibi(self, bits: np.ndarray, stream) -> None:
        """Copy ALiBi's slopes (float32 bits, one a head) alone on ``stream``, from host memory
        (a device-planned wrapper, whose plans upload nothing): outside any capture."""
        at, n = self._offsets["alibi_slopes_log2"], self.capacity["alibi_slopes_log2"]
        self._device[at:at + n].set(np.ascontiguousarray(bits, np.int32), stream=stream)
