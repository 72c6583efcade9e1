"""A plan's kernel arguments against a run's: the plan-time scalars (the scale, the soft cap)
are written once, when a plan binds its launch; a run writes only its own arrays, strides,
scales and sinks over them. CPU only (ctypes structs, no launch)."""

from dataclasses import fields
from types import SimpleNamespace

from splitkv.runtime.graph_stable import GraphStableDecodeWrapper
from splitkv.runtime.params import LaunchGrid, RunArguments, decode_params, write_run_arguments


def _buffer(ptr):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))


def test_a_run_writes_its_arguments_over_the_plans_and_leaves_its_soft_cap():
    workspace = SimpleNamespace(partial_o=_buffer(1 << 20), partial_lse=_buffer(2 << 20),
                                counters=_buffer(3 << 20))
    meta = {"kv_indices": 4 << 20, "records": 5 << 20, "merge_indptr": 6 << 20}
    grid = LaunchGrid(8, 2, 32, 1, merge=True, pages_in_record=False)
    params = decode_params(meta, workspace, grid, num_kv_heads=8, page_size=16, q_group=4,
                           sm_scale_log2=0.125, pdl_early_trigger=False, soft_cap_log2=2.5)
    assert params.logits_soft_cap_log2 == 2.5 and params.records == 5 << 20
    assert "logits_soft_cap_log2" not in {f.name for f in fields(RunArguments)}
    write_run_arguments(params, RunArguments(7 << 20, 8 << 20, 9 << 20, 256, 16, 1,
                                             10 << 20, 0, sinks=11 << 20))
    assert (params.q, params.out, params.sinks, params.page_stride) == (7 << 20, 10 << 20,
                                                                        11 << 20, 256)
    assert params.logits_soft_cap_log2 == 2.5 and params.sm_scale_log2 == 0.125


def test_a_graph_stable_plan_writes_its_soft_cap_into_every_launch_it_keeps():
    wrapper = GraphStableDecodeWrapper.__new__(GraphStableDecodeWrapper)
    wrapper._launches = {n: SimpleNamespace(params=SimpleNamespace(logits_soft_cap_log2=0.0))
                         for n in (1, 4, 16)}
    wrapper._write_soft_cap(3.0)
    caps = [launch.params.logits_soft_cap_log2 for launch in wrapper._launches.values()]
    assert caps == [3.0] * 3
    assert wrapper._logits_soft_cap_log2 == 3.0           # the value a grid bound later takes
