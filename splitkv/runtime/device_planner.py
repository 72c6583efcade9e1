"""The planner on the GPU (``kernels_cu/device_plan.cu``): a one-CTA kernel that reads the batch's
lengths from device memory (vLLM's ``seq_lens`` and block table, or FlashInfer's ``kv_indptr``
and ``kv_last_page_len``), chooses a plan with the same fitted cost model as the host planner,
and writes the chunk records a graph-stable wrapper's fixed grid reads. Captured in a CUDA graph
before the decode kernels, it lets one graph serve every step of a decode loop with no host work.

The kernel is the host planner written again (``device_plan.cuh`` says how the two are kept
equal); ``DevicePlanParams`` here mirrors its argument. ``plan_params`` fills the constants on
the host and needs neither CuPy nor a GPU (the CPU tests run the same source through the host
compiler with it); ``DevicePlanner`` owns the device buffers and the launch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..core.builds import LONG_CHUNK_TOKENS
from ..core.execution import LAUNCH_ORDERS
from ..core.validation import STRATEGIES
from ..core.geometry import RECORD_PAGES, TILE_TOKENS, ctas_per_kv_head
from ..planner.cost_model import CostModel
from ..planner.expressions import cpp_statements, inputs
from ..planner.features import (FEATURE_NAMES, FEATURES, ROW_CONSTANTS, ROW_EXPRESSIONS,
                                ROW_INPUTS, build_tile_units, feature_constants,
                                stream_ratio_of)
from . import kernel_abi
from .kernel_abi import CHUNK_RECORD
from .kernel_source import NVRTC_OPTIONS, read_source
from .records import idle_records, record_pages_needed

_POINTER = ctypes.c_void_p
_FEATURES = len(FEATURE_NAMES)

PLAN_THREADS = 512                  # device_plan.cu's PLAN_THREADS
PLAN_STAMPS = 10                    # device_plan.cu's PLAN_STAMPS: the phase build's clock stamps
# The kernel keeps its scratch in dynamic shared memory up to this: with its ~6 KiB of static
# shared memory, within the 99 KiB a block may opt in to on every GPU of compute capability
# 8.0+ (the H200: 227 KiB). Larger scratch stays in global memory.
MAX_SHARED_SCRATCH_BYTES = 64 * 1024
# The planning kernel's compile options: no FMA contraction, so the float64 formulas round as
# NumPy's (device_plan.cuh).
PLAN_NVRTC_OPTIONS = (*NVRTC_OPTIONS, "--fmad=false")


class DevicePlanParams(ctypes.Structure):
    """``device_plan::DevicePlanParams`` (device_plan.cuh says what each field holds)."""

    _fields_ = [
        ("seq_lens", _POINTER), ("kv_indptr", _POINTER), ("kv_last_page_len", _POINTER),
        ("kv_indices", _POINTER), ("block_table_stride", ctypes.c_int64),
        ("page_table_entries", ctypes.c_int64), ("records", _POINTER),
        ("merge_indptr", _POINTER), ("scratch", _POINTER), ("state", _POINTER),
        ("predicted_us", _POINTER), ("coef", ctypes.c_double * _FEATURES),
        ("unit", ctypes.c_double * _FEATURES), ("stream_ratio", ctypes.c_double),
        ("batch_size", ctypes.c_int32), ("max_batch", ctypes.c_int32),
        ("max_chunks", ctypes.c_int32), ("items_per_chunk", ctypes.c_int32),
        ("slots", ctypes.c_int32), ("num_sms", ctypes.c_int32), ("page_size", ctypes.c_int32),
        ("record_pages", ctypes.c_int32), ("launch_order", ctypes.c_int32),
        ("scratch_in_shared", ctypes.c_int32), ("qo_indptr", _POINTER),
        ("query_rows", _POINTER), ("max_q_len", ctypes.c_int32),
        ("window_left", ctypes.c_int32), ("rows_window_left", ctypes.c_int32),
        ("attention_chunk_size", ctypes.c_int32),
        ("tile_units", ctypes.c_int32 * 4), ("long_chunk_tokens", ctypes.c_double),
    ]


# device_plan::DevicePlanState, int32 each, in order.
STATE_FIELDS = ("filled", "error", "error_request", "num_chunks", "pair", "value", "kind",
                "strategy", "merge", "plans")
ROW_KINDS = ("no split", "chunk tokens", "num splits")
MERGES = ("none", "merge_kernel", "ticket")
ERRORS = {1: "a negative sequence length", 2: "more pages than its block-table row holds",
          3: "kv_indptr not non-decreasing, negative, or past kv_indices",
          4: "kv_last_page_len outside 1..page_size (0 for a request without pages)",
          5: "qo_indptr: query rows not 1..max_q_len, more than the request's tokens, past q's "
             "rows, or qo_indptr[0] != 0 (no output of the batch is written)"}


def scratch_ints(max_chunks: int, batch_size: int) -> int:
    """DEVICE_PLAN_SCRATCH_INTS."""
    return 5 * max_chunks + 5 * batch_size + 8


def plan_params(model: CostModel, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int, stages: int, max_batch: int, max_chunks: int,
                launch_order: str, tile_tokens: int = TILE_TOKENS) -> DevicePlanParams:
    """The constants of a planning kernel's argument (no pointers, no batch): the model's
    coefficients, the shape's units and the tiles the model counts (``build_tile_units``: the
    builds' per grid, as ``core.builds`` decides them), for a GPU without clusters (a
    graph-stable grid)."""
    ipc, slots, units = feature_constants(num_qo_heads, num_kv_heads, head_dim, model.num_sms,
                                          model.ctas_per_sm, model.bandwidth_gbps)
    p = DevicePlanParams()
    p.coef[:] = [float(c) for c in model.coef_]
    p.unit[:] = [float(u) for u in units[:, 0]]
    p.stream_ratio = stream_ratio_of(model.bandwidth_gbps)
    p.max_batch, p.max_chunks = max_batch, max_chunks
    p.items_per_chunk = num_kv_heads * ctas_per_kv_head(num_qo_heads // num_kv_heads)
    assert p.items_per_chunk == ipc
    p.slots, p.num_sms, p.page_size = slots, model.num_sms, page_size
    needed = record_pages_needed(page_size, stages, tile_tokens)
    p.record_pages = needed if needed <= RECORD_PAGES else 0
    p.launch_order = LAUNCH_ORDERS.index(launch_order)
    p.window_left = p.rows_window_left = -1
    p.attention_chunk_size = 0
    p.tile_units[:] = build_tile_units(model.tile_rule, num_qo_heads, num_kv_heads, head_dim,
                                       page_size, model.num_sms)
    p.long_chunk_tokens = float(LONG_CHUNK_TOKENS)
    return p


def layout_fields() -> list:
    """The device planner's mirrored structs, as ``kernel_abi.fields()`` lists them."""
    state = [("DevicePlanState", name, 4 * i, 4, kernel_abi.ABI_KINDS[ctypes.c_int32])
             for i, name in enumerate(STATE_FIELDS)]
    return (kernel_abi.struct_fields("DevicePlanParams", DevicePlanParams) + state
            + kernel_abi.record_fields("Record", header=""))


