"""The plans a new profile changes, on the CPU: the shipped H200 profile against the roofline
prior it was calibrated from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import splitkv.planner
from splitkv.bench.cases import STANDARD_CASES
from splitkv.calibration.summary import describe_plan, plan_changes, same_plan, summary_table
from splitkv.core.plan import plan_fixed_splits
from splitkv.core.problem import DecodeProblem
from splitkv.planner.profiles import prior_profile, read_profile

SHIPPED = Path(splitkv.planner.__file__).parent / "profiles" / "nvidia-h200.yaml"


@pytest.fixture(scope="module")
def shipped():
    return read_profile(SHIPPED)


@pytest.fixture(scope="module")
def prior():
    return prior_profile("NVIDIA H200", 132)


def test_every_standard_case_with_both_plans_and_both_predictions(prior, shipped):
    changes = plan_changes(prior, shipped, 132)
    assert [c.case for c in changes] == [case.name for case in STANDARD_CASES]
    changed = [c for c in changes if c.changed]
    # the calibration moved some plans (b1_n1k to a cluster merge the prior never plans,
    # the prior's model having no clusters) and kept others
    assert 0 < len(changed) < len(changes)
    b1 = next(c for c in changes if c.case == "b1_n1k")
    assert b1.changed and b1.after.merge == "cluster" and b1.before.merge != "cluster"
    for c in changes:
        # each model prefers its own plan: the one it chose is its cheapest candidate
        assert c.before_model_us[0] <= c.before_model_us[1] * (1 + 1e-9), c.case
        assert c.after_model_us[1] <= c.after_model_us[0] * (1 + 1e-9), c.case
        assert c.before_model_us[0] == pytest.approx(c.before.predicted_us)
        assert c.after_model_us[1] == pytest.approx(c.after.predicted_us)
        if not c.changed:
            assert c.before_model_us[0] == pytest.approx(c.before_model_us[1])


def test_a_profile_against_itself_changes_nothing(shipped):
    changes = plan_changes(shipped, shipped.cost_model(), 132)     # a CostModel does too
    assert not any(c.changed for c in changes)
    lines = summary_table(changes)
    assert all(" same " in line for line in lines[1:-1]) and "*" not in "".join(lines[1:-1])
    assert lines[-1].startswith("0 of 12 plans changed")


def test_the_table_marks_each_changed_plan(prior, shipped):
    changes = plan_changes(prior, shipped, 132)
    lines = summary_table(changes, "prior", "calibrated")
    assert len(lines) == 1 + len(changes) + 1
    assert lines[0].split() == ["case", "prior", "plan", "calibrated", "plan", "prior", "model",
                                "us", "calibrated", "model", "us"]
    for c, line in zip(changes, lines[1:-1]):
        assert line.startswith("*" if c.changed else " ")
        assert f" {c.case} " in line and describe_plan(c.before) in line
        if c.changed:
            assert describe_plan(c.after) in line
            assert f"{c.after_model_us[0]:.1f} -> {c.after_model_us[1]:.1f}" in line
        else:
            assert " same " in line
    n = sum(c.changed for c in changes)
    assert lines[-1].startswith(f"{n} of {len(changes)} plans changed (*)")
    assert max(len(line) for line in lines[:-1]) < 120


def test_fp8_and_graph_stable_models_plan_too(prior, shipped):
    """For an fp8 calibration the fp8 models are compared (a profile without an fp8 fit plans
    fp8 with its 16-bit one); a graph-stable wrapper's plan no clusters."""
    fp8 = shipped.with_kv_fp8(prior)
    changes = plan_changes(shipped, fp8, 132, kv_dtype="float8_e4m3fn")
    assert any(c.changed for c in changes)
    stable = plan_changes(shipped, shipped, 132, kv_dtype="float8_e4m3fn", graph_stable=True)
    assert all(c.after.merge != "cluster" for c in stable)


def test_models_for_another_device_are_refused(prior, shipped):
    with pytest.raises(ValueError, match="before: a model for 132 SMs, not the device's 114"):
        plan_changes(prior, shipped, 114)
    other = prior_profile("NVIDIA H100", 114)
    with pytest.raises(ValueError, match="after: a model for 114 SMs"):
        plan_changes(prior, other, 132)
    with pytest.raises(TypeError, match="a Profile or a CostModel"):
        plan_changes("prior.yaml", shipped, 132)


def test_plans_read_as_strategy_splits_and_merge():
    problem = DecodeProblem(np.array([8192]), 32, 8, 128, 16)
    split = plan_fixed_splits(problem, 4, "split_merge")
    fused = plan_fixed_splits(problem, 8, "fused").with_execution(clusters=True)
    single = plan_fixed_splits(problem, 1)
    assert describe_plan(single) == "no split"
    assert describe_plan(split) == "split_merge 4 x 2048, kernel"
    assert describe_plan(fused) == "fused 8 x 1024, cluster 8"
    assert describe_plan(fused.with_execution(clusters=False)) == "fused 8 x 1024, ticket"
    assert same_plan(split, plan_fixed_splits(problem, 4, "split_merge"))
    assert not same_plan(fused, fused.with_execution(clusters=False))
    assert not same_plan(split, plan_fixed_splits(problem, 4, "fused"))
