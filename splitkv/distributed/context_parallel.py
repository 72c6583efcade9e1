"""Context-parallel decode: every rank attends over its shard of each request's KV, then the
ranks all-gather their (output, LSE) states and each merges them into the full answer.

    group = init_process_group()
    shard = shard_page_table(page_table, group.world_size)[group.rank]
    local_table, page_ids = compact_page_table(shard)        # this rank's pages only
    cp = ContextParallelDecode(group, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                               page_size=16, dtype="bfloat16")
    cp.plan(local_table)                                       # collective: every rank calls it
    out = cp.run(q, k_local, v_local)                          # same q on every rank

Per call: the local splitkv kernels (LSE returned), one conversion of the local output to
float32 into the send buffer [batch, num_qo_heads, head_dim + 1] (LSE in the last column), ONE
NCCL all-gather, ``merge_states_n`` over the ranks, and the cast to the query dtype. All on the
caller's stream with no host synchronisation, so a whole decode step can be captured in a CUDA
graph (pass ``out`` so its address is fixed).
"""

from __future__ import annotations

import numpy as np

from ..core import validation as V
from ..core.plan import Plan
from ..core.problem import PageTable
from ..runtime.arrays import as_cupy_stream, as_device_array, cupy_storage_dtype
from ..runtime.cupy_arrays import allocating_from, check_cupy_array, empty, new_memory_pool
from .states import merge_gathered, pack_state, store_output


class ContextParallelDecode:
    """Decode attention over a KV cache sharded by token ranges across the ranks of ``group``.

    On every rank: q [batch, num_qo_heads, head_dim], the same values everywhere; k_cache,
    v_cache [num_pages, page_size, num_kv_heads, head_dim] (NHD) holding this rank's pages;
    a page table of this rank's shard with the same batch size on every rank (a request this
    rank holds nothing of has length 0). Output [batch, num_qo_heads, head_dim] in the query
    dtype (bfloat16 as uint16 bits unless CuPy has a bfloat16 dtype), identical on every rank;
    LSE [batch, num_qo_heads] float32, natural log, over the whole KV.

    Precision: each rank's partial output is rounded once to the query dtype by the kernel,
    then exchanged and merged in float32.
    """

    def __init__(self, group, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", **wrapper_kwargs):
        from ..runtime.wrapper import BatchDecodeWrapper

        if "max_q_len" in wrapper_kwargs:
            raise ValueError("max_q_len: context-parallel decode has one query row a request "
                             "(a row's causal end is a position in the whole KV, which a "
                             "rank's shard does not hold)")
        self.group = group
        self.wrapper = BatchDecodeWrapper(num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                                          **wrapper_kwargs)
        self.dtype = self.wrapper.dtype
        # The merge allocates temporaries; drawing them from a pool of their own keeps the
        # addresses a captured graph uses away from everything else.
        self._pool = new_memory_pool()
        self._batch = -1

    @property
    def current_plan(self) -> Plan | None:
        return self.wrapper.current_plan

    def plan(self, page_table: PageTable, *, stream=None, **plan_kwargs) -> Plan:
        """Plan the local shard (``BatchDecodeWrapper.plan`` arguments pass through). A
        collective: it checks that every rank has the same batch size, and raises on all
        ranks if not, rather than leaving the all-gather to hang."""
        V.check_instance("page_table", page_table, PageTable)
        # Positions are the request's: a rank's shard ends wherever its tokens end, so a
        # causal end or a window measured from it would be wrong.
        for name in ("qo_indptr", "window_left"):
            if plan_kwargs.get(name) not in (None, -1):
                raise ValueError(f"{name}: context-parallel decode takes one query row a "
                                 "request and no window (positions are the whole KV's, which "
                                 "a rank's shard does not hold)")
        sizes = self.group.gather_host([page_table.batch_size], stream)[:, 0].astype(int)
        if (sizes != sizes[0]).any():
            raise ValueError(f"page_table: the ranks' batch sizes differ ({sizes.tolist()}); every "
                             "rank needs a table of the whole batch (length 0 where it holds nothing)")
        plan = self.wrapper.plan(page_table, stream=stream, **plan_kwargs)
        batch = page_table.batch_size
        if batch != self._batch:
            w = self.wrapper
            shape = (batch, w.num_qo_heads, w.head_dim)
            self._local_out = empty(shape, cupy_storage_dtype(self.dtype))
            self._local_lse = empty(shape[:2], np.float32)
            self._send = empty(shape[:2] + (w.head_dim + 1,), np.float32)
            self._recv = empty((self.group.world_size,) + self._send.shape, np.float32)
            self._batch = batch
        return plan

    def run(self, q, k_cache, v_cache, *, out=None, lse=None, return_lse: bool = False, stream=None):
        """Attention over the whole (sharded) KV. Returns ``out``, or ``(out, lse)`` if
        ``return_lse`` or ``lse`` is given. ``out``: a CuPy array [batch, num_qo_heads,
        head_dim] of the query dtype (or uint16 for bfloat16); ``lse``: CuPy float32."""
        self.run_local(q, k_cache, v_cache, stream=stream)
        return self.exchange_merge(out=out, lse=lse, return_lse=return_lse, stream=stream)

    def run_local(self, q, k_cache, v_cache, *, stream=None) -> None:
        """The splitkv kernels on this rank's shard, into the local state buffers."""
        if self.wrapper.current_plan is None:
            raise RuntimeError("run: call plan() first")
        self.wrapper.run(q, k_cache, v_cache, out=self._local_out, lse=self._local_lse,
                         stream=stream)

    def exchange_merge(self, *, out=None, lse=None, return_lse: bool = False, stream=None):
        """Pack the local state, all-gather it, merge, write ``out`` (and ``lse``)."""
        if self.wrapper.current_plan is None:
            raise RuntimeError("run: call plan() first")
        s = as_cupy_stream(stream)
        shape = self._local_out.shape
        with s:
            if out is None:
                out = empty(shape, cupy_storage_dtype(self.dtype))
            if lse is None and return_lse:
                lse = empty(shape[:2], np.float32)
        _check_output("out", out, shape, self.dtype)
        if lse is not None:
            _check_output("lse", lse, shape[:2], "float32")
        if shape[0] == 0:       # every rank agrees (plan checked the batch sizes): nothing to send
            return (out, lse) if lse is not None else out
        with s, allocating_from(self._pool):
            pack_state(self._local_out, self._local_lse, self._send, self.dtype)
            self.group.all_gather(self._send, self._recv, s)
            merged_o, merged_lse = merge_gathered(self._recv)
            store_output(merged_o, out, self.dtype)
            if lse is not None:
                lse[...] = merged_lse
        return (out, lse) if lse is not None else out


def _check_output(name: str, arr, shape, dtype: str) -> None:
    check_cupy_array(name, arr)
    V.check_device_output(name, as_device_array(name, arr), shape, dtype)
