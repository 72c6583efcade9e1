"""How a plan runs (``splitkv.core.execution``): the merge mode and launch order the planner decides
and the Plan carries."""

import numpy as np
import pytest

from splitkv.core.execution import Execution, decide
from splitkv.core.plan import Plan, plan_fixed_splits, plan_from_chunk_counts
from splitkv.core.problem import DecodeProblem


def problem(lens, hq=32, hk=8, d=128):
    return DecodeProblem(np.asarray(lens, dtype=np.int64), hq, hk, d, 16)


def test_merge_mode_follows_strategy_split_and_clusters():
    short = problem([1000])
    assert decide(plan_fixed_splits(short, 1, "single")) == Execution("none")
    assert decide(plan_fixed_splits(short, 4, "split_merge"), clusters=True).merge == "merge_kernel"
    assert decide(plan_fixed_splits(short, 4, "fused")).merge == "ticket"
    assert decide(plan_fixed_splits(short, 4, "fused"), clusters=True) == \
        Execution("cluster", 4, "plan")                   # cluster grids keep plan order
    # a fused plan whose requests are not split merges nothing
    assert decide(plan_from_chunk_counts(problem([5, 9]), [1, 1], "fused"), clusters=True) == \
        Execution("none")
    # too long for clusters: the ticket, in the order asked for
    long = plan_fixed_splits(problem([40000]), 4, "fused")
    assert decide(long, clusters=True, launch_order="longest_requests") == \
        Execution("ticket", 0, "longest_requests")


def test_plan_carries_its_execution_and_refuses_one_it_cannot_run():
    p = problem([1000, 1000])
    plan = plan_fixed_splits(p, 2, "fused")
    assert (plan.merge, plan.cluster_size, plan.launch_order) == ("ticket", 0, "longest_chunks")
    on_h200 = plan.with_execution(clusters=True)
    assert (on_h200.merge, on_h200.cluster_size, on_h200.launch_order) == ("cluster", 2, "plan")
    assert plan.merge == "ticket"                          # plans are immutable
    arrays = (plan.chunk_request, plan.chunk_start, plan.chunk_end, plan.merge_indptr)
    assert Plan(p, "fused", *arrays, execution=Execution("cluster", 2, "plan")).cluster_size == 2
    with pytest.raises(ValueError, match="execution"):
        Plan(p, "fused", *arrays, execution=Execution("cluster", 4, "plan"))
    with pytest.raises(ValueError, match="execution"):
        Plan(p, "split_merge", *arrays, execution=Execution("ticket"))
    with pytest.raises(TypeError, match="execution"):
        Plan(p, "fused", *arrays, execution="cluster")


def test_execution_checks_its_fields():
    with pytest.raises(ValueError, match="merge"):
        Execution("atomic")
    with pytest.raises(ValueError, match="cluster_size"):
        Execution("cluster", 3, "plan")
    with pytest.raises(ValueError, match="cluster_size"):
        Execution("ticket", 2)
    with pytest.raises(ValueError, match="launch_order"):
        Execution("ticket", 0, "shortest")
    with pytest.raises(ValueError, match="launch_order"):
        Execution("cluster", 2, "longest_chunks")
    assert "clusters of 8" in Execution("cluster", 8, "plan").describe()


def test_fused_cluster_size_needs_fused_equal_counts_short_chunks_and_small_grids():
    from splitkv.core.execution import CLUSTER_MAX_CHUNK_TOKENS, CLUSTER_MAX_WIDE_CTAS, fused_cluster_size

    assert fused_cluster_size("fused", [8, 8, 8], 128, 48) == 8
    assert fused_cluster_size("fused", [8], 128, CLUSTER_MAX_WIDE_CTAS + 8) == 0   # big grid
    assert fused_cluster_size("fused", [2] * 64, 1000, 1024) == 2   # pairs: any grid
    assert fused_cluster_size("fused", [2], CLUSTER_MAX_CHUNK_TOKENS, 16) == 2
    assert fused_cluster_size("fused", [2], CLUSTER_MAX_CHUNK_TOKENS + 1, 16) == 0   # long chunks
    assert fused_cluster_size("fused", [16, 16], 64, 32) == 0    # past the sizes that paid
    assert fused_cluster_size("fused", [8, 8, 7], 128, 23) == 0  # ragged chunk counts
    assert fused_cluster_size("fused", [3, 3], 128, 6) == 0
    assert fused_cluster_size("fused", [1, 1], 128, 2) == 0
    assert fused_cluster_size("split_merge", [4, 4], 128, 8) == 0
    assert fused_cluster_size("fused", [], 0, 0) == 0


def test_launch_orders_run_the_long_work_first_and_keep_ties_in_plan_order():
    from splitkv.core.execution import launch_order

    req = [0, 0, 1, 2, 2, 2]
    tokens = [512, 100, 300, 512, 512, 40]
    lens = [612, 300, 1064]
    np.testing.assert_array_equal(launch_order(req, tokens, lens), [0, 3, 4, 2, 1, 5])
    np.testing.assert_array_equal(launch_order(req, tokens, lens, "longest_requests"),
                                  [3, 4, 5, 0, 1, 2])
    np.testing.assert_array_equal(launch_order(req, tokens, lens, "plan"), np.arange(6))
    uniform = launch_order([0, 0, 1, 1], [64] * 4, [128, 128])
    np.testing.assert_array_equal(uniform, np.arange(4))
    assert launch_order([], [], [5]).size == 0
    with pytest.raises(ValueError, match="launch_order"):
        launch_order(req, tokens, lens, "shortest")
