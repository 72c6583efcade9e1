"""Which build of the kernels a wrapper runs (``DecodeVariant``): the one its shape and options
give (``shape_variant``, at construction), then, per plan, the one that plan's grid runs best
(``per_shape_kernels``), or the one a graph-stable wrapper's fixed grid holds
(``graph_kernels``). The rules are ``features``'s; this module only applies them."""

from __future__ import annotations

from dataclasses import replace

from ..core.geometry import WARPS_PER_CTA
from .experiments import DecodeExperiments
from .features import (default_occupancy, default_pow2_pages, default_q_in_smem,
                       default_tile_per_warp, fitting_build, plan_warps)
from .kernel_source import DecodeVariant, row_tiles_for
from .modules import get_decode_kernels


def shape_variant(dtype: str, head_dim: int, group_size: int, page_size: int, kv_dtype,
                  experiments: DecodeExperiments) -> DecodeVariant:
    """The build a wrapper's shape gives (before any plan): q's fragments in shared memory at
    head_dim 256, the page walk by shift for small 2**k pages, and what ``experiments`` force."""
    q_in_smem, pow2 = experiments.q_in_smem, experiments.pow2_pages
    if q_in_smem is None:
        q_in_smem = default_q_in_smem(head_dim)
    if pow2 is None:
        # the threads that share a tile's copies: its row tiles' warps (x dim_split's)
        pow2 = default_pow2_pages(page_size, head_dim,
                                  row_tiles_for(group_size) * (experiments.dim_split or 1),
                                  1 if kv_dtype else 2)
    return DecodeVariant.for_problem(dtype, head_dim, group_size,
                                     experiments.stages or 0,
                                     experiments.max_registers or 0,
                                     kv_dtype=kv_dtype or "",
                                     num_warps=(experiments.forced_warps
                                                or WARPS_PER_CTA),
                                     q_in_smem=int(q_in_smem), pow2_pages=int(pow2),
                                     tile_per_warp=experiments.tile_per_warp or 16,
                                     dim_split=experiments.dim_split or 1)


def per_shape_kernels(base: DecodeVariant, plan, ctas: int, row_tiles: int, *, kv_dtype,
                      page_size: int, head_dim: int, experiments: DecodeExperiments,
                      soft_cap: bool, multi_token: bool, unified_max: bool):
    """The compiled kernels a per-shape ``plan`` of ``ctas`` CTAs runs: the plan's cluster
    size, 8 warps where 4 are issue-bound (``plan_warps``), the tile a warp, the occupancy,
    given up in turn until the build fits the device's shared memory (``fitting_build``)."""
    sizes = plan.chunk_end - plan.chunk_start
    ex = experiments
    forced_warps = ex.forced_warps
    warps = plan_warps(kv_dtype, ctas, forced_warps, row_tiles=row_tiles,
                       page_size=page_size, head_dim=head_dim,
                       mean_chunk_tokens=float(sizes.mean()) if sizes.size else 0.0,
                       multi_token=multi_token)
    tile_per_warp = ex.tile_per_warp or default_tile_per_warp(
        kv_dtype, head_dim, warps, row_tiles, multi_token,
        forced=ex.stages is not None or forced_warps is not None)
    import cupy

    key = (cupy.cuda.runtime.getDevice(), base, ex, plan.cluster_size, soft_cap, warps,
           row_tiles, tile_per_warp, multi_token, unified_max)
    kernels = _PER_SHAPE.get(key)
    if kernels is None:     # a decode loop meets a handful of builds: decide each once
        variant = default_occupancy(replace(
            base, cluster=plan.cluster_size, soft_cap=int(soft_cap),
            num_warps=warps, stages=ex.stages or 0, row_tiles=row_tiles,
            tile_per_warp=tile_per_warp, multi_token=int(multi_token),
            unified_max=int(unified_max)), forced=ex.forces_occupancy)
        kernels = get_decode_kernels(fitting_build(
            variant, q_default=ex.q_in_smem is None, warps_default=forced_warps is None,
            stages=ex.stages or 0))
        if len(_PER_SHAPE) >= 256:
            _PER_SHAPE.clear()
        _PER_SHAPE[key] = kernels
    return kernels


# (device, build inputs) -> the compiled kernels per_shape_kernels chose
_PER_SHAPE: dict = {}


def graph_kernels(base: DecodeVariant, experiments: DecodeExperiments, *, soft_cap: bool,
                  rows: int, max_q_len: int):
    """The compiled kernels of a graph-stable grid: no cluster, the wrapper's warps, the
    multi-token build for ``max_q_len`` > 1, row tiles for ``rows`` (max_q_len x the group)."""
    return get_decode_kernels(fitting_build(default_occupancy(replace(
        base, soft_cap=int(soft_cap), multi_token=int(max_q_len > 1),
        row_tiles=row_tiles_for(rows)),
        forced=experiments.forces_occupancy),
        q_default=experiments.q_in_smem is None, warps_default=False))
