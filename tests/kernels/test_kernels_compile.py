"""Every kernel variant compiles through NVRTC for sm_80 and sm_90, with no GPU needed; the
register and spill report of each is printed after the run (conftest.REGISTER_REPORT), and the
main variants must not spill. The kernels' argument structs are laid out as
runtime/kernel_abi.py writes them (every compile checks sizes and kinds; the offsets are read
from a probe kernel's PTX), and the launch structs as cuda.h has them."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="CuPy is not installed (python3 -m pip install -e '.[cuda13]' or '.[cuda12]')")

from conftest import REGISTER_REPORT  # noqa: E402
from splitkv.core.variants import KernelVariant  # noqa: E402
from splitkv.runtime import kernel_abi  # noqa: E402
from splitkv.runtime.kernel_source import (KernelBuild, all_builds,  # noqa: E402
                                           compile_cubin, compile_ptx, fp8_builds, read_source)

# The cluster-merge variants build for sm_90 only; a sample covers every cluster size, dtype,
# head dim and row-tile count.
CLUSTER_SAMPLE = [KernelBuild("bfloat16", 128, 1, cluster=c) for c in (2, 4, 8)] + [
    KernelBuild("float16", 64, 2, cluster=8), KernelBuild("float16", 256, 4, cluster=2),
    KernelBuild("bfloat16", 96, 2, cluster=4)]

MAIN_VARIANTS = {KernelBuild(dt, d, ht) for dt in ("float16", "bfloat16") for d in (64, 96, 128)
                 for ht in (1, 2)}
_FUNC = re.compile(r"Function properties for (\w+)\s*\n.*?(\d+) bytes spill stores.*?\n.*?Used (\d+) registers",
                   re.S)


def resource_report(log: str) -> dict[str, tuple[int, int]]:
    """{kernel: (registers, spill store bytes)} from a `-Xptxas -v` log."""
    return {m.group(1): (int(m.group(3)), int(m.group(2))) for m in _FUNC.finditer(log)}


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", all_builds(), ids=lambda v: v.name)
def test_variant_compiles(variant, arch):
    cubin, log = compile_cubin(variant.source(), arch, variant.name, verbose=True)
    assert cubin[:4] == b"\x7fELF"
    report = resource_report(log)
    assert set(report) == {"decode_partial", "merge_partials"}, log
    regs, spill = report["decode_partial"]
    REGISTER_REPORT.append(f"{variant.name} {arch}: decode_partial {regs} regs, {spill} B "
                           f"spilled; merge_partials {report['merge_partials'][0]} regs")
    if variant in MAIN_VARIANTS:
        assert report["decode_partial"][1] == 0, f"{variant.name} spills registers on {arch}"


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", fp8_builds(), ids=lambda v: v.name)
def test_fp8_variant_compiles(variant, arch):
    """Every fp8-KV variant (both formats): the byte tiles and the widening in registers build
    for sm_80 (bit arithmetic, no fp8 instructions) and sm_90; the main shapes do not spill."""
    cubin, log = compile_cubin(variant.source(), arch, variant.name, verbose=True)
    assert cubin[:4] == b"\x7fELF"
    report = resource_report(log)
    if KernelBuild(variant.dtype, variant.head_dim, variant.row_tiles) in MAIN_VARIANTS:
        assert report["decode_partial"][1] == 0, f"{variant.name} spills registers on {arch}"


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", [KernelBuild(dt, 128, 1, kv_dtype=f)
                                     for dt in ("bfloat16", "float16")
                                     for f in ("float8_e4m3fn", "float8_e5m2")],
                         ids=lambda v: v.name)
def test_fp8_kernels_widen_in_registers_into_float16_mmas(variant):
    """The fp8 path computes in float16 (every fp8 value is exact there) whatever q's type, and
    widens e4m3fn with sm_89+'s two-at-a-time cvt, with bit arithmetic before sm_89; e5m2 is a
    float16's top byte, so byte permutes everywhere."""
    for arch, has_cvt in (("compute_80", False), ("compute_90", variant.kv_dtype.endswith("fn"))):
        ptx = _ptx(variant.source(), variant.name, arch)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx, arch
        assert ".bf16.bf16" not in ptx, arch
        assert ("cvt.rn.f16x2.e4m3x2" in ptx) == has_cvt, arch
        assert "e5m2x2" not in ptx, arch
    assert "cvt.rn.f16x2.e4m3x2" not in _ptx(replace(variant, kv_dtype="").source(), "plain", "compute_90")