def layout_checks() -> str:
    """static_asserts for device_plan.cu: ``DevicePlanParams`` and ``DevicePlanState`` are laid
    out as mirrored here, ``Record`` as ``ChunkRecord``, and the launch orders, strategies and
    merges are numbered as the host numbers them: a planner whose structs or constants differ
    does not compile. (Its feature columns and rows are written from the host's tables:
    ``feature_table_source``, ``row_table_source``.)"""
    constants = {"LONGEST_CHUNKS": LAUNCH_ORDERS.index("longest_chunks"),
                 "LONGEST_REQUESTS": LAUNCH_ORDERS.index("longest_requests"),
                 **{code: STRATEGIES.index(name) for code, name in (
                     ("SINGLE", "single"), ("SPLIT_MERGE", "split_merge"), ("FUSED", "fused"))},
                 **{code: MERGES.index(name) for code, name in (
                     ("MERGE_NONE", "none"), ("MERGE_KERNEL", "merge_kernel"),
                     ("MERGE_TICKET", "ticket"))}}
    sizes = {"DevicePlanParams": ctypes.sizeof(DevicePlanParams),
             "DevicePlanState": 4 * len(STATE_FIELDS), "Record": CHUNK_RECORD.itemsize}
    return kernel_abi.static_asserts(sizes, constants, layout_fields(),
                                     "differs from runtime/device_planner.py")


