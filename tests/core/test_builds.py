"""``core.builds`` decides the builds the runtime chose before the rules moved there: every case
of ``helpers.build_cases`` (shapes, K/V dtypes, page sizes, per-shape plans, graph-stable grids,
experiments) on an H200 and on GPUs of less shared memory a block (A100, L40S), against the
decisions recorded then (``helpers/data/build_decisions.json``); and the runtime's entry points
(``runtime.compiled_builds``) compile exactly what the core decides. No GPU: the device is
plain data."""

from __future__ import annotations

import functools
import json
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from splitkv.core import builds
from splitkv.core.variants import KernelVariant
from splitkv.core.builds import (H200, Build, BuildForces, DeviceProperties, PlanGrid,
                                 decode_build, graph_build, row_tiles_for, shape_build)

from helpers.build_cases import DEVICES, graph_cases, plan_cases

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "helpers" / "data"
                       / "build_decisions.json").read_text())
FORCE_FIELDS = tuple(f.name for f in fields(BuildForces))


def device(name: str) -> DeviceProperties:
    sms, optin, per_sm, cc = DEVICES[name]
    return DeviceProperties(sms, optin, per_sm, cc, name)


def forces_of(case: dict) -> BuildForces:
    return BuildForces(**{k: v for k, v in case["experiments"].items() if k in FORCE_FIELDS})


def plan_grid(case: dict) -> PlanGrid:
    """The grid the wrapper hands the rules: its rows a kv head (q_len x the group) up to the
    rows a CTA (the rows_per_cta experiment's cap)."""
    rows = min(case["group_size"] * case["q_len"], case["experiments"].get("rows_per_cta", 64))
    return PlanGrid(case["ctas"], float(np.mean(case["chunk_tokens"])), case["cluster_size"],
                    row_tiles_for(rows),
                    KernelVariant(case["soft_cap"], case["q_len"] > 1, case["unified_max"]))


def decided(make, case: dict) -> str:
    """The recorded form of a decision: the build's fields, or the error it raises."""
    try:
        build = make()
    except ValueError:
        return "ValueError"
    assert (build.dtype, build.head_dim, build.kv_dtype) == (
        case["dtype"], case["head_dim"], case["kv_dtype"])
    return ",".join(recorded_value(build, name) for name in RECORDED["fields"])


def recorded_value(build, name: str) -> str:
    """A field of ``build`` as the record writes it (a variant's hook as 0 or 1)."""
    if name in KernelVariant.TAGS:
        return str(int(getattr(build.variant, name)))
    return str(getattr(build, name))


def recorded(kind: str, name: str) -> list[str]:
    return [RECORDED["decisions"][i] for i in RECORDED[kind][name]]


def mismatches(cases, want, got) -> list:
    return [(case, w, g) for case, w, g in zip(cases, want, got) if w != g][:5]


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_per_shape_plans_get_the_builds_the_runtime_chose(name):
    cases = plan_cases(name)
    dev = device(name)
    got = [decided(lambda: decode_build(c["dtype"], c["head_dim"], c["group_size"],
                                        c["page_size"], c["kv_dtype"], plan_grid(c), dev,
                                        forces_of(c)), c) for c in cases]
    want = recorded("plan", name)
    assert got == want, mismatches(cases, want, got)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_graph_stable_grids_get_the_builds_the_runtime_chose(name):
    cases = graph_cases(name)
    dev = device(name)

    def make(c):
        forces = forces_of(c)
        base = shape_build(c["dtype"], c["head_dim"], c["group_size"], c["page_size"],
                           c["kv_dtype"], forces)
        return graph_build(base, variant=KernelVariant(c["soft_cap"], c["max_q_len"] > 1),
                           rows=c["group_size"] * c["max_q_len"], device=dev, forces=forces)

    got = [decided(lambda: make(c), c) for c in cases]
    want = recorded("graph", name)
    assert got == want, mismatches(cases, want, got)