def test_fp8_variants_keep_the_bytes_in_flight():
    """fp8 tiles are half the bytes, so the default fp8 variant takes twice the stages: the
    same shared memory (so the same CTAs per SM) as the 16-bit kernel."""
    for d in (64, 128, 256):
        plain, fp8 = KernelBuild("bfloat16", d, 1), KernelBuild("bfloat16", d, 1, kv_dtype="float8_e4m3fn")
        assert fp8.stages >= plain.stages
        assert fp8.shared_bytes <= plain.shared_bytes
    assert KernelBuild("bfloat16", 128, 1, kv_dtype="float8_e5m2").stages == 6
    assert KernelBuild("bfloat16", 128, 1, stages=3, kv_dtype="float8_e5m2").stages == 3


@pytest.mark.nvrtc
def test_compile_error_names_the_file():
    with pytest.raises(RuntimeError, match="broken.cu"):
        compile_cubin("extern \"C\" __global__ void k() { this is not C++ }", "sm_90", "broken.cu")


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", CLUSTER_SAMPLE, ids=lambda v: v.name)
def test_cluster_variant_compiles_for_sm90_only(variant):
    cubin, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert cubin[:4] == b"\x7fELF"
    if variant.head_dim <= 128:
        assert resource_report(log)["decode_partial"][1] == 0, f"{variant.name} spills registers"
    with pytest.raises(RuntimeError, match="CLUSTER needs sm_90"):
        compile_cubin(variant.source(), "sm_80", variant.name)


def _ptx(source: str, name: str, arch: str = "compute_90") -> str:
    return compile_ptx(source, name, arch)


def _params_source(defines: dict) -> str:
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + read_source("decode_params.cuh")