def feature_table_source() -> str:
    """The cost model's columns for device_plan.cuh, from ``planner.features.FEATURES``: their
    count, and ``DEVICE_PLAN_FEATURES(X)``, X(column, row, the row 'split_merge' reads, the
    code of the strategy that alone pays it or -1) for each column in order. The rows are
    members of the header's FeatureRows (``row_table_source``), so a column whose row the
    device does not compute does not compile."""
    lines = [f"#define DEVICE_PLAN_NUM_FEATURES {len(FEATURES)}",
             "#define DEVICE_PLAN_FEATURES(X) \\"]
    for i, f in enumerate(FEATURES):
        paid_by = -1 if f.paid_by is None else STRATEGIES.index(f.paid_by)
        lines.append(f"  X({i}, {f.row}, {f.split_merge_row or f.row}, {paid_by}) "
                     f"/* {f.name} */ \\")
    return "\n".join(lines) + "\n\n"


def row_members(expressions: dict | None = None) -> tuple[str, ...]:
    """FeatureRows' members in order: the input rows some column reads (the statistics and
    'clustered'), then every row of ``expressions`` (``ROW_EXPRESSIONS``)."""
    expressions = ROW_EXPRESSIONS if expressions is None else expressions
    read = {name for f in FEATURES for name in (f.row, f.split_merge_row) if name}
    return tuple(name for name in ROW_INPUTS if name in read) + tuple(expressions)


def row_table_source(expressions: dict | None = None) -> str:
    """The cost model's rows for device_plan.cuh, from ``planner.features.ROW_EXPRESSIONS``
    (or ``expressions``): ``DEVICE_PLAN_ROW_INPUTS`` and ``DEVICE_PLAN_ROW_MEMBERS``, the
    members of its RowInputs (``ROW_INPUTS`` then ``ROW_CONSTANTS``, float64 each) and
    FeatureRows (``row_members``), and ``DEVICE_PLAN_ROWS(in, r)``, the statements that compute
    r's rows from in, one operation each in the order the host's NumPy runs them
    (``expressions.cpp_statements``)."""
    expressions = ROW_EXPRESSIONS if expressions is None else expressions
    members = row_members(expressions)
    row_inputs = vars(inputs(*ROW_INPUTS))
    outputs = {name: row_inputs[name] for name in members if name in ROW_INPUTS}
    outputs.update(expressions)
    statements = cpp_statements(outputs, "in", "r")
    lines = [f"#define DEVICE_PLAN_ROW_INPUTS double {', '.join(ROW_INPUTS + ROW_CONSTANTS)};",
             f"#define DEVICE_PLAN_ROW_MEMBERS double {', '.join(members)};",
             "#define DEVICE_PLAN_ROWS(in, r) \\"]
    lines += [f"  {line} \\" for line in statements]
    return "\n".join(lines) + "\n\n"


def header_defines(expressions: dict | None = None) -> str:
    """What device_plan.cuh needs defined before it, but DEVICE_PLAN_HD: the record's page
    slots, the cost model's columns and its rows (``expressions``: the rows of another table,
    for tests)."""
    return (f"#define RECORD_PAGES {RECORD_PAGES}\n" + feature_table_source()
            + row_table_source(expressions))


def source(phases: bool = False) -> str:
    """The planning kernel's whole source; ``phases``: with the step stamps (DEVICE_PLAN_PHASES)."""
    return (("#define DEVICE_PLAN_PHASES\n" if phases else "") + header_defines()
            + read_source("device_plan.cu") + layout_checks())


@dataclass(frozen=True)
class BatchArrays:
    """The device arrays a planning kernel reads (pointers and sizes), as bound."""

    layout: str                 # "block_table" or "flashinfer"
    pointers: tuple             # seq_lens, kv_indptr, kv_last_page_len, kv_indices
    batch_size: int
    block_table_stride: int
    page_table_entries: int
    qo_indptr: int = 0          # multi-token decode's qo_indptr [batch + 1]; 0: none


