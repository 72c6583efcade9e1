"""Every architecture users run builds its kernels: for compute capability 8.0, 8.6, 8.9, 9.0,
10.0 and 12.0, the builds a wrapper would run there (``core.builds`` with one GPU's
``DeviceProperties`` of that architecture, ``core.architectures``: no cluster below 9.0, the fit
to its shared memory a block) over a grid of shapes (16-bit and fp8 K/V, head_dim 64/96/128/256,
groups 1-32, pages 1/16/64, per-shape plans of every kind and graph-stable grids). The shared
memory of every build is checked without a compiler; a sample covering every build field's
values (and every build the fit to 99 KiB gave way to) compiles through NVRTC for that
``-arch=sm_XX``, with its static and dynamic shared memory within the block's limit."""

from __future__ import annotations

import functools
import itertools
import re

import pytest

from splitkv.core.architectures import ARCHITECTURES, architecture_properties
from splitkv.core.builds import PlanGrid, decode_build, graph_build, row_tiles_for, shape_build
from splitkv.core.validation import FP8_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from splitkv.core.variants import KernelVariant

GROUPS = (1, 4, 8, 16, 32)
PAGES = (1, 16, 64)
KV = ("", "float8_e4m3fn", "float8_e5m2")


def _grids(num_sms: int, clusters: bool, group: int) -> list[PlanGrid]:
    """The per-shape plans' grids a wrapper meets: many CTAs of short chunks, lone CTAs of
    long and of short chunks, clusters of 2 and 8 (9.0 and newer), the soft cap, the unified
    max and multi-token rows (2 query rows a request: twice the group's rows)."""
    rt = row_tiles_for(group)
    return [PlanGrid(4 * num_sms, 512.0, row_tiles=rt), PlanGrid(8, 8192.0, row_tiles=rt),
            PlanGrid(8, 512.0, row_tiles=rt),
            PlanGrid(32, 512.0, 2 if clusters else 0, rt),
            PlanGrid(16, 1024.0, 8 if clusters else 0, rt, KernelVariant(soft_cap=True)),
            PlanGrid(8, 4096.0, row_tiles=rt, variant=KernelVariant(unified_max=True)),
            PlanGrid(4 * num_sms, 512.0, row_tiles=row_tiles_for(2 * group),
                     variant=KernelVariant(multi_token=True))]


@functools.lru_cache(maxsize=None)
def builds_for(cc: int) -> tuple:
    """Every distinct build a wrapper on an architecture ``cc`` GPU runs over the grid."""
    dev = architecture_properties(cc)
    clusters = ARCHITECTURES[cc].clusters
    found = {}
    for dtype, kv, d, g, page in itertools.product(("bfloat16", "float16"), KV,
                                                   SUPPORTED_HEAD_DIMS, GROUPS, PAGES):
        if kv and d not in FP8_HEAD_DIMS:
            continue
        for grid in _grids(dev.num_sms, clusters, g):
            build = decode_build(dtype, d, g, page, kv, grid, dev)
            found.setdefault(build, None)
        base = shape_build(dtype, d, g, page, kv)
        for q_len in (1, 2):
            found.setdefault(graph_build(base, variant=KernelVariant(q_len > 1, q_len > 1),
                                         rows=g * q_len, device=dev), None)
    return tuple(found)


def over_99_kib_by_design(build) -> bool:
    """What no build of the kernel fits in 99 KiB a block: head_dim 256 with more than 32
    rows a CTA (two stages of 64-token tiles, or a cluster's 64-row partial state, are 128
    KiB), or 16-bit with the unified max, whose row check cannot split the head dim. The
    runtime refuses these by name (runtime.modules: "needs N bytes of shared memory")."""
    return build.head_dim == 256 and (build.row_tiles == 4
                                      or (not build.kv_dtype and build.variant.unified_max))


@pytest.mark.parametrize("cc", sorted(ARCHITECTURES))
def test_every_build_fits_the_architectures_shared_memory(cc):
    arch = ARCHITECTURES[cc]
    builds = builds_for(cc)
    assert len(builds) > 100
    if not arch.clusters:
        assert not any(b.cluster for b in builds)
    else:
        assert {b.cluster for b in builds} == {0, 2, 8}
    over = [b for b in builds if b.shared_bytes > arch.shared_per_block_optin]
    if arch.shared_per_block_optin >= 163 * 1024:
        assert over == []
    else:
        assert over and all(map(over_99_kib_by_design, over)), [
            b for b in over if not over_99_kib_by_design(b)][:3]
        # head_dim 256 runs there: fp8 at fewer stages, 16-bit split between warp pairs
        fitted = [b for b in builds if b.head_dim == 256 and b not in over]
        assert any(b.kv_dtype and b.stages == 3 for b in fitted)
        assert any(b.dim_split == 2 and b.num_warps == 4 for b in fitted)


