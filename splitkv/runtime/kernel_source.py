"""The one loader of kernel sources: reads ``splitkv/kernels_cu``, inlines its local includes,
and names each compiled variant. Needs neither CuPy nor a GPU, so CI can check every variant
compiles through NVRTC on a CPU-only machine."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources

from ..core.builds import Build
from ..core.geometry import RECORD_PAGES, WARPS_PER_CTA
from ..core.validation import FP8_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from .kernel_abi import layout_checks

# KV_FP8 of each fp8 format (core/fp8.py's names)
KV_FP8_CODES = {"float8_e4m3fn": 1, "float8_e5m2": 2}

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

NVRTC_OPTIONS = ("--std=c++17", "-default-device")
# The latency dissection's cuts (benchmarks/dissect_latency.py), as DISSECT's bits (decode_build.cuh's
# Cut): ticket merge 1, page lookups 2, K/V reads 4, the whole partial kernel 8, the merge kernel 16.
# A cut kernel computes wrong answers on purpose.
DISSECT_CUTS = {"no_merge": 1, "no_pages": 2, "no_kv": 4, "bare": 1 | 4, "empty": 8,
                "merge_empty": 16}


@lru_cache(maxsize=None)
def read_source(name: str) -> str:
    """Source of ``kernels_cu/<name>`` with its ``#include "..."`` files inlined once each."""
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = resources.files("splitkv.kernels_cu").joinpath(fname).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


@dataclass(frozen=True)
class KernelBuild(Build):
    """One compiled specialisation of decode.cu: a ``core.builds.Build`` (what the build rules
    decide) with its defines, name and source."""

    dissect: str = ""      # a latency probe: the stages cut out (DISSECT_CUTS); "" in real builds

    def __post_init__(self):
        super().__post_init__()
        if self.dissect not in ("", *DISSECT_CUTS):
            raise ValueError(f"dissect: expected '' or one of {tuple(DISSECT_CUTS)}, "
                             f"got {self.dissect!r}")

    @classmethod
    def of(cls, build: Build) -> "KernelBuild":
        """``build`` with its source, to compile (itself where it is one)."""
        if isinstance(build, cls):
            return build
        return cls(**{f.name: getattr(build, f.name) for f in fields(Build)})

    @property
    def defines(self) -> dict[str, int]:
        return {"SPLITKV_BF16": int(self.dtype == "bfloat16"), "HEAD_DIM": self.head_dim,
                "ROW_TILES": self.row_tiles, "STAGES": self.stages, "NUM_WARPS": self.num_warps,
                "MAX_REGISTERS": self.max_registers, "CLUSTER": self.cluster,
                "RECORD_PAGES": RECORD_PAGES, "KV_FP8": KV_FP8_CODES.get(self.kv_dtype, 0),
                **self.variant.defines, "Q_SMEM": self.q_in_smem,
                "POW2_PAGES": self.pow2_pages,
                # only where it is not the kernel's default, so the default builds' sources
                # (and so their cached binaries) stay the same
                **({"TILE_N": self.tile_tokens} if self.tile_per_warp != 16 else {}),
                **({"WARPS_D": self.dim_split} if self.dim_split != 1 else {}),
                **({"DISSECT": DISSECT_CUTS[self.dissect]} if self.dissect else {})}

    @property
    def name(self) -> str:
        regs = f"_reg{self.max_registers}" if self.max_registers else ""
        cluster = f"_c{self.cluster}" if self.cluster else ""
        kv = f"_kv_{self.kv_dtype.split('_')[1]}" if self.kv_dtype else ""
        kv += f"_w{self.num_warps}" if self.num_warps != WARPS_PER_CTA else ""
        kv += self.variant.tags
        kv += "_qsmem" if self.q_in_smem else ""
        kv += "_pow2" if self.pow2_pages else ""
        kv += f"_t{self.tile_tokens}" if self.tile_per_warp != 16 else ""
        kv += f"_dsplit{self.dim_split}" if self.dim_split != 1 else ""
        kv += f"_dissect_{self.dissect}" if self.dissect else ""
        return (f"decode_{self.dtype}_d{self.head_dim}_r{self.rows}_s{self.stages}{regs}{cluster}"
                f"{kv}")

    def source(self) -> str:
        """decode.cu with this variant's defines, and the checks that its argument structs are
        laid out as runtime/kernel_abi.py writes them."""
        header = "".join(f"#define {k} {v}\n" for k, v in self.defines.items())
        return header + read_source("decode.cu") + layout_checks()


def all_builds() -> list[KernelBuild]:
    return [KernelBuild(dt, d, rt) for dt in ("float16", "bfloat16") for d in SUPPORTED_HEAD_DIMS
            for rt in (1, 2, 4)]


def fp8_builds() -> list[KernelBuild]:
    """Every fp8-KV build of all_builds (both formats), as CI compiles them."""
    return [KernelBuild(v.dtype, v.head_dim, v.row_tiles, kv_dtype=f) for v in all_builds()
            if v.head_dim in FP8_HEAD_DIMS for f in KV_FP8_CODES]


def _nvrtc_compile(source: str, arch: str, name: str, extra_options=(), read=None,
                   options=NVRTC_OPTIONS):
    """Compile with NVRTC (no GPU needed) and return ``read(nvrtc, prog)``; a failure raises
    with the compiler's log."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*options, f"-arch={arch}", *extra_options])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise RuntimeError(f"NVRTC failed to compile {name} for {arch}: {exc}\n{log}") from None
        return read(nvrtc, prog)
    finally:
        nvrtc.destroyProgram(prog)


def nvrtc_archs() -> tuple:
    """The compute capabilities this NVRTC compiles for; () where it cannot say."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        return tuple(int(a) for a in nvrtc.getSupportedArchs())
    except Exception:
        return ()


def compile_ptx(source: str, name: str = "kernel.cu", arch: str = "compute_90") -> str:
    """PTX of ``source``: what the tests read."""
    def read(nvrtc, prog):
        ptx = nvrtc.getPTX(prog)
        return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")

    return _nvrtc_compile(source, arch, name, read=read)


def compile_cubin(source: str, arch: str, name: str = "kernel.cu", verbose: bool = False,
                  options=NVRTC_OPTIONS):
    """Compile with NVRTC to a CUBIN without touching a GPU. Returns (cubin bytes, log).
    ``options``: NVRTC's options before ``-arch`` (a planning kernel's differ)."""
    return _nvrtc_compile(
        source, arch, name, ["-Xptxas", "-v"] if verbose else [],
        read=lambda nvrtc, prog: (nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog).rstrip("\x00")),
        options=options)