def device_batch(*, max_batch: int, device: int,
                 seq_lens=None, block_table=None, kv_indptr=None, kv_indices=None,
                 kv_last_page_len=None, qo_indptr=None) -> tuple[BatchArrays, list]:
    """The batch arrays of ``plan_on_device`` checked on the host (shapes, dtypes, device,
    layout; their values are the kernel's to check), and the arrays themselves (to keep);
    ``qo_indptr`` (multi-token decode) a device int32 [batch + 1] too."""
    from .arrays import as_device_array

    vllm, flashinfer = (seq_lens, block_table), (kv_indptr, kv_indices, kv_last_page_len)
    given = [name for name, parts in (("block_table/seq_lens", vllm),
                                      ("kv_indptr/kv_indices/kv_last_page_len", flashinfer))
             if any(a is not None for a in parts)]
    if len(given) != 1:
        raise TypeError("plan_on_device: give the batch as vLLM's seq_lens and block_table, or "
                        "FlashInfer's kv_indptr, kv_indices and kv_last_page_len (device int32 "
                        "arrays); got " + (" and ".join(given) or "none"))
    names = ("seq_lens", "block_table") if given[0].startswith("block") else (
        "kv_indptr", "kv_indices", "kv_last_page_len")
    arrays = []
    for name, obj in zip(names, vllm if len(names) == 2 else flashinfer):
        if obj is None:
            raise TypeError(f"{name}: this layout needs {', '.join(names)}")
        a = as_device_array(name, obj)
        if a.dtype != "int32":
            raise TypeError(f"{name}: expected an int32 device array, got {a.dtype}")
        if a.device is not None and a.device != device:
            raise ValueError(f"{name}: on device {a.device}, the wrapper's plans are on {device}")
        if not a.is_contiguous:
            raise ValueError(f"{name}: expected a contiguous array (strides {a.strides})")
        arrays.append(a)
    if len(names) == 2:
        lens, table = arrays
        if len(lens.shape) != 1 or len(table.shape) != 2 or table.shape[0] != lens.shape[0]:
            raise ValueError(f"block_table: expected [batch, max_pages] beside seq_lens [batch]; "
                             f"got {table.shape} and {lens.shape}")
        batch, entries = lens.shape[0], table.shape[0] * table.shape[1]
        if table.shape[1] < 1:
            raise ValueError("block_table: expected at least one column")
        pointers, stride = (lens.ptr, None, None, table.ptr), table.shape[1]
    else:
        indptr, indices, last = arrays
        if len(indptr.shape) != 1 or len(last.shape) != 1 or len(indices.shape) != 1 \
                or indptr.shape[0] != last.shape[0] + 1:
            raise ValueError(f"kv_indptr: expected [batch + 1] beside kv_last_page_len [batch] "
                             f"and a 1-D kv_indices; got {indptr.shape}, {last.shape} and "
                             f"{indices.shape}")
        batch, entries = last.shape[0], indices.shape[0]
        pointers, stride = (None, indptr.ptr, last.ptr, indices.ptr), 0
    if not 1 <= batch <= max_batch:
        raise ValueError(f"{names[0]}: {batch} requests; a graph-stable wrapper plans 1 to "
                         f"max_batch_size={max_batch}")
    # (max_num_pages sizes plan()'s upload; the kernel reads this table in place, any size)
    if entries >= 2**31:
        raise ValueError(f"{names[1]}: at most 2**31 - 1 page-table entries")
    qo_ptr = 0
    if qo_indptr is not None:
        qo = as_device_array("qo_indptr", qo_indptr)
        if qo.dtype != "int32":
            raise TypeError(f"qo_indptr: expected an int32 device array, got {qo.dtype}")
        if qo.device is not None and qo.device != device:
            raise ValueError(f"qo_indptr: on device {qo.device}, the wrapper's plans are on "
                             f"{device}")
        if len(qo.shape) != 1 or qo.shape[0] != batch + 1 or not qo.is_contiguous:
            raise ValueError(f"qo_indptr: expected a contiguous [batch + 1] = [{batch + 1}] "
                             f"array, got shape {qo.shape}")
        arrays.append(qo)
        qo_ptr = qo.ptr
    layout = "block_table" if len(names) == 2 else "flashinfer"
    return BatchArrays(layout, pointers, batch, stride, entries, qo_ptr), arrays


