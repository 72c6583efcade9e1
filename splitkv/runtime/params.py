"""Filling ``DecodeParams``, the kernels' one argument (``kernel_abi``): at plan time everything
but the tensors (``decode_params``, for a ``LaunchGrid``), at run time the tensors, the fp8
scales and the variant's per-run values (``write_run_arguments``, from ``RunArguments``); and
the scalars as the kernels hold them (base-2 float32: ``sm_scale_log2``, ``soft_cap_log2``,
``unified_max_log2``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..core import validation as V
from ..core.unified_max import LOG2E
from ..core.variants import check_variant
from .kernel_abi import DecodeParams


def sm_scale_log2(sm_scale, head_dim: int) -> float:
    """The checked ``sm_scale`` (None: 1/sqrt(head_dim)) times log2(e), as a float32."""
    return float(np.float32(V.check_sm_scale(sm_scale, head_dim) * LOG2E))


def soft_cap_log2(logits_soft_cap) -> float:
    """The soft cap as DecodeParams holds it: times log2(e), as a float32; 0: none."""
    if logits_soft_cap is None:
        return 0.0
    cap = check_variant(1, logits_soft_cap=logits_soft_cap).logits_soft_cap
    if cap is None:
        return 0.0
    with np.errstate(over="ignore"):
        value = float(np.float32(cap * LOG2E))
    if not np.isfinite(value) or value < np.finfo(np.float32).tiny:
        raise ValueError(f"logits_soft_cap: {logits_soft_cap!r} is outside float32's normal "
                         "range")
    return value


def unified_max_log2(phi: float) -> float:
    """The unified max phi (natural-log units) as DecodeParams holds it."""
    return float(np.float32(phi * LOG2E))


class Scale(NamedTuple):
    """An fp8 scale as DecodeParams holds it: a device pointer (0: none), the per-tensor value
    (used without a pointer) and the pointer's stride (1: one value per kv head)."""

    pointer: int = 0
    value: float = 1.0
    stride: int = 0


NO_SCALE = Scale()


@dataclass(frozen=True)
class LaunchGrid:
    """What a plan's launches are built for: ``num_chunks`` chunks (CTA rows) x kv heads x
    ``per_kv_head`` CTAs; ``merge``: with the merge kernel, over ``batch_size`` requests;
    ``heads``: the kernels' query heads (with multi-token decode, virtual heads);
    ``pages_in_record``: the first tiles' page ids are in the records; ``spread``: one CTA per
    SM under PDL (None: the experiments' choice, else the grid's rule); ``device_planned``: the
    records are written by the planning kernel (a run right after it launches without PDL)."""

    num_chunks: int
    batch_size: int
    heads: int
    per_kv_head: int
    merge: bool
    pages_in_record: bool
    cluster_size: int = 0
    spread: bool | None = None
    device_planned: bool = False


def decode_params(meta: dict, workspace, grid: LaunchGrid, *, num_kv_heads: int, page_size: int,
                  q_group: int, sm_scale_log2: float, pdl_early_trigger: bool,
                  soft_cap_log2: float = 0.0, unified_max_log2: float = 0.0,
                  unified_fallbacks: int = 0) -> DecodeParams:
    """A plan's DecodeParams, all but the tensors: ``meta``, the device pointers of its
    records, page table and merge_indptr (and of multi-token rows, compact merge's split
    requests and ALiBi's slopes, when it has them); ``workspace``, the partials and ticket
    counters; the plan-time scalars (the scale, the soft cap, the unified max), written here
    once: a run writes only its own arguments (``write_run_arguments``)."""
    params = DecodeParams(
        kv_indices=meta["kv_indices"], records=meta["records"],
        merge_indptr=meta["merge_indptr"], partial_o=workspace.partial_o.data.ptr,
        partial_lse=workspace.partial_lse.data.ptr, counters=workspace.counters.data.ptr,
        batch_size=grid.batch_size, num_qo_heads=grid.heads,
        num_kv_heads=num_kv_heads, ctas_per_kv_head=grid.per_kv_head,
        page_size=page_size, sm_scale_log2=sm_scale_log2, logits_soft_cap_log2=soft_cap_log2,
        pages_in_record=int(grid.pages_in_record),
        pdl_early_trigger=int(pdl_early_trigger),
        query_rows=meta.get("query_rows", 0), q_group=q_group,
        split_requests=meta.get("split_requests", 0),
        num_split_requests=int(meta.get("num_split_requests", 0)),
        alibi_slopes_log2=meta.get("alibi_slopes_log2", 0))
    if unified_fallbacks:
        params.unified_max_log2 = unified_max_log2
        params.unified_fallbacks = unified_fallbacks
    return params


@dataclass(frozen=True)
class RunArguments:
    """What one ``run()`` gives the kernels: device pointers of q, the caches, out and lse (0:
    not wanted); the caches' strides in elements; the fp8 scales; the sinks' pointer (0:
    none); q's row stride in elements. (The soft cap is the plan's: ``decode_params``.)"""

    q: int
    k_cache: int
    v_cache: int
    page_stride: int
    token_stride: int
    head_stride: int
    out: int
    lse: int
    k_scale: Scale = NO_SCALE
    v_scale: Scale = NO_SCALE
    sinks: int = 0
    q_stride: int = 0


def write_run_arguments(p: DecodeParams, a: RunArguments) -> None:
    """Write a run's arguments into its plan's DecodeParams (the caller holds its lock)."""
    p.q, p.k_cache, p.v_cache, p.out, p.lse = a.q, a.k_cache, a.v_cache, a.out, a.lse
    p.page_stride, p.token_stride, p.head_stride = a.page_stride, a.token_stride, a.head_stride
    p.k_scale, p.k_scale_value, p.k_scale_stride = a.k_scale
    p.v_scale, p.v_scale_value, p.v_scale_stride = a.v_scale
    p.sinks = a.sinks
    p.q_stride = a.q_stride