def test_the_recorded_cases_meet_every_decision():
    """The grid is wide enough to mean something: 4 and 8 warps, 16 and 32 tokens a warp, both
    page walks, q in and out of shared memory, the 4-an-SM occupancy, every cluster size, and
    builds given up to fit a smaller block (A100, L40S) are all among the recorded decisions."""
    columns = RECORDED["fields"]
    values = {name: set() for name in columns}
    for decision in RECORDED["decisions"]:
        if decision != "ValueError":
            for name, value in zip(columns, decision.split(",")):
                values[name].add(int(value))
    assert values["num_warps"] == {4, 8} and values["tile_per_warp"] == {16, 32}
    assert values["pow2_pages"] == values["q_in_smem"] == {0, 1}
    assert {0, 128} <= values["max_registers"] and values["cluster"] == {0, 2, 4, 8}
    assert "ValueError" in RECORDED["decisions"]
    # a lone 16-bit plan of long chunks at head_dim 128, group 32: 8 warps on the H200 (128 KiB),
    # 4 on the L40S (99 KiB a block)
    grid = PlanGrid(8, 8192.0, row_tiles=2)
    assert decode_build("bfloat16", 128, 32, 16, "", grid, H200).num_warps == 8
    assert decode_build("bfloat16", 128, 32, 16, "", grid, device("L40S")).num_warps == 4


@pytest.mark.parametrize("name", ["H200", "L40S"])
def test_the_runtime_compiles_what_the_core_decides(name, monkeypatch):
    """runtime.compiled_builds' entry points, with the device as plain data and the compile left
    out, give the core's builds as ``KernelBuild``s."""
    from splitkv.runtime import compiled_builds as runtime_builds
    from splitkv.runtime.experiments import DecodeExperiments
    from splitkv.runtime.kernel_source import KernelBuild

    dev = device(name)
    monkeypatch.setattr(runtime_builds, "device_properties", lambda: dev)
    monkeypatch.setattr(runtime_builds, "get_decode_kernels",
                        lambda build: SimpleNamespace(build=build))
    for c in plan_cases(name)[:400]:
        ex = DecodeExperiments(**c["experiments"])
        try:
            want = decode_build(c["dtype"], c["head_dim"], c["group_size"], c["page_size"],
                                c["kv_dtype"], plan_grid(c), dev, forces_of(c))
        except ValueError:
            continue
        base = runtime_builds.base_build(c["dtype"], c["head_dim"], c["group_size"],
                                            c["page_size"], c["kv_dtype"] or None, ex)
        grid = plan_grid(c)
        plan = SimpleNamespace(chunk_start=np.zeros(len(c["chunk_tokens"]), np.int64),
                               chunk_end=np.array(c["chunk_tokens"]),
                               cluster_size=c["cluster_size"])
        got = runtime_builds.per_shape_kernels(
            base, plan, grid.ctas, grid.row_tiles, page_size=c["page_size"], experiments=ex,
            variant=grid.variant).build
        assert isinstance(got, KernelBuild) and got == KernelBuild.of(want), c


def test_a_build_becomes_a_variant_field_for_field():
    build = Build("float16", 128, 2, kv_dtype="float8_e5m2", num_warps=8, pow2_pages=1)
    from splitkv.runtime.kernel_source import KernelBuild

    variant = KernelBuild.of(build)
    assert all(getattr(variant, f.name) == getattr(build, f.name) for f in fields(Build))
    assert KernelBuild.of(variant) is variant
    assert variant.name == "decode_float16_d128_r32_s3_kv_e5m2_w8_pow2"


def test_an_unknown_block_size_fits_every_build():
    """A cost model's device records its SMs only: the build is the rules' before any fit."""
    wide = Build("bfloat16", 256, 4, kv_dtype="float8_e4m3fn", num_warps=8, q_in_smem=1)
    assert builds.fitting_build(wide, q_default=True, warps_default=True,
                                shared_limit=0) is wide
    assert builds.fitting_build(wide, q_default=True, warps_default=True,
                                shared_limit=166912).q_in_smem == 0


def test_fp8_plans_with_one_cta_an_sm_or_fewer_get_eight_warps():
    warps = functools.partial(builds.plan_warps, num_sms=132)
    assert warps("float8_e4m3fn", 132) == 8
    assert warps("float8_e5m2", 1) == 8
    assert warps("float8_e4m3fn", 133) == 4
    assert warps(None, 8) == 4 and warps("", 8) == 4
    assert warps("float8_e4m3fn", 8, forced=4) == 4
    assert warps(None, 1000, forced=8) == 8


