"""The CPU path's local attention: splitkv's float64 plan executor over this rank's shard, behind
the two calls ``ContextParallelDecode`` makes of the GPU wrapper (``plan``, ``run``). With it
the whole context-parallel path (sharding, the exchange through a gloo group, the merge) runs,
and is tested, on machines without a GPU."""

from __future__ import annotations

import numpy as np

from ..core import validation as V
from ..core.bfloat16 import float32_to_bits
from ..core.cpu_executor import execute_plan_cpu
from ..core.plan import Plan, plan_fixed_splits
from ..core.problem import DecodeProblem, PageTable

HOST_DTYPES = ("bfloat16", "float16", "float64")
PLAN_OPTIONS = ("num_splits", "strategy", "plan", "sm_scale", "logits_soft_cap")


def storage_dtype(dtype: str):
    """The NumPy dtype an output of ``dtype`` is held in (bfloat16 as uint16 bits)."""
    return {"bfloat16": np.uint16, "float16": np.float16, "float64": np.float64}[dtype]


def round_to(o, dtype: str):
    """A float64 output rounded once to ``dtype``'s storage, as the GPU kernel stores it."""
    if dtype == "bfloat16":
        return float32_to_bits(o.astype(np.float32))
    return o.astype(storage_dtype(dtype))


class HostDecode:
    """Plan and run decode attention over a page table on the host. ``dtype``: "bfloat16" or
    "float16" (inputs of that dtype, bfloat16 as uint16 bits, or any float array) or "float64"
    (everything stays float64: the exact path)."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: str = "bfloat16", **options):
        if options:
            raise TypeError(f"{sorted(options)[0]}: the CPU path takes none of the GPU "
                            f"wrapper's options (got {sorted(options)})")
        self.num_qo_heads, self.num_kv_heads = V.check_heads(num_qo_heads, num_kv_heads)
        self.head_dim = V.check_int("head_dim", head_dim, 1)
        self.page_size = V.check_int("page_size", page_size, 1)
        if dtype not in HOST_DTYPES:
            raise ValueError(f"dtype: the CPU path takes one of {HOST_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self.current_plan: Plan | None = None
        self._table: PageTable | None = None
        self._run_options: dict = {}

    def plan(self, page_table: PageTable, *, stream=None, **options) -> Plan:
        """A fixed-split plan (``num_splits``, default 1; ``strategy``) or the ``plan`` given;
        ``sm_scale`` and ``logits_soft_cap`` are kept for ``run``."""
        del stream                                  # host work: no stream
        unknown = sorted(set(options) - set(PLAN_OPTIONS))
        if unknown:
            raise TypeError(f"{unknown[0]}: the CPU path's plan() takes {PLAN_OPTIONS}")
        V.check_instance("page_table", page_table, PageTable)
        if page_table.page_size != self.page_size:
            raise ValueError(f"page_table: page_size {page_table.page_size}, expected "
                             f"{self.page_size} (the decoder's)")
        plan = options.get("plan")
        if plan is None:
            problem = DecodeProblem.from_page_table(
                page_table, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                "bfloat16" if self.dtype == "float64" else self.dtype)
            plan = plan_fixed_splits(problem, options.get("num_splits") or 1,
                                     options.get("strategy"))
        self.current_plan, self._table = plan, page_table
        self._run_options = {k: options.get(k) for k in ("sm_scale", "logits_soft_cap")}
        return plan

    def run(self, q, k_cache, v_cache):
        """(out [batch, num_qo_heads, head_dim] in the storage dtype, lse float64)."""
        if self.current_plan is None:
            raise RuntimeError("run: call plan() first")
        out, lse = execute_plan_cpu(self.current_plan, q, k_cache, v_cache, self._table,
                                    self._run_options["sm_scale"],
                                    logits_soft_cap=self._run_options["logits_soft_cap"])
        return round_to(out, self.dtype), lse
