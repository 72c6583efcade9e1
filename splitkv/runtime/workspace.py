"""The device workspace of split plans: fp32 partial states (merged by the merge kernel or the
ticket merge) and the ticket merge's arrival counters. It grows with the plans, never shrinks;
or it lives in a buffer the caller owns (``workspace_buffer``), sized with ``workspace_size``
before allocation, as engines budget their memory."""

from __future__ import annotations

import numpy as np

from ..core import validation as V
from ..core.geometry import ctas_per_kv_head
from ..core.plan import Plan
from .streams import stream_pool_array

_ALIGN = 256          # each part on its own 256-byte boundary (16 is what the kernels need)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def layout_bytes(rows: int, counters: int, head_dim: int) -> int:
    """Bytes of ``rows`` partial rows (head_dim + 1 float32 each) and ``counters`` uint32
    counters, each part aligned as a caller's buffer holds them."""
    return _aligned(4 * counters) + _aligned(4 * rows) + _aligned(4 * rows * head_dim)


def workspace_size(num_qo_heads: int, num_kv_heads: int, head_dim: int, *, max_batch_size: int,
                   max_chunks: int, max_q_len: int = 1) -> int:
    """Bytes a ``workspace_buffer`` needs for every plan of at most ``max_chunks`` chunks and
    ``max_batch_size`` requests of up to ``max_q_len`` query rows: a graph-stable wrapper of
    that capacity (its ``max_chunks``), or a per-shape wrapper whose plans stay within it.
    Pure arithmetic: call it before allocating."""
    num_qo_heads, num_kv_heads = V.check_heads(num_qo_heads, num_kv_heads)
    head_dim = V.check_head_dim(head_dim)
    batch = V.check_int("max_batch_size", max_batch_size, 1)
    chunks = V.check_int("max_chunks", max_chunks, 1, V.MAX_CHUNKS, "MAX_CHUNKS")
    q_len = V.check_int("max_q_len", max_q_len, 1)
    heads = num_qo_heads * q_len
    counters = batch * num_kv_heads * ctas_per_kv_head(heads // num_kv_heads)
    return layout_bytes(chunks * heads, counters, head_dim)


class Workspace:
    """partial_o [rows * head_dim] and partial_lse [rows] float32, rows = num_chunks x
    num_qo_heads of the largest plan that merges in memory; counters [batch x num_kv_heads x
    ctas_per_kv_head] uint32, zero between launches. ``buffer``: a caller's contiguous device
    array holding them (``workspace_size`` bytes), never grown: a plan needing more raises."""

    def __init__(self, head_dim: int, buffer=None):
        self.head_dim = head_dim
        self.partial_o = self.partial_lse = self.counters = None
        self._rows = self._counters = 0
        self._partials_stream = self._counters_stream = None   # the streams they were made for
        self._buffer = None
        if buffer is not None:
            from .arrays import as_device_array, itemsize

            arr = as_device_array("workspace_buffer", buffer)
            if not arr.is_contiguous:
                raise ValueError("workspace_buffer: expected a contiguous device array")
            size = int(np.prod(arr.shape)) * (itemsize(arr.dtype) or 0)
            if size == 0:
                raise ValueError(f"workspace_buffer: expected a non-empty device array of a "
                                 f"known dtype, got shape {list(arr.shape)} of {arr.dtype}")
            if arr.ptr % _ALIGN:
                raise ValueError(f"workspace_buffer: expected a {_ALIGN}-byte aligned address "
                                 "(as allocators give)")
            self._buffer, self._buffer_bytes = arr, size

    @property
    def nbytes(self) -> int:
        """Device bytes held: the partial states and the counters (a caller's whole buffer)."""
        if self._buffer is not None:
            return self._buffer_bytes
        return self._rows * (self.head_dim + 1) * 4 + self._counters * 4

    def ensure(self, plan: Plan, ctas_per_kv_head: int, stream) -> None:
        """Grow to fit ``plan``; any fill is enqueued on ``stream`` (the kernels' stream)."""
        # a cluster merge keeps its partials in shared memory: no workspace
        in_memory = plan.merge in ("merge_kernel", "ticket")
        rows = plan.num_chunks * plan.problem.num_qo_heads if in_memory else 1
        counters = max(1, plan.problem.batch_size * plan.problem.num_kv_heads * ctas_per_kv_head)
        self.ensure_size(rows, counters, stream)

    def ensure_size(self, rows: int, counters: int, stream) -> None:
        """Grow to ``rows`` partial rows and ``counters`` ticket counters (a graph-stable
        wrapper asks once, for its capacity, so the addresses never change after)."""
        if self._buffer is not None:
            self._carve(rows, counters, stream)
            return
        import cupy

        # from ``stream``'s pool, as the plan's upload (``streams.stream_pool_array``)
        if rows > self._rows:
            made_for = self._partials_stream if self._rows else None
            self.partial_o = stream_pool_array(rows * self.head_dim, np.float32, stream,
                                               replacing_from=made_for)
            self.partial_lse = stream_pool_array(rows, np.float32, stream)
            self._rows, self._partials_stream = rows, stream.ptr
        if counters > self._counters:
            if self._counters and self._counters_stream != stream.ptr:
                # the old counters, made for another stream, may still be read by a run
                cupy.cuda.runtime.deviceSynchronize()
            self._counters_stream = stream.ptr
            # Zeroed once: a fused run leaves every ticket counter at 0 again (atomicInc wraps
            # on the last arrival), so later plans need no fill (a launch per plan() call).
            with stream:
                self.counters = cupy.zeros(counters, dtype=np.uint32)
            self._counters = counters

    def _carve(self, rows: int, counters: int, stream) -> None:
        """The parts as views of the caller's buffer: counters first (zeroed when they grow),
        then partial_lse and partial_o."""
        import cupy

        rows, counters = max(rows, self._rows), max(counters, self._counters)
        if (rows, counters) == (self._rows, self._counters):
            return
        need = layout_bytes(rows, counters, self.head_dim)
        if need > self._buffer_bytes:
            raise ValueError(f"workspace_buffer: this plan needs {need} bytes (workspace_size() "
                             f"of its chunks and batch), the buffer holds {self._buffer_bytes}")
        base = self._buffer.ptr
        memory = cupy.cuda.UnownedMemory(base, need, self._buffer.owner)

        def view(offset: int, count: int, dtype):
            return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(memory, offset))

        lse_at = _aligned(4 * counters)
        o_at = lse_at + _aligned(4 * rows)
        grew = counters > self._counters
        self.counters = view(0, counters, np.uint32)
        self.partial_lse = view(lse_at, rows, np.float32)
        self.partial_o = view(o_at, rows * self.head_dim, np.float32)
        if grew:                    # zero between launches, as the kernels leave them
            with stream:
                self.counters.fill(0)
        self._rows, self._counters = rows, counters