# The build fields whose values the compiled sample covers, each value at least once per
# architecture, and the pairs that pick different code paths together.
def _traits(b) -> set:
    single = {("dtype", b.dtype), ("kv", b.kv_dtype), ("d", b.head_dim), ("rt", b.row_tiles),
              ("warps", b.num_warps), ("tile", b.tile_tokens), ("split", b.dim_split),
              ("q", b.q_in_smem), ("pow2", b.pow2_pages), ("cluster", b.cluster),
              ("cap", b.variant.soft_cap), ("mt", b.variant.multi_token), ("umax", b.variant.unified_max),
              ("regs", b.max_registers), ("stages", b.stages)}
    return single | {("kv,d", b.kv_dtype, b.head_dim), ("d,warps", b.head_dim, b.num_warps),
                     ("d,split", b.head_dim, b.dim_split)}


def compiled_sample(cc: int) -> list:
    """A greedy cover of ``_traits`` over the builds that fit (the largest first, so the
    tightest fits are compiled), deterministic."""
    limit = ARCHITECTURES[cc].shared_per_block_optin
    builds = sorted((b for b in builds_for(cc) if b.shared_bytes <= limit),
                    key=lambda b: (-b.shared_bytes, repr(b)))
    left = set().union(*map(_traits, builds))
    sample = []
    while left:
        best = max(builds, key=lambda b: len(_traits(b) & left))
        sample.append(best)
        left -= _traits(best)
    return sample


SAMPLE = [(cc, b) for cc in sorted(ARCHITECTURES) for b in compiled_sample(cc)]
_SMEM = re.compile(r"Compiling entry function '(\w+)'.*?Used (\d+) registers(?:.*?(\d+) bytes smem)?",
                   re.S)


@pytest.mark.nvrtc
@pytest.mark.parametrize("cc,build", SAMPLE,
                         ids=[f"sm_{cc}-{i}" for i, (cc, _) in enumerate(SAMPLE)])
def test_the_sampled_builds_compile_for_their_architecture(cc, build):
    from conftest import REGISTER_REPORT
    from splitkv.runtime.kernel_source import KernelBuild, compile_cubin
    from test_kernels_compile import resource_report

    arch = ARCHITECTURES[cc]
    variant = KernelBuild.of(build)
    cubin, log = compile_cubin(variant.source(), arch.arch, variant.name, verbose=True)
    assert cubin[:4] == b"\x7fELF"
    report = resource_report(log)
    assert set(report) == {"decode_partial", "merge_partials"}, log
    regs, spill = report["decode_partial"]
    assert regs * variant.threads <= 65536, (variant.name, regs)
    static = {m.group(1): int(m.group(3) or 0) for m in _SMEM.finditer(log)}
    assert static["decode_partial"] + variant.shared_bytes <= arch.shared_per_block_optin, (
        variant.name, static, variant.shared_bytes)
    REGISTER_REPORT.append(f"{variant.name} {arch.arch}: decode_partial {regs} regs, {spill} B "
                           f"spilled, {variant.shared_bytes:,} B shared")


def test_the_sample_covers_each_architecture_and_stays_small():
    """Every architecture compiles a sample, the fits to 99 KiB among it, a few minutes of
    NVRTC in all (about 2.5 s a build)."""
    per_arch = {cc: [b for c, b in SAMPLE if c == cc] for cc in ARCHITECTURES}
    assert all(8 <= len(s) <= 25 for s in per_arch.values()), {c: len(s) for c, s in per_arch.items()}
    assert len(SAMPLE) <= 110
    for cc in (86, 89, 120):
        assert any(b.dim_split == 2 for b in per_arch[cc])
        assert any(b.head_dim == 256 and b.kv_dtype for b in per_arch[cc])
    for cc in (90, 100, 120):
        assert {2, 8} <= {b.cluster for b in per_arch[cc]}
