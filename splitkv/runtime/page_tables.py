"""A page table that stays on the device: ``plan()`` from host lengths, the pages read in place.

Engines keep the block table (vLLM) or ``kv_indices`` (FlashInfer) on the GPU and the lengths on
the host. The planner needs only the lengths, and the kernels read a request's pages from its
first page-table entry, so such a table is never copied: the plan's records hold each request's
first entry (a block-table row's start), and the kernels read the caller's array. What is not
known on the host is not checked there: page ids must lie in the K/V pool (as with
``plan_on_device``), and the chunk records carry no page ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..core import validation as V
from ..core.problem import PageLengths, PageTable
from .arrays import DeviceArray, as_device_array


def is_device_array(obj) -> bool:
    """Whether ``obj`` lives on a GPU (CuPy, a CUDA torch tensor, ``__cuda_array_interface__``)."""
    if obj is None or isinstance(obj, (np.ndarray, list, tuple)):
        return False
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    return bool(getattr(obj, "is_cuda", False))


@dataclass(frozen=True, eq=False)
class DevicePageTable(PageLengths):
    """``PageLengths`` and ``table``: the int32 device array the kernels read the pages from."""

    table: DeviceArray = None


def _int32_device(name: str, obj, ndim: int, device) -> DeviceArray:
    a = as_device_array(name, obj)
    if a.dtype != "int32":
        raise TypeError(f"{name}: expected an int32 device array (the kernels read int32 page "
                        f"ids), got {a.dtype}")
    if len(a.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d device array, got shape {list(a.shape)}")
    if a.device is not None and device is not None and a.device != device:
        raise ValueError(f"{name}: on device {a.device}, the wrapper plans on device {device}")
    if a.strides[-1] != 1 and a.shape[-1] > 1:
        raise ValueError(f"{name}: expected unit stride along its last axis, got strides "
                         f"{list(a.strides)}")
    return a


@lru_cache(maxsize=32)
def _row_starts(rows: int, row_stride: int) -> np.ndarray:
    """Each block-table row's first entry, and the end: read-only, kept (an engine's batch
    sizes recur, and plan() runs on every step)."""
    starts = np.arange(rows + 1, dtype=np.int64) * row_stride
    starts.setflags(write=False)
    return starts


def device_page_table(page_size: int, device, *, kv_indptr=None, kv_indices=None,
                      kv_last_page_len=None, block_table=None,
                      seq_lens=None) -> DevicePageTable | None:
    """plan()'s page table when its pages are on the device (vLLM's ``block_table`` or
    FlashInfer's ``kv_indices``), the lengths on the host; None when the table is a host one."""
    if is_device_array(block_table):
        table = _int32_device("block_table", block_table, 2, device)
        if seq_lens is None:
            raise TypeError("seq_lens: vLLM's layout needs block_table and seq_lens (host)")
        lens = V.host_int_array("seq_lens", seq_lens, 1)
        rows, columns = table.shape
        if lens.size != rows:
            raise ValueError(f"seq_lens: expected {rows} elements (one per block_table row), got "
                             f"{lens.size}")
        V.check_batch_size("seq_lens", rows)
        if columns < 1:
            raise ValueError("block_table: expected at least one column")
        V.check_seq_lens(lens, columns * page_size, page_size)
        row_stride = table.strides[0] if rows > 1 else columns
        if row_stride < columns or row_stride * rows >= 2**31:
            raise ValueError(f"block_table: expected rows that do not overlap and fewer than "
                             f"2**31 entries in all (the kernels' offsets are int32), got shape "
                             f"{list(table.shape)} with strides {list(table.strides)}")
        return DevicePageTable(_row_starts(rows, row_stride), lens, page_size, table)
    if is_device_array(kv_indices):
        table = _int32_device("kv_indices", kv_indices, 1, device)
        if kv_indptr is None or kv_last_page_len is None:
            raise TypeError("kv_indptr: FlashInfer's layout needs kv_indptr and "
                            "kv_last_page_len (host) beside kv_indices")
        indptr = V.host_int_array("kv_indptr", kv_indptr, 1)
        last = V.host_int_array("kv_last_page_len", kv_last_page_len, 1)
        if indptr.size and indptr[-1] > table.shape[0]:
            raise ValueError(f"kv_indices: kv_indptr[-1]={indptr[-1]} pages are referenced but "
                             f"kv_indices has {table.shape[0]}")
        if table.shape[0] >= 2**31:
            raise ValueError("kv_indices: at most 2**31 - 1 entries (the kernels' offsets are "
                             "int32)")
        # the host checks of a FlashInfer table, on its indptr and lengths (ids stay unread)
        lens = V.check_page_table(indptr, None, last, page_size)
        return DevicePageTable(indptr, lens, page_size, table)
    for name, value in (("seq_lens", seq_lens), ("kv_indptr", kv_indptr),
                        ("kv_last_page_len", kv_last_page_len)):
        if is_device_array(value):
            raise TypeError(f"{name}: expected a host array; the lengths are the planner's. "
                            "(The page table itself, block_table or kv_indices, may stay on "
                            "the device.)")
    return None


def plan_page_table(page_table, page_size: int, **layout) -> PageTable | DevicePageTable:
    """plan()'s batch: a ``PageTable`` (given, or built from host arrays), or a
    ``DevicePageTable`` when the table is on the device; its page size must be ``page_size``."""
    import cupy

    table = page_table is None and device_page_table(
        page_size, cupy.cuda.runtime.getDevice(), **layout)
    table = table or PageTable.from_layout(page_table, page_size, **layout)
    if table.page_size != page_size:
        raise ValueError(f"page_table: page_size {table.page_size} differs from the wrapper's "
                         f"page_size {page_size}")
    return table
