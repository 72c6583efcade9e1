"""What the planner on the device must write, two ways: the host planner's plan as a graph-stable
wrapper uploads it (``expected``), and ``kernels_cu/device_plan.cuh`` built with the host C++
compiler and run on one thread by device_plan_host.cpp (``HostRun``). The CPU tests compare
the two; the GPU tests compare the kernel with both."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from splitkv import DecodeProblem, PageTable
from splitkv.core.execution import grid_order
from splitkv.planner import choose_plan
from splitkv.runtime.device_planner import (STATE_FIELDS, DevicePlanParams, header_defines,
                                            scratch_ints)
from splitkv.runtime.kernel_abi import CHUNK_RECORD
from splitkv.runtime.records import chunk_records, idle_records, pages_fit_record, record_pages_needed

# The serial driver of the header, with the ctypes entry points.
_DRIVER = Path(__file__).with_name("device_plan_host.cpp")


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


_LIBS: dict = {}


def host_library(expressions: dict | None = None):
    """device_plan.cuh and its serial driver (device_plan_host.cpp) compiled for the host
    (cached per source), as a ctypes library; ``expressions``: the cost model's rows of
    another table than ``features.ROW_EXPRESSIONS`` (``header_defines``)."""
    files = {"device_plan.cuh": resources.files("splitkv.kernels_cu").joinpath(
                 "device_plan.cuh").read_text(),
             "device_plan_defines.h": header_defines(expressions),
             "driver.cpp": _DRIVER.read_text()}
    digest = hashlib.sha256("".join(files.values()).encode()).hexdigest()[:16]
    if digest in _LIBS:
        return _LIBS[digest]
    out = Path(tempfile.gettempdir()) / f"splitkv-device-plan-{digest}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in files.items():
                Path(tmp, name).write_text(text)
            part = Path(tmp, "lib.so")
            subprocess.run([compiler(), "-std=c++17", "-O2", "-ffp-contract=off", "-fPIC",
                            "-shared", "-I", tmp, str(Path(tmp, "driver.cpp")), "-o",
                            str(part)], check=True)
            shutil.move(str(part), out)
    lib = ctypes.CDLL(str(out))
    lib.splitkv_plan_on_host.argtypes = [ctypes.POINTER(DevicePlanParams)]
    lib.splitkv_plan_params_size.restype = ctypes.c_int
    lib.splitkv_feature_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.splitkv_row_inputs.restype = lib.splitkv_row_members.restype = ctypes.c_int
    lib.splitkv_candidate_rows.restype = ctypes.c_int
    lib.splitkv_candidate_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    _LIBS[digest] = lib
    return lib


def device_rows(inputs: np.ndarray, expressions: dict | None = None) -> np.ndarray:
    """The rows [members, n] the planner on the device computes (``feature_rows``, built
    with g++) from inputs [RowInputs' members, n]: ``ROW_INPUTS`` then ``ROW_CONSTANTS``."""
    lib = host_library(expressions)
    inputs = np.ascontiguousarray(np.asarray(inputs, np.float64).T)
    assert inputs.shape[1] == lib.splitkv_row_inputs(), inputs.shape
    out = np.zeros((inputs.shape[0], lib.splitkv_row_members()))
    for column, result in zip(inputs, out):
        lib.splitkv_feature_rows(column.ctypes.data, result.ctypes.data)
    return out.T


@dataclass
class Written:
    """What a planner wrote: the records buffer [max_chunks], merge_indptr [max_batch + 1], the
    state and the chosen prediction."""

    records: np.ndarray
    merge_indptr: np.ndarray
    state: dict
    predicted_us: float
    query_rows: np.ndarray | None = None   # [max_batch, 4] with max_q_len > 1


def layout_arrays(page_table: PageTable, layout: str, rng=None, spare_columns: int = 0):
    """The batch as the device planner reads it: {"block_table": (seq_lens, table [B, W])} or
    {"flashinfer": (kv_indptr, kv_last_page_len, kv_indices)}, int32. A block table's unused
    entries hold random page ids (never read)."""
    pt = page_table
    if layout == "flashinfer":
        return (pt.kv_indptr.astype(np.int32), pt.kv_last_page_len.astype(np.int32),
                pt.kv_indices.astype(np.int32))
    pages = np.diff(pt.kv_indptr)
    width = int(pages.max(initial=0)) + spare_columns
    rng = rng or np.random.default_rng(0)
    table = rng.integers(0, 1 << 20, (pt.batch_size, max(width, 1))).astype(np.int32)
    for b in range(pt.batch_size):
        table[b, :pages[b]] = pt.kv_indices[pt.kv_indptr[b]:pt.kv_indptr[b + 1]]
    return pt.kv_lens.astype(np.int32), table


def bind_host(params: DevicePlanParams, layout: str, arrays) -> tuple[DevicePlanParams, list]:
    """Point ``params`` at host copies of ``arrays`` (kept alive in the returned list)."""
    keep = [np.ascontiguousarray(a) for a in arrays]
    if layout == "block_table":
        seq_lens, table = keep
        params.seq_lens, params.kv_indices = seq_lens.ctypes.data, table.ctypes.data
        params.kv_indptr = params.kv_last_page_len = None
        params.block_table_stride, params.page_table_entries = table.shape[1], table.size
        params.batch_size = seq_lens.size
    else:
        indptr, last, indices = keep
        if indices.size == 0:
            keep[2] = indices = np.zeros(1, np.int32)[:0]
        params.kv_indptr, params.kv_last_page_len = indptr.ctypes.data, last.ctypes.data
        params.kv_indices = indices.ctypes.data
        params.seq_lens = None
        params.block_table_stride, params.page_table_entries = 0, indices.size
        params.batch_size = last.size
    return params, keep


class HostRun:
    """The buffers of a planner run on the host, kept across plans like the device's."""

    def __init__(self, params: DevicePlanParams, max_q_len: int = 1):
        self.params = params
        params.max_q_len = max_q_len
        # multi-token decode: the query rows buffer (poisoned: every entry must be written)
        self.query_rows = np.full((params.max_batch, 4), -9, np.int32) if max_q_len > 1 else None
        params.query_rows = None if self.query_rows is None else self.query_rows.ctypes.data
        self.records = idle_records(params.max_chunks)
        self.merge_indptr = np.full(params.max_batch + 1, -7, np.int32)
        self.state = np.zeros(len(STATE_FIELDS), np.int32)
        self.predicted = np.zeros(1)
        self.scratch = None

    def plan(self, layout: str, arrays, qo_indptr=None) -> Written:
        p, keep = bind_host(self.params, layout, arrays)
        qo = None if qo_indptr is None else np.ascontiguousarray(qo_indptr, np.int32)
        p.qo_indptr = None if qo is None else qo.ctypes.data
        self.scratch = np.full(scratch_ints(p.max_chunks, p.batch_size), -5, np.int32)
        p.records = self.records.ctypes.data
        p.merge_indptr = self.merge_indptr.ctypes.data
        p.scratch = self.scratch.ctypes.data
        p.state = self.state.ctypes.data
        p.predicted_us = self.predicted.ctypes.data
        host_library().splitkv_plan_on_host(ctypes.byref(p))
        del keep, qo
        return Written(self.records.copy(), self.merge_indptr.copy(),
                       dict(zip(STATE_FIELDS, self.state.tolist())), float(self.predicted[0]),
                       None if self.query_rows is None else self.query_rows.copy())


def expected(page_table: PageTable, model, *, num_qo_heads, num_kv_heads, head_dim, stages,
             max_batch, max_chunks, launch_order, dtype="bfloat16", window_left=-1,
             attention_chunk_size=0):
    """(plan, records [plan's chunks], merge_indptr [max_batch + 1]) as a graph-stable wrapper's
    ``plan()`` uploads them (``window_left``: the plan's, a covering one with query rows)."""
    problem = DecodeProblem.from_page_table(page_table, num_qo_heads, num_kv_heads, head_dim,
                                            dtype, window_left=window_left,
                                            attention_chunk_size=attention_chunk_size)
    plan = choose_plan(problem, model.with_clusters(False), launch_order=launch_order,
                       max_chunks=max_chunks)
    in_record = pages_fit_record(plan, page_table.page_size, stages)
    records = chunk_records(plan, page_table, grid_order(plan),
                            record_pages_needed(page_table.page_size, stages) if in_record else 0)
    merge_indptr = np.zeros(max_batch + 1, np.int32)
    batch = problem.batch_size
    if plan.merge == "merge_kernel":
        merge_indptr[:batch + 1] = plan.merge_indptr
        merge_indptr[batch + 1:] = plan.merge_indptr[-1]
    return plan, records, merge_indptr


def as_block_table_records(records: np.ndarray, stride: int) -> np.ndarray:
    """Host records of a compact page table, as a planner reading a block table of ``stride``
    entries per row writes them: page_table_begin is row b's first entry. (An empty request's
    first_pages, never read, differ: the callers zero them on both sides.)"""
    out = records.copy()
    out["page_table_begin"] = out["request"] * stride
    return out


def empty_request_mask(records: np.ndarray, page_table: PageTable) -> np.ndarray:
    return page_table.kv_lens[np.maximum(records["request"], 0)] == 0


def comparable_records(have: np.ndarray, want: np.ndarray, page_table: PageTable, layout: str,
                       arrays) -> tuple[np.ndarray, np.ndarray]:
    """A planner's first records ``have`` and the host's ``want``, made comparable: for a block
    table, want's page_table_begin as its rows give it, and the empty requests' first_pages
    (never read) zeroed on both sides. Returns copies."""
    have, want = have.copy(), want.copy()
    if layout == "block_table":
        want = as_block_table_records(want, arrays[1].shape[1])
        empty = empty_request_mask(want, page_table)
        want["first_pages"][empty] = 0
        have["first_pages"][empty] = 0
    return have, want


def records_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == CHUNK_RECORD and b.dtype == CHUNK_RECORD and a.tobytes() == b.tobytes()
