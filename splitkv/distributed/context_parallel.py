"""Context-parallel decode: every rank attends over its shard of each request's KV, then the
ranks all-gather their (output, LSE) states and each merges them into the full answer.

    # under `torchrun --nproc-per-node N script.py`
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    shard = shard_page_table(page_table, dist.get_world_size())[dist.get_rank()]
    local_table, page_ids = compact_page_table(shard)        # this rank's pages only
    cp = ContextParallelDecode(dist.group.WORLD, num_qo_heads=32, num_kv_heads=8,
                               head_dim=128, page_size=16, dtype="bfloat16")
    cp.plan(local_table)                                       # collective: every rank calls it
    out = cp.run(q, k_local, v_local)                          # same q on every rank

Per call on the GPU: the local splitkv kernels (LSE returned), ONE kernel packing the local
state into the float32 send buffer [batch, num_qo_heads, head_dim + 1] (LSE in the last
column), ONE all-gather through the caller's group, and ONE kernel that reads the gathered
states and writes the merged output already in the query dtype (and the LSE). All ordered on
the caller's stream with no host synchronisation, so a whole decode step can be captured in a
CUDA graph where the group's NCCL call captures (pass ``out`` so its address is fixed).

The CPU path (a gloo group, or ``device="cpu"``) runs the same steps with the float64 plan
executor and NumPy (``states.py``): what the multi-process tests run without a GPU.
"""

from __future__ import annotations

import numpy as np

from ..core import validation as V
from ..core.plan import Plan
from ..core.problem import PageTable
from .groups import as_group
from .host_decode import HostDecode, storage_dtype
from .states import merge_gathered, pack_state, store_output