def _probed_offsets(ptx: str, count: int) -> list[int]:
    """The offsets an ``offset_probe`` kernel stored, from its PTX (NVVM folds them to
    constants)."""
    values = dict(re.findall(r"mov\.u64\s+(%rd\d+), (\d+);", ptx))
    stored = {}
    for slot, reg in re.findall(r"st\.volatile\.global\.u64\s+\[%rd\d+(?:\+(\d+))?\], (%rd\d+);", ptx):
        stored[int(slot or 0) // 8] = int(values[reg])
    return [stored[i] for i in range(count)]


def _device_plan_header() -> str:
    from splitkv.runtime.device_planner import header_defines

    return (header_defines() + "#define DEVICE_PLAN_HD __device__\n"
            + read_source("device_plan.cuh") + "using namespace device_plan;\n")


@pytest.mark.nvrtc
def test_every_field_of_the_kernel_structs_sits_where_the_mirror_writes_it():
    """kernel_abi.offset_probe stores each field's offset; the PTX says where
    decode_params.cuh puts every field."""
    ptx = _ptx(_params_source(KernelBuild("bfloat16", 128, 1).defines) + kernel_abi.offset_probe(),
               "abi_offsets.cu")
    fields = kernel_abi.fields()
    assert _probed_offsets(ptx, len(fields)) == [f[2] for f in fields]
    assert {"DecodeParams", "ChunkRecord"} == {f[0] for f in fields}


@pytest.mark.nvrtc
def test_the_device_planners_structs_sit_where_its_mirror_writes_them():
    """DevicePlanParams, DevicePlanState and the planner's Record, field by field, from the PTX
    of device_plan.cuh; the planning kernel's source carries the same structs' checks and the
    launch-order, strategy and merge numbering, and its feature columns from the host's table,
    and compiles."""
    from splitkv.runtime import device_planner

    fields = device_planner.layout_fields()
    ptx = _ptx(_device_plan_header() + kernel_abi.offset_probe(fields), "plan_offsets.cu")
    assert _probed_offsets(ptx, len(fields)) == [f[2] for f in fields]
    assert {"DevicePlanParams", "DevicePlanState", "Record"} == {f[0] for f in fields}
    checks = device_planner.layout_checks()
    assert "MERGE_TICKET == 2" in checks
    assert "X(15, split_x_requests, split_x_requests, 1) /* merge_grid */" in \
        device_planner.source()
    _ptx(device_planner.source(), "device_plan.cu")
    # the build that stamps its steps' clocks (device_plan_cost.py --phases) compiles too, and
    # only it holds the stamps
    assert "device_plan_phases" in _ptx(device_planner.source(phases=True), "device_plan.cu")
    assert "device_plan_phases" not in _ptx(device_planner.source(), "device_plan.cu")


@pytest.mark.nvrtc
def test_a_device_planner_mirror_that_differs_does_not_compile(monkeypatch):
    import ctypes

    from splitkv.runtime import device_planner

    class Shifted(ctypes.Structure):                  # one field of the wrong kind
        _fields_ = [(n, ctypes.c_float if n == "num_sms" else t)
                    for n, t in device_planner.DevicePlanParams._fields_]

    monkeypatch.setattr(device_planner, "DevicePlanParams", Shifted)
    with pytest.raises(Exception, match="DevicePlanParams.num_sms differs"):
        _ptx(device_planner.source(), "device_plan.cu")
    monkeypatch.undo()
    # a column reading a row the planner on the device does not compute
    from splitkv.planner.features import Feature

    monkeypatch.setattr(device_planner, "FEATURES",
                        (*device_planner.FEATURES, Feature("sm_wave_starts", "sm_waves", "count")))
    with pytest.raises(Exception, match='no member "sm_waves"'):
        _ptx(device_planner.source(), "device_plan.cu")


@pytest.mark.nvrtc
def test_a_mirror_that_differs_does_not_compile(monkeypatch):
    """The layout checks every variant's source carries fail on a field of the wrong size or
    kind, or one the kernel does not have."""
    base = _params_source(KernelBuild("float16", 64, 1).defines)
    _ptx(base + kernel_abi.layout_checks(), "checks.cu")          # the real mirror compiles
    real = kernel_abi.fields()
    wrong = [
        [(s, m, o, 4 if m == "page_stride" else n, k) for s, m, o, n, k in real],   # size
        [(s, m, o, n, 4 if m == "page_size" else k) for s, m, o, n, k in real],     # kind
        real + [("DecodeParams", "no_such_field", 0, 4, 3)],                          # name
    ]
    for fields in wrong:
        monkeypatch.setattr(kernel_abi, "fields", lambda fields=fields: fields)
        with pytest.raises(Exception):
            _ptx(base + kernel_abi.layout_checks(), "checks.cu")


def test_launch_structs_match_cuda_h():
    """runtime/launch.py's ctypes mirrors of CUlaunchAttribute (its value union with the PDL
    flag and clusterDim {x, y, z}) and CUlaunchConfig (cuda.h, 64-bit): the driver reads them
    by offset, so a wrong layout would launch garbage."""
    import ctypes

    from splitkv.runtime import launch

    assert ctypes.sizeof(launch._LaunchAttribute) == 72          # id, 4 pad bytes, 64-byte union
    assert launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(launch._LaunchAttributeValue) == 64
    assert launch._LaunchAttributeValue.programmatic_stream_serialization_allowed.offset == 0
    assert launch._LaunchAttributeValue.cluster_dim.offset == 0
    assert launch._LaunchAttributeValue.cluster_dim.size == 12   # three unsigned ints
    assert [getattr(launch._LaunchConfig, f).offset for f in
            ("grid", "block", "shared_bytes", "stream", "attrs", "num_attrs")] == [0, 12, 24, 32, 40, 48]
    assert ctypes.sizeof(launch._LaunchConfig) == 56
    # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert (launch._CLUSTER_DIMENSION, launch._PROGRAMMATIC_STREAM_SERIALIZATION) == (4, 6)


def test_decode_params_fill_by_name():
    """The host fills DecodeParams by field name; every name the kernel reads is there."""
    params = kernel_abi.DecodeParams(q=1 << 40, page_stride=-3, sm_scale_log2=0.5, lse=0)
    assert (params.q, params.page_stride, params.sm_scale_log2, params.lse) == (1 << 40, -3, 0.5, None)
    assert kernel_abi.CHUNK_RECORD.itemsize == kernel_abi.SIZES["ChunkRecord"] == 128


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", [KernelBuild("bfloat16", 128, 1, num_warps=8),
                                     KernelBuild("bfloat16", 128, 2, num_warps=8),
                                     KernelBuild("float16", 128, 4, num_warps=8),
                                     KernelBuild("bfloat16", 64, 1, num_warps=8),
                                     KernelBuild("bfloat16", 128, 1, kv_dtype="float8_e4m3fn",
                                                   num_warps=8),
                                     KernelBuild("float16", 64, 4, kv_dtype="float8_e5m2",
                                                   num_warps=8),
                                     KernelBuild("bfloat16", 128, 1, cluster=8,
                                                   kv_dtype="float8_e4m3fn", num_warps=8),
                                     KernelBuild("bfloat16", 128, 4, kv_dtype="float8_e4m3fn",
                                                   num_warps=8, variant=KernelVariant(soft_cap=True))],
                         ids=lambda v: v.name)
