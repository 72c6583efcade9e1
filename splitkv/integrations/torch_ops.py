"""splitkv's paged decode as a PyTorch custom op, ``torch.ops.splitkv.paged_decode``.

A kernel launched from Python outside torch is a graph break for ``torch.compile``; a custom op
with a fake (shape-only) implementation is traced as one node, so a module that calls it
compiles with ``fullgraph=True``. The op cannot take a wrapper object, so the configuration lives
in a :class:`DecodeSession`, named by an integer handle (a constant of the traced graph).

A session plans on the device (``plan_on_device`` of a graph-stable wrapper), so a step of
``paged_decode(..., plan=True)`` for the first layer and ``plan=False`` for the others can be
captured in a CUDA graph and replayed while the lengths and the page table change in place. The
batch is copied into the session's own buffers first (their addresses are what a captured launch
holds). A session has a capacity: any batch of up to ``capacity`` rows runs, planned over views
of that many rows of its buffers. On a CPU tensor the op runs ``splitkv.reference_decode`` (float64, exact): slow, for
tests and for small models on machines without a GPU.

Importing this module imports torch and registers the op.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import numpy as np
import torch

from splitkv.core import validation as V
from splitkv.core.fp8 import fp8_format
from splitkv.core.variants import check_alibi_slopes, check_chunk_size

LAYOUTS = ("block_table", "indptr")


class DecodeSession:
    """One decode configuration and its buffers.

    layout ``"block_table"``: the batch is vLLM's ``seq_lens`` int32 [rows] and ``block_table``
    int32 [rows, width] (pad entries with -1 or anything: entries past a request's pages are not
    read). layout ``"indptr"``: FlashInfer's ``kv_indptr`` int32 [rows + 1] and ``kv_indices``
    int32 [n <= width], one entry a token (``page_size=1``). Caches are NHD, ``[num_pages, page_size, num_kv_heads, head_dim]``.
    """

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype, layout: str, capacity: int, width: int, sm_scale: float,
                 logits_soft_cap: float | None = None, window_left: int = -1, kv_dtype=None,
                 attention_chunk_size: int = 0, alibi_slopes=None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if layout == "indptr" and page_size != 1:
            raise ValueError(f"page_size: the indptr layout lists tokens (page_size 1), got "
                             f"{page_size!r}")
        for name, value in (("capacity", capacity), ("width", width), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        # the GPU wrapper's own checks, so that a configuration the CPU path runs also runs on
        # a GPU
        num_qo_heads, num_kv_heads = V.check_heads(num_qo_heads, num_kv_heads)
        head_dim = V.check_head_dim(head_dim)
        if not isinstance(dtype, torch.dtype) or dtype not in (torch.float16, torch.bfloat16,
                                                                torch.float32):
            raise TypeError(f"dtype: expected torch.float16 or torch.bfloat16 (torch.float32 "
                            f"on CPU tensors only), got {dtype!r}")
        if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale: expected a finite number > 0, got {sm_scale!r}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.dtype, self.layout = page_size, dtype, layout
        self.capacity, self.width, self.sm_scale = capacity, width, float(sm_scale)
        self.logits_soft_cap = logits_soft_cap or None
        self.window_left = -1 if window_left is None else int(window_left)
        self.attention_chunk_size = check_chunk_size(attention_chunk_size)   # 0: none
        self.kv_dtype = fp8_format("kv_dtype", kv_dtype)   # None: K/V in ``dtype``
        V.check_head_dim_for_kv(head_dim, self.kv_dtype)
        # ALiBi: one slope a query head (a list, NumPy or a torch tensor), kept on the host
        if isinstance(alibi_slopes, torch.Tensor):
            alibi_slopes = alibi_slopes.detach().to("cpu", torch.float64).numpy()
        self.alibi_slopes = check_alibi_slopes(num_qo_heads, alibi_slopes)
        self.buffers: dict[str, torch.Tensor] | None = None
        self.wrapper = None           # the GPU wrapper, made at the first plan on a CUDA device
        self.page_table = None        # the CPU path's plan
        self.plans = self.runs = 0

    # ----------------------------------------------------------------- staging
    def _allocate(self, device) -> None:
        cap, make = self.capacity, lambda *shape: torch.zeros(shape, dtype=torch.int32,
                                                               device=device)
        if self.layout == "block_table":
            self.buffers = {"seq_lens": make(cap), "block_table": make(cap, self.width)}
        else:
            self.buffers = {"kv_indptr": make(cap + 1), "kv_indices": make(self.width),
                            "kv_last_page_len": make(cap)}

    def stage(self, tables, rows: int) -> None:
        """Copy a batch of ``rows`` requests into the session's buffers (rows past it: empty)."""
        if not 1 <= rows <= self.capacity:
            raise ValueError(f"q: expected 1 to {self.capacity} rows (the session's capacity), "
                             f"got {rows}")
        names = (("seq_lens", "block_table") if self.layout == "block_table"
                 else ("kv_indptr", "kv_indices"))
        for name, t in zip(names, tables):      # a float length would be truncated by the copy
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name}: expected a torch.int32 (or int64) tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
        if self.buffers is None:
            self._allocate(tables[0].device)
        b = self.buffers
        if self.layout == "block_table":
            seq_lens, table = tables
            if tuple(seq_lens.shape) != (rows,) or table.dim() != 2 or table.shape[0] != rows \
                    or table.shape[1] > self.width:
                raise ValueError(f"tables: expected seq_lens [{rows}] and block_table [{rows}, "
                                 f"<= {self.width}], got {tuple(seq_lens.shape)} and "
                                 f"{tuple(table.shape)}")
            b["seq_lens"][:rows].copy_(seq_lens)
            b["seq_lens"][rows:].zero_()
            b["block_table"][:rows, :table.shape[1]].copy_(table)
        else:
            indptr, indices = tables
            if tuple(indptr.shape) != (rows + 1,) or indices.dim() != 1 \
                    or indices.shape[0] > self.width:
                raise ValueError(f"tables: expected kv_indptr [{rows + 1}] and kv_indices "
                                 f"[<= {self.width}], got {tuple(indptr.shape)} and "
                                 f"{tuple(indices.shape)}")
            ptr = b["kv_indptr"]
            ptr[:rows + 1].copy_(indptr)
            ptr[rows + 1:].copy_(indptr[rows:].expand(self.capacity - rows))
            b["kv_indices"][:indices.shape[0]].copy_(indices)
            torch.clamp(ptr[1:] - ptr[:-1], max=1, out=b["kv_last_page_len"])

    # ----------------------------------------------------------------- plan and run
    def plan(self, tables, rows: int) -> None:
        self.stage(tables, rows)
        if self.buffers[next(iter(self.buffers))].is_cuda:
            self._plan_gpu(rows)
        else:
            self._plan_cpu()
        self.plans += 1

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            sinks: torch.Tensor | None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q: [rows, num_qo_heads, head_dim]; returns a new [rows, num_qo_heads, head_dim].
        k_scale, v_scale: an fp8 cache's scales (1 value or one per kv head), or None."""
        rows = q.shape[0]
        if not 1 <= rows <= self.capacity:
            raise ValueError(f"q: expected 1 to {self.capacity} rows, got {rows}")
        self.runs += 1
        if q.is_cuda:
            return self._run_gpu(q, k_cache, v_cache, sinks, k_scale, v_scale)
        return self._run_cpu(q, k_cache, v_cache, sinks, k_scale, v_scale)

    def warmup(self) -> int:
        """Compile, before serving, every build these plans can run on the current CUDA device,
        and the planning kernel (``BatchDecodeWrapper.warmup``); returns the number of decode
        builds."""
        return self._gpu_wrapper().warmup(logits_soft_cap=self.logits_soft_cap is not None,
                                          alibi=self.alibi_slopes is not None)

    def _gpu_wrapper(self):
        if self.wrapper is None:
            from splitkv import BatchDecodeWrapper

            entries = self.capacity * self.width if self.layout == "block_table" else self.width
            self.wrapper = BatchDecodeWrapper(
                self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                dtype=self.dtype, use_cuda_graph=True, max_batch_size=self.capacity,
                max_num_pages=entries, kv_dtype=self.kv_dtype)
        return self.wrapper

    def _plan_gpu(self, rows: int) -> None:
        """Plan the first ``rows`` requests: views of the buffers, so that the runs' q and out
        have just those rows (a captured graph holds the views of its batch size)."""
        b = self.buffers
        if self.layout == "block_table":
            batch = {"seq_lens": b["seq_lens"][:rows], "block_table": b["block_table"][:rows]}
        else:
            batch = {"kv_indptr": b["kv_indptr"][:rows + 1], "kv_indices": b["kv_indices"],
                     "kv_last_page_len": b["kv_last_page_len"][:rows]}
        self._gpu_wrapper().plan_on_device(
            **batch, sm_scale=self.sm_scale, logits_soft_cap=self.logits_soft_cap,
            window_left=self.window_left, attention_chunk_size=self.attention_chunk_size,
            alibi_slopes=self.alibi_slopes)

    def _run_gpu(self, q, k_cache, v_cache, sinks, k_scale, v_scale):
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        # device scales, read when the kernel runs (a captured graph sees new values)
        k_scale, v_scale = (None if s is None else s.to(torch.float32).reshape(-1)
                            for s in (k_scale, v_scale))
        # torch's current stream, and a torch output of q's rows
        return self._gpu_wrapper().run(q.contiguous(), k_cache, v_cache, sinks=sinks,
                                       k_scale=k_scale, v_scale=v_scale)

    def _plan_cpu(self) -> None:
        from splitkv import PageTable

        host = {name: t.numpy().astype(np.int64) for name, t in self.buffers.items()}
        if self.layout == "block_table":
            self.page_table = PageTable.from_block_table(host["block_table"], host["seq_lens"],
                                                         self.page_size)
        else:
            ptr = host["kv_indptr"]
            self.page_table = PageTable.from_flashinfer(
                ptr, host["kv_indices"][:ptr[-1]], host["kv_last_page_len"], 1)

    def _check_cpu_inputs(self, q, k_cache, v_cache) -> None:
        """What the GPU wrapper's run() refuses, refused on the CPU path too: q and the caches
        of the session's heads, head_dim, page size and dtypes (fp8 codes as uint8 or the
        session's float8 type)."""
        want_q = (q.shape[0], self.num_qo_heads, self.head_dim)
        if q.dim() != 3 or tuple(q.shape) != want_q:
            raise ValueError(f"q: expected shape {list(want_q)}, got {list(q.shape)}")
        if q.dtype != self.dtype:
            raise TypeError(f"q: expected {self.dtype} (the session's dtype), got {q.dtype}")
        codes = (None if self.kv_dtype is None
                 else (torch.uint8, getattr(torch, self.kv_dtype, torch.uint8)))
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            tail = (self.page_size, self.num_kv_heads, self.head_dim)
            if cache.dim() != 4 or tuple(cache.shape[1:]) != tail:
                raise ValueError(f"{name}: expected shape [num_pages, {', '.join(map(str, tail))}]"
                                 f" (NHD), got {list(cache.shape)}")
            if codes is None and cache.dtype != self.dtype:
                raise TypeError(f"{name}: expected {self.dtype} (the session's dtype), got "
                                f"{cache.dtype}")
            if codes is not None and cache.dtype not in codes:
                raise TypeError(f"{name}: expected {self.kv_dtype} codes (torch.uint8 or "
                                f"torch.{self.kv_dtype}), got {cache.dtype}")

    def _run_cpu(self, q, k_cache, v_cache, sinks, k_scale, v_scale):
        from splitkv import reference_decode

        if self.page_table is None:
            raise RuntimeError("paged_decode: plan first (plan=True on the first call)")
        self._check_cpu_inputs(q, k_cache, v_cache)
        rows, cap = q.shape[0], self.capacity
        q64 = np.zeros((cap, *q.shape[1:]))
        q64[:rows] = q.detach().double().numpy()
        if self.kv_dtype is None:
            k_host, v_host = (c.detach().double().numpy() for c in (k_cache, v_cache))
        else:   # the fp8 codes as bytes (uint8 or torch float8 storage), decoded exactly
            k_host, v_host = (c.detach().view(torch.uint8).numpy() for c in (k_cache, v_cache))
        k_scale, v_scale = (None if s is None else s.detach().double().reshape(-1).numpy()
                            for s in (k_scale, v_scale))
        out, _ = reference_decode(
            q64, k_host, v_host, self.page_table, self.sm_scale, kv_dtype=self.kv_dtype,
            k_scale=k_scale, v_scale=v_scale, window_left=self.window_left,
            logits_soft_cap=self.logits_soft_cap, attention_chunk_size=self.attention_chunk_size,
            alibi_slopes=self.alibi_slopes,
            sinks=None if sinks is None else sinks.detach().double().numpy())
        return torch.from_numpy(out[:rows]).to(q.dtype)