def test_sixteen_bit_lone_ctas_get_eight_warps_where_four_are_issue_bound():
    warps = functools.partial(builds.plan_warps, num_sms=132, mean_chunk_tokens=4096)
    assert warps(None, 128, row_tiles=2) == 8                                # group 32
    assert warps(None, 128, page_size=1) == 8                                # page 1, d128
    assert warps(None, 128, page_size=2, head_dim=64) == 8
    assert warps(None, 128, page_size=2) == 4                                # d128's step: 2
    assert warps(None, 128) == 4                                             # group 4, page 16
    assert warps(None, 133, row_tiles=2) == 4                                # two a SM
    assert warps(None, 128, row_tiles=2, mean_chunk_tokens=2047) == 4
    assert warps(None, 128, row_tiles=2, head_dim=256) == 4
    assert warps(None, 128, row_tiles=2, forced=4) == 4
    assert warps(None, 128, row_tiles=2, multi_token=True) == 4
    assert warps("float8_e4m3fn", 128, multi_token=True) == 8
    assert builds.row_step(128, 1, 2) == 2 and builds.row_step(64, 1, 2) == 4
    assert builds.row_step(128, 2, 2) == 4 and builds.row_step(256, 1, 2) == 1


def test_q_in_smem_and_pow2_pages_defaults_follow_the_shape():
    assert builds.default_q_in_smem(256) and not builds.default_q_in_smem(128)
    assert not builds.default_q_in_smem(64)
    assert builds.default_pow2_pages(1, 128, 1, 2)              # row step 2
    assert not builds.default_pow2_pages(2, 128, 1, 2)          # not smaller than the step
    assert builds.default_pow2_pages(2, 64, 1, 2)               # row step 4
    assert not builds.default_pow2_pages(3, 64, 1, 2)           # not a power of two
    assert not builds.default_pow2_pages(16, 128, 4, 2)         # row step 8
    assert builds.default_pow2_pages(2, 128, 1, 1)              # fp8 rows: step 4


def test_occupancy_and_tile_defaults_follow_the_shape():
    """default_occupancy: 4 CTAs an SM (3 stages, 128 registers) for 16-bit head_dim 64 of one
    row tile at 4 warps, where nothing forced the stages or registers; default_tile_per_warp:
    128-token tiles for fp8 head_dim 128 at 4 warps and one row tile (grids past one CTA an
    SM), lone 8-warp grids and multi-token plans keep 16 a warp."""
    d64 = Build("bfloat16", 64, 1)
    four = builds.default_occupancy(d64, forced=False)
    assert (four.stages, four.max_registers) == (3, 128) and d64.stages == 4
    assert builds.default_occupancy(d64, forced=True) is d64
    for other in (Build("bfloat16", 64, 2), Build("bfloat16", 128, 1),
                  Build("bfloat16", 64, 1, kv_dtype="float8_e4m3fn"),
                  Build("bfloat16", 64, 1, num_warps=8),
                  Build("bfloat16", 64, 1, tile_per_warp=32),
                  Build("bfloat16", 64, 1, variant=KernelVariant(unified_max=True))):
        assert builds.default_occupancy(other, forced=False) is other, other
    tile = builds.default_tile_per_warp
    assert tile("float8_e4m3fn", 128, 4, 1, False) == 32
    assert tile("float8_e4m3fn", 128, 8, 1, False) == 16
    assert tile("float8_e4m3fn", 128, 4, 2, False) == 16
    assert tile("float8_e4m3fn", 128, 4, 1, True) == 16
    assert tile("float8_e4m3fn", 64, 4, 1, False) == 16
    assert tile(None, 128, 4, 1, False) == 16


def test_a_default_build_past_the_devices_shared_memory_gives_way():
    """fitting_build: on a GPU with less shared memory a block than the H200, the defaults are
    given up in turn (q in shared memory, then 8 warps) until the build fits; what an
    experiment forced stays, and a build that fits is kept as it is."""
    fit = builds.fitting_build
    eight = Build("bfloat16", 128, 2, num_warps=8)                     # 131,168 B
    assert fit(eight, q_default=True, warps_default=True, shared_limit=232448) is eight
    four = fit(eight, q_default=True, warps_default=True, shared_limit=101376)   # sm_86/89
    assert (four.num_warps, four.stages) == (4, 3) and four.shared_bytes <= 101376
    assert fit(eight, q_default=True, warps_default=False, shared_limit=101376) is eight
    # a forced stage count is kept when the warps give way
    deep = Build("bfloat16", 128, 2, stages=4, num_warps=8)            # 262,240 B
    kept = fit(deep, q_default=False, warps_default=True, shared_limit=232448, stages=4)
    assert (kept.num_warps, kept.stages) == (4, 4)
    # A100: fp8 head_dim 256 with 8 warps keeps them and gives up q in shared memory
    fp8_d256 = Build("bfloat16", 256, 1, kv_dtype="float8_e4m3fn", num_warps=8, q_in_smem=1)
    a100 = fit(fp8_d256, q_default=True, warps_default=True, shared_limit=166912)
    assert (a100.num_warps, a100.q_in_smem) == (8, 0) and a100.shared_bytes <= 166912
    forced = fit(fp8_d256, q_default=False, warps_default=False, shared_limit=166912)
    assert forced is fp8_d256                         # too big, and refused by name at its build
    assert replace(fp8_d256, q_in_smem=0).shared_bytes < fp8_d256.shared_bytes