def test_eight_warp_experiment_compiles(variant):
    """8 warps (lone fp8 CTAs by default, and lone 16-bit CTAs with two row tiles or pages
    smaller than a row step, ``core.builds.plan_warps``; any build as an experiment):
    128-token tiles, 256 threads; the 16-bit and fp8 paths, clusters and the soft cap build
    without spills, and the host sizes follow the variant (tiles, threads, shared memory)."""
    cubin, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    report = resource_report(log)
    assert report["decode_partial"][1] == 0, log
    assert "_w8" in variant.name and variant.tile_tokens == 128 and variant.threads == 256
    four = replace(variant, num_warps=4)
    assert variant.shared_bytes >= four.shared_bytes
    with pytest.raises(ValueError, match="num_warps: expected 4 or 8"):
        replace(variant, num_warps=6)


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", [KernelBuild(dt, 128, rt, kv_dtype=kv, variant=KernelVariant(soft_cap=True))
                                     for dt, rt, kv in (("bfloat16", 1, ""), ("float16", 2, ""),
                                                        ("bfloat16", 1, "float8_e4m3fn"))],
                         ids=lambda v: v.name)
def test_soft_cap_builds_are_their_own(variant):
    """The logits soft cap is a build of its own (SOFT_CAP): the plain kernels' main loop does
    not carry it. Both build without spills for the main shapes."""
    cubin, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert resource_report(log)["decode_partial"][1] == 0, log
    assert variant.name.endswith("_softcap") and variant.defines["SOFT_CAP"] == 1
    assert with_hook(variant, "soft_cap", False).defines["SOFT_CAP"] == 0


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", [KernelBuild("bfloat16", 128, 1, variant=KernelVariant(multi_token=True)),
                                     KernelBuild("float16", 64, 4, cluster=4, variant=KernelVariant(multi_token=True)),
                                     KernelBuild("bfloat16", 128, 2,
                                                   kv_dtype="float8_e4m3fn", variant=KernelVariant(multi_token=True, soft_cap=True)),
                                     KernelBuild("bfloat16", 128, 1,
                                                   kv_dtype="float8_e5m2", num_warps=8, variant=KernelVariant(multi_token=True))],
                         ids=lambda v: v.name)
def test_multi_token_builds_are_their_own(variant):
    """plan(qo_indptr=) runs a MULTI_TOKEN build (rows of query row x head, a causal end a
    row): it builds without spills for 16-bit and fp8 K/V, clusters, the soft cap and 8 warps,
    and the plain build does not change."""
    cubin, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert resource_report(log)["decode_partial"][1] == 0, log
    assert variant.name.endswith("_mt") and variant.defines["MULTI_TOKEN"] == 1
    plain = with_hook(variant, "multi_token", False)
    assert plain.defines["MULTI_TOKEN"] == 0 and "_mt" not in plain.name


@pytest.mark.nvrtc
@pytest.mark.parametrize("kv_dtype", ["", "float8_e4m3fn"])
def test_q_in_shared_memory_ends_the_head_dim_256_spill(kv_dtype):
    """At head_dim 256 with 16 rows the register build spills (q's fragments are 64 registers
    beside O's 128); the Q_SMEM experiment keeps them in shared memory and does not. The plain
    build is unchanged by the option's existence (its name and defines say so)."""
    regs = KernelBuild("bfloat16", 256, 1, kv_dtype=kv_dtype)
    smem = replace(regs, q_in_smem=1)
    spills = {v.name: resource_report(compile_cubin(v.source(), "sm_90", v.name,
                                                    verbose=True)[1])["decode_partial"][1]
              for v in (regs, smem)}
    assert spills[smem.name] == 0, spills     # (the register build's: 204 bytes, 92 for fp8)
    assert smem.name.endswith("_qsmem") and regs.defines["Q_SMEM"] == 0
    assert smem.shared_bytes == regs.shared_bytes + 4 * 256 * 32