class LayerSessions(dict):
    """An engine's sessions by configuration (key -> (handle, the layer that plans it)): the
    first layer that used a session plans it in every step, and runs first among the layers
    sharing it, so its ``plan=True`` call plans the step (a captured step holds the plan)."""

    def session(self, key, layer: int, options) -> tuple[int, bool]:
        """(the handle, whether ``layer`` plans); ``options()`` gives a new session's keyword
        arguments."""
        if key not in self:
            self[key] = (new_session(**options()), layer)
        handle, first = self[key]
        return handle, first == layer

    def close(self) -> None:
        """Forget every session (their buffers and wrappers)."""
        for handle, _ in self.values():
            close_session(handle)
        self.clear()


def pow2_capacity(rows: int, floor: int = 1) -> int:
    """The next power of two at least ``rows`` and ``floor``: a session's capacity (or table
    width) for a batch, so that few sessions serve every batch an engine makes (engines pad
    batches to powers of two under CUDA graphs)."""
    return max(floor, 1 << max(int(rows) - 1, 0).bit_length())


_SESSIONS: dict[int, DecodeSession] = {}
_HANDLES = itertools.count(1)


def new_session(**options) -> int:
    """Make a :class:`DecodeSession` (its keyword arguments) and return its handle."""
    handle = next(_HANDLES)
    _SESSIONS[handle] = DecodeSession(**options)
    return handle


