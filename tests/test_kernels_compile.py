"""Every kernel variant compiles through NVRTC for sm_80 and sm_90, with no GPU needed; the
register and spill report of each is printed, and the main variants must not spill."""

from __future__ import annotations

import re

import pytest

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="CuPy with NVRTC not installed (pip install -e '.[nvrtc]')")

from splitkv.bench.bandwidth import PROBE_SHAPES, read_kernel_source  # noqa: E402
from splitkv.runtime.kernel_source import DecodeVariant, all_variants, compile_cubin  # noqa: E402

# The cluster-merge variants build for sm_90 only; a sample covers every cluster size, dtype,
# head dim and row-tile count.
CLUSTER_SAMPLE = [DecodeVariant("bfloat16", 128, 1, cluster=c) for c in (2, 4, 8)] + [
    DecodeVariant("float16", 64, 2, cluster=8), DecodeVariant("float16", 256, 4, cluster=2)]

MAIN_VARIANTS = {DecodeVariant(dt, d, ht) for dt in ("float16", "bfloat16") for d in (64, 128)
                 for ht in (1, 2)}
_FUNC = re.compile(r"Function properties for (\w+)\s*\n.*?(\d+) bytes spill stores.*?\n.*?Used (\d+) registers",
                   re.S)


def resource_report(log: str) -> dict[str, tuple[int, int]]:
    """{kernel: (registers, spill store bytes)} from a `-Xptxas -v` log."""
    return {m.group(1): (int(m.group(3)), int(m.group(2))) for m in _FUNC.finditer(log)}


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", all_variants(), ids=lambda v: v.name)
def test_variant_compiles(variant, arch, capsys):
    cubin, log = compile_cubin(variant.source(), arch, variant.name, verbose=True)
    assert cubin[:4] == b"\x7fELF"
    report = resource_report(log)
    assert set(report) == {"decode_partial", "merge_partials"}, log
    with capsys.disabled():
        regs, spill = report["decode_partial"]
        print(f"\n  {variant.name} {arch}: decode_partial {regs} regs, {spill} B spilled; "
              f"merge_partials {report['merge_partials'][0]} regs", end="")
    if variant in MAIN_VARIANTS:
        assert report["decode_partial"][1] == 0, f"{variant.name} spills registers on {arch}"


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


@pytest.mark.nvrtc
@pytest.mark.parametrize("loads", sorted({shape[2] for shape in PROBE_SHAPES}))
def test_read_probe_compiles(loads):
    """The bench's streaming-read probe (the floor the kernel is judged against) builds."""
    cubin, _ = compile_cubin(read_kernel_source(loads), "sm_90", f"stream_read_{loads}.cu")
    assert cubin[:4] == b"\x7fELF"