# Options with a build of their own: (field, define, name suffix), then variants that carry it.
OPTION_BUILDS = [
    ("unified_max", "UNIFIED_MAX", "_umax",
     [KernelBuild("bfloat16", 128, 1, variant=KernelVariant(unified_max=True)),
      KernelBuild("float16", 64, 2, cluster=4, variant=KernelVariant(unified_max=True)),
      KernelBuild("bfloat16", 128, 1, kv_dtype="float8_e4m3fn", variant=KernelVariant(unified_max=True)),
      KernelBuild("bfloat16", 128, 1, kv_dtype="float8_e5m2", num_warps=8, variant=KernelVariant(unified_max=True)),
      KernelBuild("bfloat16", 128, 2, variant=KernelVariant(unified_max=True, multi_token=True, soft_cap=True))]),
    ("alibi", "ALIBI", "_alibi",
     [KernelBuild("bfloat16", 128, 1, variant=KernelVariant(alibi=True)),
      KernelBuild("float16", 64, 4, variant=KernelVariant(alibi=True), cluster=4),
      KernelBuild("bfloat16", 256, 1, variant=KernelVariant(alibi=True), q_in_smem=1),
      KernelBuild("bfloat16", 128, 1, variant=KernelVariant(alibi=True), kv_dtype="float8_e4m3fn",
                  num_warps=8),
      KernelBuild("bfloat16", 128, 1, variant=KernelVariant(alibi=True), kv_dtype="float8_e5m2",
                  tile_per_warp=32),
      KernelBuild("bfloat16", 128, 2, variant=KernelVariant(alibi=True, multi_token=True,
                                                            soft_cap=True)),
      KernelBuild("bfloat16", 128, 1, variant=KernelVariant(alibi=True, unified_max=True))]),
    ("pow2_pages", "POW2_PAGES", "_pow2",
     [KernelBuild("bfloat16", 128, 1, pow2_pages=1),
      KernelBuild("float16", 64, 2, pow2_pages=1, cluster=4),
      KernelBuild("bfloat16", 128, 1, pow2_pages=1, kv_dtype="float8_e4m3fn",
                  variant=KernelVariant(multi_token=True))]),
]


@pytest.mark.nvrtc
@pytest.mark.parametrize("field,define,suffix,variant",
                         [(f, d, x, v) for f, d, x, vs in OPTION_BUILDS for v in vs],
                         ids=lambda p: p.name if isinstance(p, KernelBuild) else None)
def test_option_builds_are_their_own(field, define, suffix, variant):
    """plan(unified_max=) runs a UNIFIED_MAX build (a fixed offset, the band check and the
    running-max fallback pass); plan(alibi_slopes=) an ALIBI build (each row's linear bias on
    its scores, before the max); the POW2_PAGES experiment walks 2**k pages by shift and mask.
    Each builds without spills with clusters, fp8, 8 warps, multi-token rows and the soft cap
    where listed; its defines and name say which it is, and the plain build has none of it."""
    cubin, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert resource_report(log)["decode_partial"][1] == 0, log
    assert suffix + "_" in variant.name + "_" and variant.defines[define] == 1
    plain = (with_hook(variant, field, False) if field in KernelVariant.TAGS
             else replace(variant, **{field: 0}))
    assert plain.defines[define] == 0 and suffix not in plain.name


def with_hook(build: KernelBuild, name: str, on: bool) -> KernelBuild:
    """``build`` with its variant's hook ``name`` on or off."""
    return replace(build, variant=replace(build.variant, **{name: on}))


def hooks(**flags) -> dict:
    """A build's fields for a variant with these hooks on."""
    return {"variant": KernelVariant(**flags)}


def fields_id(fields: dict) -> str:
    names = [fields["variant"].tags.strip("_") if k == "variant" else k for k in fields]
    return "_".join(names) or "plain"


def default_build(head_dim: int, row_tiles: int, **fields) -> KernelBuild:
    """The 16-bit build a plan of ``head_dim`` and ``row_tiles`` runs by default (4 warps)."""
    from splitkv.core.builds import default_occupancy, default_q_in_smem

    return default_occupancy(KernelBuild("bfloat16", head_dim, row_tiles,
                                           q_in_smem=int(default_q_in_smem(head_dim)), **fields),
                             forced=False)


