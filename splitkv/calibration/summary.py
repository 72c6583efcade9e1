"""What a new profile changes: the plans of the standard cases (``bench.cases``) under the
profile planned with before and under the new one, each model's prediction for both plans,
and a short table of it that ``splitkv calibrate`` prints at the end. Planner only: no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bench.cases import STANDARD_CASES, Case
from ..core.plan import Plan
from ..core.problem import DecodeProblem
from ..planner import CostModel, Profile, choose_plan


@dataclass(frozen=True)
class PlanChange:
    """One case's plan before and after, and what each model predicts for both plans."""

    case: str
    before: Plan                    # as the previous model plans it
    after: Plan                     # as the new model plans it
    before_model_us: tuple[float, float]    # the previous model: (before plan, after plan)
    after_model_us: tuple[float, float]     # the new model: (before plan, after plan)

    @property
    def changed(self) -> bool:
        return not same_plan(self.before, self.after)


def same_plan(a: Plan, b: Plan) -> bool:
    """The same chunks, strategy and merge: what runs is the same."""
    return (a.strategy == b.strategy and a.execution == b.execution
            and np.array_equal(a.chunk_request, b.chunk_request)
            and np.array_equal(a.chunk_start, b.chunk_start)
            and np.array_equal(a.chunk_end, b.chunk_end))


def describe_plan(plan: Plan) -> str:
    """'no split', or 'fused 8 x 4096, cluster 8': strategy, splits x the longest chunk's
    tokens, merge."""
    if plan.num_splits <= 1:
        return "no split"
    s = plan.summary()
    merge = {"merge_kernel": "kernel", "ticket": "ticket", "none": "none"}.get(
        s["merge"], f"{s['merge']} {s['cluster_size']}")
    return f"{s['strategy']} {s['num_splits']} x {s['chunk_tokens_max']}, {merge}"


def _model(source, kv_dtype, graph_stable) -> CostModel:
    if isinstance(source, Profile):
        model = source.cost_model(kv_dtype, graph_stable)
    elif isinstance(source, CostModel):
        model = source
    else:
        raise TypeError(f"expected a Profile or a CostModel, got {type(source).__name__}")
    # a graph-stable wrapper plans without clusters (its one grid cannot change shape)
    return model.with_clusters(False) if graph_stable else model


def _problem(case: Case) -> DecodeProblem:
    return DecodeProblem(np.array(case.kv_lens, dtype=np.int64), case.num_qo_heads,
                         case.num_kv_heads, case.head_dim, case.page_size)


def _predict(model: CostModel, plan: Plan) -> float:
    # a plan is predicted as it would run on that model's GPU (clusters or not)
    return float(model.predict(plan.with_execution(clusters=model.clusters)))


def plan_changes(before, after, num_sms: int, cases: list[Case] | None = None, *,
                 kv_dtype: str | None = None, graph_stable: bool = False) -> list[PlanChange]:
    """For each of ``cases`` (default: the standard cases), the plan ``before`` chooses and
    the one ``after`` chooses, and both models' predictions for both plans. ``before`` and
    ``after``: Profiles (their ``kv_dtype`` / ``graph_stable`` model is taken) or CostModels,
    both for a device of ``num_sms`` SMs (a ValueError if not: plans for other grids do not
    compare)."""
    models = [_model(m, kv_dtype, graph_stable) for m in (before, after)]
    for name, model in zip(("before", "after"), models):
        if model.num_sms != num_sms:
            raise ValueError(f"{name}: a model for {model.num_sms} SMs, not the device's "
                             f"{num_sms}")
    old, new = models
    out = []
    for case in STANDARD_CASES if cases is None else cases:
        problem = _problem(case)
        plans = [choose_plan(problem, m) for m in models]
        out.append(PlanChange(case.name, *plans,
                              tuple(_predict(old, p) for p in plans),
                              tuple(_predict(new, p) for p in plans)))
    return out


def _us(pair: tuple[float, float], same: bool) -> str:
    return f"{pair[0]:.1f}" if same else f"{pair[0]:.1f} -> {pair[1]:.1f}"


def summary_table(changes: list[PlanChange], before_name: str = "previous",
                  after_name: str = "new") -> list[str]:
    """The lines of a short table: a row per case (``*`` where the plan changed) with both
    plans, then both models' microseconds for the previous plan -> the new one, then a count
    of the plans that changed."""
    header = ["", "case", f"{before_name} plan", f"{after_name} plan",
              f"{before_name} model us", f"{after_name} model us"]
    rows = []
    for c in changes:
        same = not c.changed
        rows.append(["*" if c.changed else "", c.case, describe_plan(c.before),
                     "same" if same else describe_plan(c.after),
                     _us(c.before_model_us, same), _us(c.after_model_us, same)])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    right = {4, 5}                          # the numbers line up on the right

    def line(cells):
        return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    n = sum(c.changed for c in changes)
    return [line(header)] + [line(r) for r in rows] + [
        f"{n} of {len(changes)} plans changed (*); us: each model's prediction for the "
        f"{before_name} plan -> the {after_name} one"]
