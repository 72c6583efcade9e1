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
    """A stand-in for a KernelLaunch: notes which launch ran and what the wait flag was."""

    def __init__(self, name, calls, params, pdl):
        self.name, self.calls, self.params, self.pdl = name, calls, params, pdl

    def __call__(self, args, stream_ptr):
        self.calls.append((self.name, self.params.wait_before_record))


def _launches(monkeypatch, pdl_after_plan: bool, pdl: bool = True):
    from splitkv.runtime import launch as L

    monkeypatch.setattr(L, "current_context", lambda: 0)
    workspace = SimpleNamespace(partial_o=_buffer(1 << 20), partial_lse=_buffer(2 << 20),
                                counters=_buffer(3 << 20))
    grid = LaunchGrid(8, 2, 32, 1, merge=True, pages_in_record=False)
    params = decode_params({"kv_indices": 4 << 20, "records": 5 << 20, "merge_indptr": 6 << 20},
                           workspace, grid, num_kv_heads=8, page_size=16, q_group=4,
                           sm_scale_log2=0.125, pdl_early_trigger=False)
    calls = []
    launch = L.DecodeLaunch(params, _Recorder("partial", calls, params, pdl),
                            _Recorder("merge", calls, params, pdl), 0,
                            _Recorder("plain", calls, params, False),
                            pdl_after_plan=pdl_after_plan)
    return launch, calls


def test_the_first_run_after_the_planning_kernel_waits_before_its_record_only_when_asked(
        monkeypatch):
    """The run after plan_on_device: without PDL by default; with pdl_after_plan, the PDL
    launch with wait_before_record set for that launch alone (later runs read, then wait)."""
    args = RunArguments(7 << 20, 8 << 20, 9 << 20, 256, 16, 1, 10 << 20, 0)
    launch, calls = _launches(monkeypatch, pdl_after_plan=False)
    launch(args, 0, plain=True)
    launch(args, 0)
    assert calls == [("plain", 0), ("merge", 0), ("partial", 0), ("merge", 0)]
    launch, calls = _launches(monkeypatch, pdl_after_plan=True)
    launch(args, 0, plain=True)
    launch(args, 0)
    assert calls == [("partial", 1), ("merge", 0), ("partial", 0), ("merge", 0)]
    assert launch.params.wait_before_record == 0
    launch, calls = _launches(monkeypatch, pdl_after_plan=True, pdl=False)   # no PDL at all
    launch(args, 0, plain=True)
    assert calls == [("plain", 0), ("merge", 0)]


def test_pdl_after_plan_is_an_option():
    import pytest

    from splitkv.runtime.experiments import DecodeExperiments

    assert DecodeExperiments(pdl_after_plan=True).pdl_after_plan is True
    with pytest.raises(TypeError, match="pdl_after_plan: expected None, True or False"):
        DecodeExperiments(pdl_after_plan="yes")