@pytest.mark.nvrtc
@pytest.mark.parametrize("head_dim,row_tiles", [(64, 1), (64, 2), (64, 4), (96, 1), (128, 1),
                                               (256, 1)])
def test_the_cost_models_residency_is_what_the_default_builds_hold(head_dim, row_tiles):
    """``features.resident_ctas`` (the slots the planner deals CTAs onto) against the default
    16-bit build's registers (NVRTC, sm_90) and shared memory on an H200-class SM (64 K
    registers allocated 256 a warp, 228 KiB of shared memory of which 1 KiB per CTA is the
    runtime's): a build whose residency moves must move the model with it."""
    from splitkv.planner.features import resident_ctas

    variant = default_build(head_dim, row_tiles)
    _, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    registers, spilled = resource_report(log)["decode_partial"]
    warp_registers = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (warp_registers * variant.threads // 32)
    by_shared = (228 * 1024) // (variant.shared_bytes + 1024)
    assert spilled == 0, variant.name
    assert min(by_registers, by_shared) == resident_ctas(head_dim, 2, 16 * row_tiles), (
        registers, variant.shared_bytes)


@pytest.mark.nvrtc
@pytest.mark.parametrize("fields", [{}, hooks(soft_cap=True), hooks(multi_token=True),
                                    {"cluster": 2}, {"cluster": 8}, {"pow2_pages": 1},
                                    hooks(unified_max=True), hooks(alibi=True)], ids=fields_id)
def test_the_four_an_sm_default_does_not_spill(fields):
    """core.builds.default_occupancy: head_dim 64's one-row-tile builds under the 128-register cap,
    with every feature a plan may add, spill nothing (the unified max, which would spill 16
    bytes, keeps the compiler's registers)."""
    variant = default_build(64, 1, **fields)
    assert (variant.max_registers == 128) == (not variant.variant.unified_max)
    _, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert resource_report(log)["decode_partial"][1] == 0, variant.name


@pytest.mark.nvrtc
@pytest.mark.parametrize("fields", [{}, hooks(soft_cap=True), {"cluster": 2}, {"pow2_pages": 1},
                                    hooks(unified_max=True)], ids=fields_id)
def test_the_fp8_long_tile_default_does_not_spill(fields):
    """core.builds.default_tile_per_warp: fp8 head_dim 128's 128-token tiles at 4 warps (one row
    tile) spill nothing with the features a per-shape plan may add."""
    from splitkv.core.builds import default_tile_per_warp

    assert default_tile_per_warp("float8_e4m3fn", 128, 4, 1, False) == 32
    variant = KernelBuild("bfloat16", 128, 1, kv_dtype="float8_e4m3fn", tile_per_warp=32,
                            **fields)
    _, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert resource_report(log)["decode_partial"][1] == 0, variant.name


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", [KernelBuild("bfloat16", 64, 1, tile_per_warp=32),
                                     KernelBuild("float16", 64, 2, tile_per_warp=32),
                                     KernelBuild("bfloat16", 128, 1, kv_dtype="float8_e4m3fn",
                                                   tile_per_warp=32),
                                     KernelBuild("bfloat16", 128, 1, kv_dtype="float8_e5m2",
                                                   tile_per_warp=32, cluster=4),
                                     KernelBuild("bfloat16", 64, 1, tile_per_warp=32, variant=KernelVariant(multi_token=True, soft_cap=True))],
                         ids=lambda v: v.name)
def test_tiles_of_32_tokens_a_warp_compile(variant):
    """The tile_per_warp=32 experiment (TILE_N = 32 x warps): 128-token tiles at 4 warps, half
    the default stages, without spills for the rows of 128 bytes it is for; the default builds'
    sources carry no TILE_N define (so their cached binaries stay the same)."""
    _, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert resource_report(log)["decode_partial"][1] == 0, log
    default = replace(variant, tile_per_warp=16, stages=0)
    assert variant.tile_tokens == 128 and variant.name.endswith("_t128")
    assert variant.stages == max(2, default.stages // 2)
    assert variant.defines["TILE_N"] == 128 and "TILE_N" not in default.defines
    with pytest.raises(ValueError, match="tile_per_warp: expected 16 or 32"):
        replace(variant, tile_per_warp=64)


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", [
    KernelBuild("bfloat16", 256, 1, num_warps=8, dim_split=2),
    KernelBuild("bfloat16", 256, 1, num_warps=8, dim_split=2, q_in_smem=1),
    KernelBuild("float16", 256, 2, num_warps=8, dim_split=2, cluster=4),
    KernelBuild("bfloat16", 256, 1, num_warps=8, dim_split=2, variant=KernelVariant(multi_token=True, soft_cap=True)),
    KernelBuild("bfloat16", 128, 1, num_warps=8, dim_split=2)], ids=lambda v: v.name)