class DevicePlanner:
    """The planning kernel of one graph-stable wrapper: its argument, scratch and state on the
    device; ``launch`` enqueues it (capturable: no allocation, no host wait)."""

    phases = False      # launch the build that stamps its steps (set, then bind again)

    def __init__(self, params: DevicePlanParams, batch: BatchArrays, arrays: list,
                 records_ptr: int, merge_indptr_ptr: int, stream, query_rows_ptr: int = 0,
                 max_q_len: int = 1):
        import cupy

        # made on the plan's stream (a zero fill elsewhere could land after the first plan);
        # the scratch for the largest batch, so that rebinding a smaller one never moves it
        with stream:
            self._scratch = cupy.empty(scratch_ints(params.max_chunks, params.max_batch),
                                       np.int32)
            self._state = cupy.zeros(len(STATE_FIELDS), np.int32)
            self._predicted = cupy.zeros(1, np.float64)
        p = params
        p.records, p.merge_indptr = records_ptr, merge_indptr_ptr
        p.query_rows, p.max_q_len = query_rows_ptr, max_q_len
        p.scratch, p.state = self._scratch.data.ptr, self._state.data.ptr
        p.predicted_us = self._predicted.data.ptr
        self.params = p
        self._capacity_chunks = p.max_chunks
        # every record starts idle: later plans rewrite only those the previous one used
        idle = idle_records(params.max_chunks).view(np.int32)
        memory = cupy.cuda.UnownedMemory(records_ptr, idle.nbytes, self)
        records = cupy.ndarray(idle.shape, np.int32, cupy.cuda.MemoryPointer(memory, 0))
        records.set(idle, stream=stream)
        stream.synchronize()
        self._args = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        self._inputs, self._input_ptrs, self._sm_scale = None, None, None
        self.bind(batch, arrays)

    def bind(self, batch: BatchArrays, arrays: list, max_chunks: int | None = None) -> None:
        """Read ``batch``'s arrays from the next launch on (a capture holds the arrays of its
        launch): an engine's graph per batch size binds that size's views. ``arrays``: the
        objects behind them, kept alive while the kernel reads them. ``max_chunks``: the
        chunks of the grid that runs this batch size (at most the capacity's, which the
        scratch and the records are sized for)."""
        from .launch import KernelLaunch

        p = self.params
        if max_chunks is not None:
            if not 1 <= max_chunks <= self._capacity_chunks:
                raise ValueError(f"max_chunks: {max_chunks} is outside 1..{self._capacity_chunks}")
            p.max_chunks = max_chunks
        p.seq_lens, p.kv_indptr, p.kv_last_page_len, p.kv_indices = batch.pointers
        p.block_table_stride, p.page_table_entries = batch.block_table_stride, batch.page_table_entries
        p.batch_size = batch.batch_size
        # multi-token decode: the query rows the decode kernels read, from qo_indptr (or one
        # row a request)
        p.qo_indptr = batch.qo_indptr
        shared = 4 * scratch_ints(p.max_chunks, batch.batch_size)
        p.scratch_in_shared = int(shared <= MAX_SHARED_SCRATCH_BYTES)
        self._launch = KernelLaunch(plan_kernel(self.phases), 1, PLAN_THREADS,
                                    shared if p.scratch_in_shared else 0)
        self.batch, self.arrays = batch, arrays

    def remember(self, inputs: tuple, sm_scale) -> None:
        """The objects ``plan_on_device`` was first given (and their addresses), so that a
        later call with the very same ones may skip their checks."""
        self._inputs, self._sm_scale = inputs, sm_scale
        self._input_ptrs = tuple(_data_ptr(a) for a in inputs)

    def same_inputs(self, inputs: tuple, sm_scale) -> bool:
        """The remembered objects, still at their addresses (a tensor's storage can move)."""
        return (sm_scale == self._sm_scale and all(a is b for a, b in zip(inputs, self._inputs))
                and all(_data_ptr(a) == p for a, p in zip(inputs, self._input_ptrs)))

    def written(self) -> tuple[np.ndarray, np.ndarray]:
        """The records [max_chunks] and merge_indptr [max_batch + 1] on the device, copied to
        the host (waits for the device): what the last plan wrote."""
        import cupy

        cupy.cuda.Device().synchronize()
        p = self.params
        host = []
        for ptr, count in ((p.records, self._capacity_chunks * CHUNK_RECORD.itemsize // 4),
                           (p.merge_indptr, p.max_batch + 1)):
            memory = cupy.cuda.UnownedMemory(ptr, count * 4, self)
            array = cupy.ndarray((count,), np.int32, cupy.cuda.MemoryPointer(memory, 0))
            host.append(array.get())
        return host[0].view(CHUNK_RECORD), host[1]

    def launch(self, stream_ptr: int) -> None:
        self._launch(self._args, stream_ptr)

    def state(self) -> dict:
        """The last plan, read back (waits for the device): its row, strategy, merge, chunks and
        prediction, and the first error since ``clear_error``."""
        import cupy

        cupy.cuda.Device().synchronize()        # the plan may have run on any stream
        values = dict(zip(STATE_FIELDS, (int(v) for v in self._state.get())))
        values["predicted_us"] = float(self._predicted.get()[0])
        values["kind"] = ROW_KINDS[values["kind"]]
        values["strategy"] = ("single", "split_merge", "fused")[values["strategy"]]
        values["merge"] = MERGES[values["merge"]]
        values["error"] = ERRORS.get(values["error"]) if values["error"] else None
        return values

    def clear_error(self, stream) -> None:
        """Forget the recorded error (on ``stream``, ordered after the plans before it)."""
        with stream:
            self._state[1:3].fill(0)


_KERNELS: dict[int, object] = {}
_PHASE_KERNELS: dict[int, tuple] = {}     # device -> (module, kernel) built to stamp its steps


def plan_kernel(phases: bool = False):
    """The compiled planning kernel for the current device (cached); ``phases``: the build that
    stamps the SM clock at each step (``phase_clocks``), for measuring where its time goes."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if phases:
        if device not in _PHASE_KERNELS:
            module = cupy.RawModule(code=source(phases=True), options=PLAN_NVRTC_OPTIONS)
            kernel = module.get_function("plan_decode")
            kernel.max_dynamic_shared_size_bytes = MAX_SHARED_SCRATCH_BYTES
            _PHASE_KERNELS[device] = (module, kernel)
        return _PHASE_KERNELS[device][1]
    kernel = _KERNELS.get(device)
    if kernel is None:
        from .modules import PLANNER_LABEL, load_module

        module, _ = load_module(source(), PLAN_NVRTC_OPTIONS, PLANNER_LABEL)
        kernel = module.get_function("plan_decode")
        kernel.max_dynamic_shared_size_bytes = MAX_SHARED_SCRATCH_BYTES
        _KERNELS[device] = kernel
    return kernel


def phase_clocks() -> np.ndarray:
    """The SM clock as the phase build started, at the start of its steps (the first step's
    twice: again once thread 0 read its request) and at its end (``PLAN_STAMPS`` int64), as its
    last launch on the current device stamped them (waits for the device)."""
    import cupy

    cupy.cuda.Device().synchronize()
    module, _ = _PHASE_KERNELS[cupy.cuda.runtime.getDevice()]
    stamps = module.get_global("device_plan_phases")
    return cupy.ndarray((PLAN_STAMPS,), np.int64, stamps).get()


def _data_ptr(obj) -> int | None:
    """An array's device address, cheaply (CuPy, torch), or None."""
    if obj is None:
        return None
    data = getattr(obj, "data", None)
    if hasattr(data, "ptr"):
        return int(data.ptr)
    if callable(getattr(obj, "data_ptr", None)):
        return int(obj.data_ptr())
    return id(obj)
