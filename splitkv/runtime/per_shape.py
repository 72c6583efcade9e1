"""A per-shape plan's grid, build and chunk records: what ``plan()`` of a per-shape wrapper
decides before uploading (the graph-stable wrapper's fixed grid is ``graph_stable``'s)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core import validation as V
from ..core.execution import MERGE_KERNEL, grid_order
from ..core.geometry import MAX_HEADS_PER_CTA, ctas_per_kv_head
from ..core.builds import row_tiles_for
from ..core.variants import KernelVariant
from .compiled_builds import per_shape_kernels
from .records import chunk_records, pages_fit_record, record_pages_needed


@dataclass
class PerShapePlan:
    """The compiled kernels a plan runs, its records (grid order), whether the first tiles'
    page ids ride in them, the CTAs a kv head, and the extra parts of its upload."""

    kernels: object
    records: np.ndarray
    pages_in_record: bool
    per_kv_head: int
    extra: dict


def plan_grid_size(plan, heads: int, num_kv_heads: int, experiments) -> tuple[int, int, int]:
    """(CTAs a kv head, CTAs, MMA row tiles a CTA) of a per-shape
    ``plan`` whose kernels see ``heads`` query heads (with multi-token decode, virtual heads)."""
    group = heads // num_kv_heads          # with multi-token decode, q_len x the group
    max_rows = experiments.rows_per_cta or MAX_HEADS_PER_CTA
    per_kv_head = ctas_per_kv_head(group, max_rows)
    return (per_kv_head, plan.num_work_items * per_kv_head,
            row_tiles_for(min(group, max_rows)))


def per_shape_plan(plan, page_table, *, shape, heads: int, base, experiments,
                   variant: KernelVariant, rows_array) -> PerShapePlan:
    """Check the plan's grids against CUDA's limits, choose its build (``compiled_builds``:
    the wrapper's ``base`` build with ``variant``'s hooks) and write its chunk records.
    ``shape``: the wrapper's ``run_inputs.DecodeShape``; ``heads``: the kernels' query heads
    (with multi-token decode, virtual heads); ``rows_array``: each request's query rows
    (``records.query_rows_array``), given exactly where the build reads them: multi-token
    decode, or ALiBi (each query's position)."""
    if (variant.multi_token or variant.alibi) != (rows_array is not None):
        raise ValueError("rows_array: the requests' query rows, given exactly where the "
                         f"variant reads them (variant={variant})")
    per_kv_head, ctas, row_tiles = plan_grid_size(plan, heads, shape.num_kv_heads, experiments)
    V.check_grid_ctas("page_table", ctas, f"{plan.num_chunks} chunks x {shape.num_kv_heads} "
                      f"kv heads x {per_kv_head} CTAs a kv head")
    V.check_grid_ctas("page_table", -(-plan.problem.batch_size * heads * shape.head_dim
                                      // (4 * 128)),
                      "the merge kernel's: a thread per 4 dims of each request's heads")
    kernels = per_shape_kernels(base, plan, ctas, row_tiles, page_size=shape.page_size,
                                experiments=experiments, variant=variant)
    stages, tile = kernels.build.stages, kernels.build.tile_tokens
    # a table kept on the device has no page ids on the host to carry
    in_record = (page_table.kv_indices is not None
                 and pages_fit_record(plan, shape.page_size, stages, tile))
    records = chunk_records(plan, page_table, grid_order(plan),
                            record_pages_needed(shape.page_size, stages, tile) if in_record else 0)
    extra = {} if rows_array is None else {"query_rows": rows_array}
    if experiments.compact_merge and plan.merge == MERGE_KERNEL:
        extra["split_requests"] = np.flatnonzero(np.diff(plan.merge_indptr) > 1)
    return PerShapePlan(kernels, records, in_record, per_kv_head, extra)
