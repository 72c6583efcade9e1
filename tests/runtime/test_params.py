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


class _Recorder:
    """A stand-in for a KernelLaunch: notes which launch ran."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, args, stream_ptr):
        self.calls.append(self.name)


def test_the_first_run_after_the_planning_kernel_launches_without_pdl(monkeypatch):
    """The run right after plan_on_device (``plain``): the partial kernel without PDL, since a
    PDL launch reads its record before it waits for the kernel that wrote it; later runs launch
    with PDL."""
    from splitkv.runtime import launch as L

    monkeypatch.setattr(L, "current_context", lambda: 0)
    workspace = SimpleNamespace(partial_o=_buffer(1 << 20), partial_lse=_buffer(2 << 20),
                                counters=_buffer(3 << 20))
    grid = LaunchGrid(8, 2, 32, 1, merge=True, pages_in_record=False)
    params = decode_params({"kv_indices": 4 << 20, "records": 5 << 20, "merge_indptr": 6 << 20},
                           workspace, grid, num_kv_heads=8, page_size=16, q_group=4,
                           sm_scale_log2=0.125, pdl_early_trigger=False)
    calls = []
    launch = L.DecodeLaunch(params, _Recorder("partial", calls), _Recorder("merge", calls), 0,
                            _Recorder("plain", calls))
    args = RunArguments(7 << 20, 8 << 20, 9 << 20, 256, 16, 1, 10 << 20, 0)
    launch(args, 0, plain=True)
    launch(args, 0)
    assert calls == ["plain", "merge", "partial", "merge"]
