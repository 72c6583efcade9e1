"""The bench's streaming-read probe (kernels_cu/read_probe.cu) builds through NVRTC with no GPU,
for every count of loads in flight that the bench launches, and only with that count defined."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                    reason="CuPy is not installed (python3 -m pip install -e '.[cuda13]' or '.[cuda12]')")

from splitkv.bench.bandwidth import PROBE_SHAPES  # noqa: E402
from splitkv.runtime.probe_kernels import read_kernel_source  # noqa: E402
from splitkv.runtime.kernel_source import compile_cubin, read_source  # noqa: E402


def test_probe_source_is_read_probe_cu_with_its_define():
    assert read_kernel_source(4) == "#define LOADS 4\n" + read_source("read_probe.cu")


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("loads", sorted({shape[2] for shape in PROBE_SHAPES}))
def test_read_probe_builds(loads, arch):
    cubin, _ = compile_cubin(read_kernel_source(loads), arch, f"read_probe_{loads}.cu")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.nvrtc
def test_read_probe_without_loads_fails_to_build():
    with pytest.raises(RuntimeError, match="LOADS must be defined"):
        compile_cubin(read_source("read_probe.cu"), "sm_90", "read_probe.cu")