def test_head_dim_256_gives_way_to_fewer_stages_and_the_split_on_99_kib():
    """At 99 KiB a block (sm_86, sm_89, sm_120) head_dim 256's 4-warp defaults are over (128
    KiB of tiles): fp8 gives up stages (3 of 64-token tiles, 96 KiB), 16-bit, whose 2 stages
    are the fewest, splits the head dim between the warp pairs of 4 warps (32-token tiles);
    neither where an experiment forced the stages or the split, nor for the unified max (its
    row check is per warp of all dims), which stays over and is refused at compile."""
    fit = functools.partial(builds.fitting_build, q_default=True, warps_default=True,
                            shared_limit=101376, split_default=True)
    fp8 = fit(Build("bfloat16", 256, 1, kv_dtype="float8_e4m3fn", num_warps=8, q_in_smem=1))
    assert (fp8.num_warps, fp8.stages, fp8.q_in_smem, fp8.dim_split) == (4, 3, 0, 1)
    plain = Build("bfloat16", 256, 2, q_in_smem=1)
    split = fit(plain)
    assert (split.num_warps, split.dim_split, split.tile_tokens, split.stages) == (4, 2, 32, 3)
    assert split.shared_bytes <= 101376 < plain.shared_bytes
    assert fit(plain, stages=2) is plain
    assert builds.fitting_build(plain, q_default=True, warps_default=True,
                                shared_limit=101376) is plain        # the split not allowed
    umax = replace(plain, variant=KernelVariant(unified_max=True))
    assert fit(umax) is umax
    # through the decision, for a GPU's properties: sm_120 splits, the H200 keeps its default
    from splitkv.core.architectures import device_properties
    grid = PlanGrid(600, 512.0)
    rtx = decode_build("bfloat16", 256, 2, 16, "", grid, device_properties("NVIDIA GeForce RTX 5090"))
    assert (rtx.dim_split, rtx.num_warps) == (2, 4)
    h200 = decode_build("bfloat16", 256, 2, 16, "", grid, H200)
    assert (h200.dim_split, h200.num_warps, h200.stages, h200.q_in_smem) == (1, 4, 2, 1)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_plans_build_is_among_the_builds_warmup_compiles(name):
    """``reachable_builds`` (what ``warmup()`` compiles) holds the build of every recorded plan
    case of its options: no plan of a warmed-up wrapper meets a build it did not compile."""
    dev = device(name)
    missing = []
    for c in plan_cases(name) + [dict(c, ctas=1, chunk_tokens=[40000]) for c in plan_cases(name)]:
        forces = forces_of(c)
        try:
            build = decode_build(c["dtype"], c["head_dim"], c["group_size"], c["page_size"],
                                 c["kv_dtype"], plan_grid(c), dev, forces)
        except ValueError:
            continue
        base = shape_build(c["dtype"], c["head_dim"], c["group_size"], c["page_size"],
                           c["kv_dtype"], forces)
        reachable = builds.reachable_builds(
            base, device=dev, page_size=c["page_size"], group_size=c["group_size"],
            soft_caps=(c["soft_cap"],), max_q_len=c["q_len"], unified_max=c["unified_max"],
            clusters=c["cluster_size"] > 0,
            rows_per_cta=c["experiments"].get("rows_per_cta", 64), forces=forces)
        if build not in reachable:
            missing.append((c, build))
    assert not missing, missing[:2]


def test_a_graph_stable_wrapper_reaches_one_build_a_soft_cap_setting():
    base = shape_build("bfloat16", 128, 4, 16, "")
    both = builds.reachable_builds(base, device=H200, page_size=16, group_size=4,
                                   soft_caps=(False, True), graph_stable=True)
    assert len(both) == 2 and {b.variant.soft_cap for b in both} == {False, True}
