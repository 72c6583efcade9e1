"""The device workspace of split plans: fp32 partial states (merged by the merge kernel or the
ticket merge) and the ticket merge's arrival counters. It grows with the plans, never shrinks."""

from __future__ import annotations

import numpy as np

from ..core.plan import Plan


class Workspace:
    """partial_o [rows * head_dim] and partial_lse [rows] float32, rows = num_chunks x
    num_qo_heads of the largest plan that merges in memory; counters [batch x num_kv_heads x
    ctas_per_kv_head] uint32, zero between launches."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.partial_o = self.partial_lse = self.counters = None
        self._rows = self._counters = 0

    @property
    def nbytes(self) -> int:
        """Device bytes held: the partial states and the counters."""
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
        import cupy

        if rows > self._rows:
            self.partial_o = cupy.empty(rows * self.head_dim, dtype=np.float32)
            self.partial_lse = cupy.empty(rows, dtype=np.float32)
            self._rows = rows
        if counters > self._counters:
            # Zeroed once: a fused run leaves every ticket counter at 0 again (atomicInc wraps
            # on the last arrival), so later plans need no fill (a launch per plan() call).
            with stream:
                self.counters = cupy.zeros(counters, dtype=np.uint32)
            self._counters = counters