def test_the_head_dim_split_between_warp_pairs_compiles(variant):
    """The dim_split experiment (WARPS_D = 2): 8 warps keep 64-token tiles, so head_dim 256
    fits two stages in 128 KiB, with half of O's registers a warp and no spills up to two row
    tiles (four at d256 spill 8 bytes); fp8 and the unified max are refused by name (their
    per-warp paths hold every dim)."""
    _, log = compile_cubin(variant.source(), "sm_90", variant.name, verbose=True)
    assert resource_report(log)["decode_partial"][1] == 0, log
    assert variant.tile_tokens == 64 and variant.defines["WARPS_D"] == 2
    assert "_dsplit2" in variant.name and "WARPS_D" not in replace(variant, dim_split=1).defines
    if variant.head_dim == 256 and not variant.q_in_smem:
        assert variant.shared_bytes <= 131 * 1024
    for bad in ({"kv_dtype": "float8_e4m3fn"}, hooks(unified_max=True)):
        with pytest.raises(ValueError, match="^dim_split: 16-bit K/V and the running max"):
            replace(variant, **bad)
    with pytest.raises(ValueError, match="dim_split: expected 1 or 2"):
        replace(variant, dim_split=4)


@pytest.mark.nvrtc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_dissect_cuts_build(head_dim):
    """benchmarks/dissect_latency.py times builds with stages cut out (KernelBuild.dissect, the
    kernel's DISSECT bits): each builds, and differs from the full kernel where its cut is (the
    K/V copies read nothing, the page lookups, the ticket merge, either kernel at once); a
    real build carries no DISSECT define."""
    from splitkv.runtime.kernel_source import DISSECT_CUTS

    base = KernelBuild("bfloat16", head_dim, 1)
    assert "DISSECT" not in base.defines
    full = _ptx(base.source(), base.name)
    for cut in DISSECT_CUTS:
        variant = replace(base, dissect=cut)
        assert variant.defines["DISSECT"] == DISSECT_CUTS[cut] and variant.name.endswith(cut)
        ptx = _ptx(variant.source(), variant.name)
        assert ptx != full, cut
        # (the cut-out ticket merge leaves no atomic; "empty" returns at run time, the code stays)
        assert ("atom.global.inc" in ptx) == (cut not in ("no_merge", "bare")), cut
    with pytest.raises(ValueError, match="dissect: expected"):
        replace(base, dissect="no_such_cut")


@pytest.mark.nvrtc
def test_the_dissect_plan_sets_name_bench_cases():
    import importlib.util
    from pathlib import Path

    from splitkv.bench.cases import select

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "dissect_latency.py"
    spec = importlib.util.spec_from_file_location("dissect_latency", path)
    dissect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dissect)
    for plans in dissect.PLAN_SETS.values():      # every plan set names bench cases
        assert [c.name for c in select(",".join(plans))] == list(plans)


@pytest.mark.nvrtc
def test_a_plain_run_is_quiet_and_a_verbose_one_reports_registers(tmp_path):
    """The register report of the compiled variants prints after ``pytest -v`` only."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pick = ["-k", "test_variant_compiles and decode_float16_d64_r16_s4 and sm_90", "-p",
            "no:cacheprovider", str(Path(__file__).resolve())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root),
                                                       os.environ.get("PYTHONPATH", "")]))
    outputs = {}
    for flag in ("-q", "-v"):
        done = subprocess.run([sys.executable, "-m", "pytest", flag, *pick], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "1 passed" in done.stdout, done.stdout
        outputs[flag] = done.stdout
    assert "register report" not in outputs["-q"]
    assert "NVRTC register report (1 builds)" in outputs["-v"]