class ContextParallelDecode:
    """Decode attention over a KV cache sharded by token ranges across the ranks of ``group``.

    ``group``: a ``torch.distributed`` ProcessGroup (NCCL for the GPU; gloo, or any backend
    that gathers host tensors, for the CPU path), None for torch's default group, or a CuPy
    communicator from ``cupyx.distributed.init_process_group``. ``device``: "cuda" or "cpu";
    None follows the group (NCCL: "cuda"). ``timeout_s``: the host waits of a CuPy
    communicator (torch groups use their own ``timeout``). Other keyword arguments go to the
    GPU's ``BatchDecodeWrapper``.

    On every rank: q [batch, num_qo_heads, head_dim], the same values everywhere; k_cache,
    v_cache [num_pages, page_size, num_kv_heads, head_dim] (NHD) holding this rank's pages;
    a page table of this rank's shard with the same batch size on every rank (a request this
    rank holds nothing of has length 0). Output [batch, num_qo_heads, head_dim] in the query
    dtype (bfloat16 as uint16 bits unless CuPy has a bfloat16 dtype), identical on every rank;
    LSE [batch, num_qo_heads] float32, natural log, over the whole KV.

    Precision: each rank's partial output is rounded once to the query dtype by the kernel,
    then exchanged and merged in float32. The CPU path with dtype "float64" keeps float64
    throughout (the exact path).
    """

    def __init__(self, group, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", *, device: str | None = None, timeout_s: float | None = None,
                 **wrapper_kwargs):
        if "max_q_len" in wrapper_kwargs:
            raise ValueError("max_q_len: context-parallel decode has one query row a request "
                             "(a row's causal end is a position in the whole KV, which a "
                             "rank's shard does not hold)")
        self.group = as_group(group, device=device, timeout_s=timeout_s)
        self.device = self.group.device
        if self.device == "cuda":
            from ..runtime.wrapper import BatchDecodeWrapper

            self.wrapper = BatchDecodeWrapper(num_qo_heads, num_kv_heads, head_dim, page_size,
                                              dtype, **wrapper_kwargs)
        else:
            self.wrapper = HostDecode(num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                                      **wrapper_kwargs)
        self.dtype = self.wrapper.dtype
        self._batch = -1

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def current_plan(self) -> Plan | None:
        return self.wrapper.current_plan

    def plan(self, page_table: PageTable, *, stream=None, **plan_kwargs) -> Plan:
        """Plan the local shard (``BatchDecodeWrapper.plan`` arguments pass through; the CPU
        path takes ``num_splits``, ``strategy``, ``plan``, ``sm_scale``, ``logits_soft_cap``). A
        collective: it checks that every rank has the same batch size, and raises on all
        ranks if not, rather than leaving the all-gather to hang."""
        V.check_instance("page_table", page_table, PageTable)
        # Positions are the request's: a rank's shard ends wherever its tokens end, so a
        # causal end, a window, a chunk or ALiBi's distance measured from it would be wrong.
        for name, off in (("qo_indptr", None), ("window_left", -1),
                          ("attention_chunk_size", 0), ("alibi_slopes", None)):
            value = plan_kwargs.get(name)
            if value is not None and not (np.ndim(value) == 0 and value == off):
                raise ValueError(f"{name}: context-parallel decode takes one query row a "
                                 "request, no window, no attention chunks and no ALiBi "
                                 "(positions are the whole KV's, which a rank's shard does not "
                                 "hold)")
        sizes = self.group.gather_host([page_table.batch_size], stream)[:, 0].astype(int)
        if (sizes != sizes[0]).any():
            raise ValueError(f"page_table: the ranks' batch sizes differ ({sizes.tolist()}); "
                             "every rank needs a table of the whole batch (length 0 where it "
                             "holds nothing)")
        plan = self.wrapper.plan(page_table, stream=stream, **plan_kwargs)
        if page_table.batch_size != self._batch:
            self._allocate(page_table.batch_size)
        return plan

    def _allocate(self, batch: int) -> None:
        """The local state, send and receive buffers of ``batch`` requests, and the bound
        all-gather between the last two (buffers live until the batch size changes)."""
        w = self.wrapper
        shape = (batch, w.num_qo_heads, w.head_dim)
        wide = shape[:2] + (w.head_dim + 1,)
        if self.device == "cuda":
            from ..runtime.arrays import cupy_storage_dtype
            from ..runtime.cupy_arrays import empty

            self._local_out = empty(shape, cupy_storage_dtype(self.dtype))
            self._local_lse = empty(shape[:2], np.float32)
            self._send = empty(wide, np.float32)
            self._recv = empty((self.world_size,) + wide, np.float32)
        else:
            wire = np.float64 if self.dtype == "float64" else np.float32
            self._local_out = np.zeros(shape, storage_dtype(self.dtype))
            self._local_lse = np.zeros(shape[:2], wire)
            self._send = np.zeros(wide, wire)
            self._recv = np.zeros((self.world_size,) + wide, wire)
        self._all_gather = self.group.bind_all_gather(self._send, self._recv)
        self._batch = batch

    def run(self, q, k_cache, v_cache, *, out=None, lse=None, return_lse: bool = False,
            stream=None):
        """Attention over the whole (sharded) KV. Returns ``out``, or ``(out, lse)`` if
        ``return_lse`` or ``lse`` is given. On the GPU ``out`` is a device array (CuPy or a
        torch CUDA tensor) [batch, num_qo_heads, head_dim] of the query dtype (or uint16 for
        bfloat16) and ``lse`` float32; on the CPU, NumPy arrays (float64 for dtype "float64")."""
        self.run_local(q, k_cache, v_cache, stream=stream)
        return self.exchange_merge(out=out, lse=lse, return_lse=return_lse, stream=stream)

    def run_local(self, q, k_cache, v_cache, *, stream=None) -> None:
        """The splitkv kernels on this rank's shard, into the local state buffers."""
        if self.wrapper.current_plan is None:
            raise RuntimeError("run: call plan() first")
        if self.device == "cuda":
            self.wrapper.run(q, k_cache, v_cache, out=self._local_out, lse=self._local_lse,
                             stream=stream)
        else:
            self._local_out[...], self._local_lse[...] = self.wrapper.run(q, k_cache, v_cache)

    def exchange_merge(self, *, out=None, lse=None, return_lse: bool = False, stream=None):
        """Pack the local state, all-gather it, merge it into ``out`` (and ``lse``)."""
        if self.wrapper.current_plan is None:
            raise RuntimeError("run: call plan() first")
        if self.device == "cpu":
            return self._exchange_merge_host(out, lse, return_lse)
        from ..runtime.arrays import as_cupy_stream, cupy_storage_dtype
        from ..runtime.cupy_arrays import empty
        from .exchange_kernels import launch_merge, launch_pack

        s = as_cupy_stream(stream)
        shape = self._local_out.shape
        with s:
            if out is None:
                out = empty(shape, cupy_storage_dtype(self.dtype))
            if lse is None and return_lse:
                lse = empty(shape[:2], np.float32)
        out_ptr = _device_output("out", out, shape, self.dtype, self._send.device.id)
        lse_ptr = 0 if lse is None else _device_output("lse", lse, shape[:2], "float32",
                                                       self._send.device.id)
        if shape[0] == 0:       # every rank agrees (plan checked the batch sizes): nothing to send
            return (out, lse) if lse is not None else out
        launch_pack(self._local_out, self._local_lse, self._send, self.dtype, s)
        self._all_gather(s)
        launch_merge(self._recv, out_ptr, lse_ptr, self.dtype, s)
        return (out, lse) if lse is not None else out

    def _exchange_merge_host(self, out, lse, return_lse: bool):
        shape = self._local_out.shape
        exact = self.dtype == "float64"
        if out is None:
            out = np.empty(shape, storage_dtype(self.dtype))
        if lse is None and return_lse:
            lse = np.empty(shape[:2], np.float64 if exact else np.float32)
        _host_output("out", out, shape, self.dtype)
        if lse is not None:
            _host_output("lse", lse, shape[:2], "float64" if exact else "float32")
        if shape[0] == 0:
            return (out, lse) if lse is not None else out
        pack_state(self._local_out, self._local_lse, self._send, "float" if exact else self.dtype)
        self._all_gather()
        merged_o, merged_lse = merge_gathered(self._recv)
        if exact:
            out[...] = merged_o
        else:
            store_output(merged_o, out, self.dtype)
        if lse is not None:
            lse[...] = merged_lse
        return (out, lse) if lse is not None else out


def _device_output(name: str, arr, shape, dtype: str, device: int) -> int:
    """Check ``arr`` (any device array) and return its address."""
    from ..runtime.arrays import as_device_array

    view = as_device_array(name, arr)
    V.check_device_output(name, view, shape, dtype)
    if view.device is not None and view.device != device:
        raise ValueError(f"{name}: is on device {view.device}, the exchange buffers on {device}")
    return view.ptr


def _host_output(name: str, arr, shape, dtype: str) -> None:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: the CPU path writes NumPy arrays, got {type(arr).__name__}")
    V.check_shape(name, arr.shape, shape)
    if dtype in ("float32", "float64"):
        if arr.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {arr.dtype}")
    else:
        V.check_storage_dtype(name, V.dtype_name(arr.dtype), dtype)