def get_session(handle: int) -> DecodeSession:
    try:
        return _SESSIONS[handle]
    except KeyError:
        raise ValueError(f"handle: no splitkv decode session {handle!r}") from None


def close_session(handle: int) -> None:
    """Forget a session (its buffers and wrapper go with the last reference)."""
    _SESSIONS.pop(handle, None)


@torch.library.custom_op("splitkv::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: list[torch.Tensor], sinks: Optional[torch.Tensor], handle: int,
                 plan: bool, k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention of ``q`` [rows, num_qo_heads, head_dim] over the paged caches
    ``[num_pages, page_size, num_kv_heads, head_dim]``; ``tables`` as the session's layout
    (int32), read only when ``plan`` (once per step, before the layers that share the plan).
    ``sinks``: [num_qo_heads] logits or None. ``k_scale``, ``v_scale``: a session with an fp8
    ``kv_dtype``: the caches' scales (float32, 1 value or one per kv head), or None (1).
    Returns [rows, num_qo_heads, head_dim] in q's dtype.
    """
    session = get_session(handle)
    if plan:
        session.plan(tables, q.shape[0])
    return session.run(q, k_cache, v_cache, sinks, k_scale, v_scale)


@paged_decode.register_fake
def _paged_decode_fake(q, k_cache, v_cache, tables, sinks, handle, plan, k_scale=None,
                       v_scale=None):
    return q.new_empty(q.shape)
