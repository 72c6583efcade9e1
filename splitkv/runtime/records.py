"""A plan's integer metadata on the device: the chunk records the partial kernel reads (one per
chunk, in grid order, laid out as ``kernel_abi.CHUNK_RECORD``), the page table and merge_indptr,
uploaded together from one pinned buffer with one async copy."""

from __future__ import annotations

import numpy as np

from ..core.geometry import RECORD_PAGES, TILE_TOKENS
from ..core.plan import Plan
from ..core.problem import PageTable
from .kernel_abi import CHUNK_RECORD


def first_pages(page_table: PageTable, chunk_request, chunk_start,
                count: int = RECORD_PAGES) -> np.ndarray:
    """[num_chunks, count] page ids of each chunk's first pages (from the page holding its
    first token), carried in its record so the kernel need not look them up before its first
    copies. Entries past the request's last page repeat that page (never read)."""
    entries = (page_table.kv_indptr[chunk_request] + chunk_start // page_table.page_size)[:, None] \
        + np.arange(count)
    last = np.maximum(page_table.kv_indptr[np.asarray(chunk_request) + 1] - 1, 0)[:, None]
    if page_table.kv_indices.size == 0:
        return np.zeros(entries.shape, dtype=np.int32)
    return page_table.kv_indices[np.minimum(entries, last)]


def record_pages_needed(page_size: int, stages: int) -> int:
    """Pages the first ``stages`` tiles of a page-aligned chunk span."""
    return -(-stages * TILE_TOKENS // page_size)


def pages_fit_record(plan: Plan, page_size: int, stages: int) -> bool:
    """Whether the kernel may take its first ``stages`` tiles' page ids from the chunk
    records: every chunk starts on a page boundary and those tiles span at most RECORD_PAGES
    pages."""
    return (record_pages_needed(page_size, stages) <= RECORD_PAGES
            and not np.any(plan.chunk_start % page_size))


def chunk_records(plan: Plan, page_table: PageTable, order, record_pages: int) -> np.ndarray:
    """[num_chunks] ``CHUNK_RECORD``: the kernel's chunk records, one per CTA row of the grid, in
    ``order`` (plan indices in launch order). Record r describes chunk c = order[r]: its request,
    first and end token, the request's first page-table entry, the request's chunk range (where
    its partials are), c itself (the partial rows it writes) and, when ``record_pages`` > 0, the
    page ids of its first ``record_pages`` pages (the rest are 0)."""
    order = np.asarray(order, dtype=np.intp)
    req = plan.chunk_request[order]
    start = plan.chunk_start[order]
    records = np.zeros(plan.num_chunks, dtype=CHUNK_RECORD)
    records["request"] = req
    records["token_begin"] = start
    records["token_end"] = plan.chunk_end[order]
    records["page_table_begin"] = page_table.kv_indptr[req]
    records["chunk_begin"] = plan.merge_indptr[req]
    records["chunk_end"] = plan.merge_indptr[req + 1]
    records["plan_index"] = order
    if record_pages:
        records["first_pages"][:, :record_pages] = first_pages(page_table, req, start, record_pages)
    return records


class PlanUpload:
    """The device copy of each plan's records, page table and merge_indptr. Both buffers keep
    their capacity across plans; before the pinned one is rewritten, the previous copy out of it
    must have finished (a host wait on that small copy only): the caller records ``ready`` on the
    stream once the plan's uploads are enqueued (a run on another stream waits on it too)."""

    def __init__(self):
        self._capacity = 0          # int32 elements
        self._host = self._device = self.ready = None

    def upload(self, records: np.ndarray, page_table: PageTable, plan: Plan, stream) -> dict:
        """Copy on ``stream``; returns the device pointers {"records", "kv_indices",
        "merge_indptr"}."""
        import cupy

        parts = {"records": records.view(np.int32), "kv_indices": page_table.kv_indices,
                 "merge_indptr": plan.merge_indptr}
        sizes = [-(-max(1, a.size) // 4) * 4 for a in parts.values()]   # 16-byte aligned parts
        total = int(sum(sizes))
        if total > self._capacity:
            self._capacity = max(total, 2 * self._capacity)
            self._host = cupy.cuda.alloc_pinned_memory(self._capacity * 4)
            self._device = cupy.empty(self._capacity, dtype=np.int32)
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
        return pointers
