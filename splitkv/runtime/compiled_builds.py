"""Which compiled kernels a wrapper runs: the build its shape gives (``base_build``, at
construction), then, per plan, the one that plan's grid runs (``per_shape_kernels``), or the
one a graph-stable wrapper's fixed grid holds (``graph_kernels``). ``core.builds`` decides each
build from the shape, the plan and the device's properties; this module only hands it the
current device and compiles what it decides."""

from __future__ import annotations

import numpy as np

from ..core.builds import PlanGrid, graph_build, plan_build, reachable_builds, shape_build
from ..core.geometry import MAX_HEADS_PER_CTA
from ..core.variants import KernelVariant
from .device_features import device_properties
from .experiments import DecodeExperiments
from .kernel_source import KernelBuild
from .modules import get_decode_kernels


def base_build(dtype: str, head_dim: int, group_size: int, page_size: int, kv_dtype,
               experiments: DecodeExperiments) -> KernelBuild:
    """The build a wrapper's shape gives (before any plan): ``core.builds.shape_build``."""
    return shape_build(dtype, head_dim, group_size, page_size, kv_dtype,
                       experiments.build_forces, build_type=KernelBuild)


def mean_chunk_tokens(plan) -> float:
    """The mean tokens of ``plan``'s chunks (0.0 for none), bit for bit ``sizes.mean()`` (the
    same float64 sum, divided by the count) without NumPy's slow Python-level ``mean``: every
    plan() asks."""
    sizes = plan.chunk_end - plan.chunk_start
    return float(np.add.reduce(sizes, dtype=np.float64)) / sizes.size if sizes.size else 0.0


def per_shape_build(base: KernelBuild, plan, ctas: int, row_tiles: int, *, page_size: int,
                    experiments: DecodeExperiments, variant: KernelVariant,
                    device) -> KernelBuild:
    """The build a per-shape ``plan`` of ``ctas`` CTAs runs with ``variant``'s hooks on
    ``device`` (its ``DeviceProperties``), not compiled (``core.builds.plan_build``; the K/V
    dtype and head_dim are ``base``'s)."""
    grid = PlanGrid(ctas, mean_chunk_tokens(plan), plan.cluster_size, row_tiles, variant)
    return plan_build(base, grid, page_size=page_size, device=device,
                      forces=experiments.build_forces)


def per_shape_kernels(base: KernelBuild, plan, ctas: int, row_tiles: int, *, page_size: int,
                      experiments: DecodeExperiments, variant: KernelVariant):
    """The compiled kernels a per-shape ``plan`` of ``ctas`` CTAs runs on the current device
    (``per_shape_build``)."""
    return get_decode_kernels(per_shape_build(
        base, plan, ctas, row_tiles, page_size=page_size, experiments=experiments,
        variant=variant, device=device_properties()))


def graph_kernels(base: KernelBuild, experiments: DecodeExperiments, *, variant: KernelVariant,
                  rows: int):
    """The compiled kernels of a graph-stable grid (``core.builds.graph_build``)."""
    return get_decode_kernels(graph_build(base, variant=variant, rows=rows,
                                          device=device_properties(),
                                          forces=experiments.build_forces))


def reachable_kernel_builds(base: KernelBuild, experiments: DecodeExperiments, *, device,
                            page_size: int, group_size: int, soft_caps, max_q_len: int,
                            unified_max: bool, clusters: bool, graph_stable: bool,
                            alibi: bool = False) -> frozenset:
    """Every build a wrapper of ``base``'s shape can run on ``device`` with these options
    (``core.builds.reachable_builds``): what ``warmup()`` compiles, and ``splitkv precompile``
    without the GPU."""
    return reachable_builds(base, device=device, page_size=page_size, group_size=group_size,
                            soft_caps=soft_caps, max_q_len=max_q_len, unified_max=unified_max,
                            clusters=clusters,
                            rows_per_cta=experiments.rows_per_cta or MAX_HEADS_PER_CTA,
                            graph_stable=graph_stable, forces=experiments.build_forces,
                            alibi=alibi)


def compile_reachable(base: KernelBuild, experiments: DecodeExperiments, *, page_size: int,
                      group_size: int, soft_caps, max_q_len: int, unified_max: bool,
                      clusters: bool, graph_stable: bool, alibi: bool = False) -> int:
    """Compile, on the current device, every build a wrapper of ``base``'s shape can run with
    these options (``reachable_kernel_builds``); returns how many (compiled now or before, in
    this process)."""
    found = reachable_kernel_builds(base, experiments, device=device_properties(),
                                    page_size=page_size, group_size=group_size,
                                    soft_caps=soft_caps, max_q_len=max_q_len,
                                    unified_max=unified_max, clusters=clusters,
                                    graph_stable=graph_stable, alibi=alibi)
    for build in found:
        get_decode_kernels(build)
    return len(found)
