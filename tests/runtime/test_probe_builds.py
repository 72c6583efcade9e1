"""The first-use probes' builds, known before any probe runs: each is the build a default
wrapper's ``plan(plan=)`` of that probe picks on the GPU (so the parallel compile ahead of the
probes is what the wrappers then load), and compiling them fills splitkv's kernel cache where
the runtime looks, over several threads; a cache that cannot be written leaves the compiles to
the wrappers with one notice."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from splitkv.core.architectures import ARCHITECTURES, architecture_properties
from splitkv.core.variants import PLAIN
from splitkv.measure import first_use_probes as FP
from splitkv.planner.first_use import probe_cases, probe_ctas_per_sm
from splitkv.runtime import compiled_builds
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.kernel_source import NVRTC_OPTIONS
from splitkv.runtime.per_shape import per_shape_plan
from splitkv.runtime.run_inputs import DecodeShape
from splitkv.testing import scattered_page_table


def cases_for(cc: int):
    device = architecture_properties(cc)
    return device, probe_cases(device.num_sms, probe_ctas_per_sm(device))


@pytest.mark.parametrize("cc", sorted(ARCHITECTURES))
def test_the_probe_builds_are_the_ones_each_probes_wrapper_picks(cc, monkeypatch):
    device, cases = cases_for(cc)
    monkeypatch.setattr(compiled_builds, "device_properties", lambda: device)
    monkeypatch.setattr(compiled_builds, "get_decode_kernels",
                        lambda build: SimpleNamespace(build=build))
    rng = np.random.default_rng(0)
    picked = []
    for case in cases:
        p = case.plan.problem
        table = scattered_page_table(p.kv_lens, p.page_size, rng)[0]
        shape = DecodeShape(p.num_qo_heads, p.num_kv_heads, p.head_dim, p.page_size, p.dtype,
                            None, "NHD")
        experiments = DecodeExperiments()
        base = compiled_builds.base_build(p.dtype, p.head_dim, p.group_size, p.page_size,
                                          None, experiments)
        # what BatchDecodeWrapper.plan(plan=) does with the plan on this GPU, then its build
        run = case.plan.with_execution(clusters=cc >= 90)
        built = per_shape_plan(run, table, shape=shape, heads=p.num_qo_heads, base=base,
                               experiments=experiments, variant=PLAIN, rows_array=None)
        picked.append(built.kernels.build)
    jobs = FP.probe_modules(cases, device)
    assert [job[0] for job in jobs] == [v.name for v in dict.fromkeys(picked)]
    assert all(job[1] == v.source() and job[2] == NVRTC_OPTIONS and job[3] == f"sm_{cc}"
               for job, v in zip(jobs, dict.fromkeys(picked)))
    if cc >= 90:            # a short request cut in 4 runs as a cluster of 4 there
        assert any(v.cluster == 4 for v in picked)


def never(*args, **kwargs):
    raise AssertionError("nothing should be compiled ahead")


def notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "splitkv"]


def test_an_unwritable_cache_leaves_the_compiles_to_the_wrappers(monkeypatch, caplog, tmp_path):
    """The folder is tried before anything compiles: one notice, and nothing compiled twice."""
    device, cases = cases_for(90)
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path / "a-file"))
    monkeypatch.setattr("splitkv.runtime.precompile_jobs.precompile", never)
    with caplog.at_level(logging.WARNING, logger="splitkv"):
        assert FP.compile_probe_builds(cases, device) == []
    notes = notices(caplog)
    assert len(notes) == 1 and "kernel cache cannot be written" in notes[0], notes


def test_a_failed_compile_leaves_the_compiles_to_the_wrappers(monkeypatch, caplog, tmp_path):
    device, cases = cases_for(90)
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))

    def broken(jobs, folder=None, workers=1):
        raise RuntimeError("NVRTC failed to compile decode.cu for sm_90: NVRTC_ERROR\nthe log")

    monkeypatch.setattr("splitkv.runtime.precompile_jobs.precompile", broken)
    with caplog.at_level(logging.WARNING, logger="splitkv"):
        assert FP.compile_probe_builds(cases, device) == []
    notes = notices(caplog)
    assert len(notes) == 1 and "NVRTC_ERROR" in notes[0] and "the log" not in notes[0], notes


def test_a_gpu_this_nvrtc_has_no_target_for_compiles_as_it_goes(monkeypatch, caplog, tmp_path):
    """An NVRTC older than the GPU: CuPy's own compiles take the nearest target; no notice."""
    device, cases = cases_for(120)
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("splitkv.runtime.kernel_source.nvrtc_archs", lambda: (75, 80, 90))
    monkeypatch.setattr("splitkv.runtime.precompile_jobs.precompile", never)
    with caplog.at_level(logging.WARNING, logger="splitkv"):
        assert FP.compile_probe_builds(cases, device) == []
    assert notices(caplog) == []


@pytest.mark.nvrtc
def test_compiling_the_probe_builds_fills_the_cache_the_runtime_reads(monkeypatch, tmp_path):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed")
    from splitkv.runtime.cubin_cache import cached_cubin

    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    device, cases = cases_for(80)
    records = FP.compile_probe_builds(cases, device, workers=2)
    jobs = FP.probe_modules(cases, device)
    assert [r["status"] for r in records] == ["written"] * len(jobs)
    for label, source, options, arch in jobs:
        assert cached_cubin(label, source, options, arch) is not None, label
    again = FP.compile_probe_builds(cases, device, workers=2)
    assert [r["status"] for r in again] == ["present"] * len(jobs)
