"""The one loader of kernel sources: reads ``splitkv/kernels_cu``, inlines its local includes,
and names each compiled variant. Needs neither CuPy nor a GPU, so CI can check every variant
compiles through NVRTC on a CPU-only machine."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from ..core.execution import CLUSTER_SIZES
from ..core.geometry import MAX_HEADS_PER_CTA, RECORD_PAGES, WARPS_PER_CTA
from .kernel_abi import layout_checks

# KV_FP8 of each fp8 format (core/fp8.py's names)
KV_FP8_CODES = {"float8_e4m3fn": 1, "float8_e5m2": 2}

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

NVRTC_OPTIONS = ("--std=c++17", "-default-device")
DEFAULT_STAGES = {64: 4, 128: 3, 256: 2}
# fp8 K/V tiles are half the bytes: twice the tiles keeps the bytes in flight (and so the CTAs an
# SM holds) as the 16-bit kernel's, within the RECORD_PAGES the first tiles may take at page 16.
DEFAULT_FP8_STAGES = {64: 6, 128: 6, 256: 4}
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
class DecodeVariant:
    """One compiled specialisation of decode.cu."""

    dtype: str          # "float16" | "bfloat16"
    head_dim: int       # 64 | 128 | 256
    row_tiles: int      # 1, 2 or 4 row tiles of 16 query heads per CTA (ROW_TILES)
    stages: int = 0     # pipeline depth in tiles; 0 = the default for head_dim
    max_registers: int = 0    # per-thread register cap (experiments); 0 = the compiler's choice
    cluster: int = 0    # S > 1: the S chunks of each request run as one thread-block cluster
                        # and merge through distributed shared memory (sm_90+); 0 = no cluster
    kv_dtype: str = ""  # "" (K/V in dtype), or an fp8 format: K/V are fp8 codes (KV_FP8)
    num_warps: int = WARPS_PER_CTA   # NUM_WARPS: 4, or 8 (128-token tiles, lone fp8 CTAs)
    soft_cap: int = 0   # 1: the build that applies the logits soft cap (SOFT_CAP)
    multi_token: int = 0   # 1: multi-token decode, rows of (query row, head) (MULTI_TOKEN)
    unified_max: int = 0   # 1: scores offset by a fixed phi, with the fallback (UNIFIED_MAX)
    q_in_smem: int = 0     # 1 (an experiment): q's MMA fragments in shared memory (Q_SMEM)
    pow2_pages: int = 0    # 1: the page walk shifts for 2**k pages (POW2_PAGES)
    tile_per_warp: int = 16   # tokens per tile per warp: 16, or 32 (an experiment; TILE_N)
    dim_split: int = 1     # warps that split O's head dim, 1 or 2 (an experiment; WARPS_D)
    dissect: str = ""      # a latency probe: the stages cut out (DISSECT_CUTS); "" in real builds

    def __post_init__(self):
        if self.kv_dtype not in ("", *KV_FP8_CODES):
            raise ValueError(f"kv_dtype: expected '' or one of {tuple(KV_FP8_CODES)}, "
                             f"got {self.kv_dtype!r}")
        if self.dissect not in ("", *DISSECT_CUTS):
            raise ValueError(f"dissect: expected '' or one of {tuple(DISSECT_CUTS)}, "
                             f"got {self.dissect!r}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps: expected 4 or 8, got {self.num_warps}")
        if self.tile_per_warp not in (16, 32):
            raise ValueError(f"tile_per_warp: expected 16 or 32, got {self.tile_per_warp}")
        if self.dim_split not in (1, 2):
            raise ValueError(f"dim_split: expected 1 or 2, got {self.dim_split}")
        if self.dim_split > 1 and (self.kv_dtype or self.unified_max):
            raise ValueError("dim_split: 16-bit K/V and the running max only (fp8's V path and "
                             "the unified max's row check are per warp of all dims)")
        if self.num_warps < self.row_tiles * self.dim_split:
            raise ValueError(f"dim_split: {self.num_warps} warps cannot hold {self.row_tiles} "
                             f"row tiles x {self.dim_split} dim halves")
        if self.stages == 0:
            # About 64-96 KiB of K+V in flight per CTA, so two or three CTAs fit on an SM.
            defaults = DEFAULT_FP8_STAGES if self.kv_dtype else DEFAULT_STAGES
            # tiles of more tokens (8 warps, or 32 a warp): fewer stages keep the bytes in flight
            stages = max(2, defaults[self.head_dim] * 16 * WARPS_PER_CTA // self.tile_tokens)
            object.__setattr__(self, "stages", stages)
        if self.cluster not in (0, *CLUSTER_SIZES):
            raise ValueError(f"cluster: expected 0 or one of {CLUSTER_SIZES}, got {self.cluster}")

    @property
    def rows(self) -> int:
        return 16 * self.row_tiles

    @property
    def tile_tokens(self) -> int:
        """Tokens per pipeline stage (TILE_N): 16 per warp (32 as an experiment), over the
        warps that split the head dim (dim_split)."""
        return self.tile_per_warp * self.num_warps // self.dim_split

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def kv_bytes(self) -> int:
        """Bytes of one K or V element."""
        return 1 if self.kv_dtype else 2

    @property
    def shared_bytes(self) -> int:
        # K and V tiles of every stage, then the record's page ids (decode.cu), then with
        # q_in_smem each warp's q fragments (16 bytes a lane a 16-dim k-step)
        pipeline = (self.stages * self.tile_tokens * self.head_dim * self.kv_bytes * 2
                    + RECORD_PAGES * 4 + self.q_in_smem * self.num_warps * self.head_dim * 32)
        combine = (self.num_warps // self.dim_split) * 16 * (self.head_dim + 2) * 4   # reused after
        if self.cluster:
            combine += self.rows * (self.head_dim + 1) * 4          # the CTA's partial state
        return max(pipeline, combine)

    @property
    def defines(self) -> dict[str, int]:
        return {"SPLITKV_BF16": int(self.dtype == "bfloat16"), "HEAD_DIM": self.head_dim,
                "ROW_TILES": self.row_tiles, "STAGES": self.stages, "NUM_WARPS": self.num_warps,
                "MAX_REGISTERS": self.max_registers, "CLUSTER": self.cluster,
                "RECORD_PAGES": RECORD_PAGES, "KV_FP8": KV_FP8_CODES.get(self.kv_dtype, 0),
                "SOFT_CAP": self.soft_cap, "MULTI_TOKEN": self.multi_token,
                "UNIFIED_MAX": self.unified_max, "Q_SMEM": self.q_in_smem,
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
        kv += "_softcap" if self.soft_cap else ""
        kv += "_mt" if self.multi_token else ""
        kv += "_umax" if self.unified_max else ""
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

    @staticmethod
    def for_problem(dtype: str, head_dim: int, group_size: int, stages: int = 0,
                    max_registers: int = 0, cluster: int = 0,
                    kv_dtype: str = "", num_warps: int = WARPS_PER_CTA,
                    q_in_smem: int = 0, pow2_pages: int = 0,
                    tile_per_warp: int = 16, dim_split: int = 1) -> "DecodeVariant":
        return DecodeVariant(dtype, head_dim, row_tiles_for(group_size), stages, max_registers,
                             cluster, kv_dtype or "", num_warps, q_in_smem=q_in_smem,
                             pow2_pages=pow2_pages, tile_per_warp=tile_per_warp,
                             dim_split=dim_split)


def row_tiles_for(group_size: int) -> int:
    """ROW_TILES of a CTA whose kv head has ``group_size`` query heads (with multi-token
    decode, q_len x the group): row tiles of 16 up to MAX_HEADS_PER_CTA rows."""
    rows = min(group_size, MAX_HEADS_PER_CTA)
    return 1 if rows <= 16 else 2 if rows <= 32 else 4


def all_variants() -> list[DecodeVariant]:
    return [DecodeVariant(dt, d, rt) for dt in ("float16", "bfloat16") for d in (64, 128, 256)
            for rt in (1, 2, 4)]


def fp8_variants() -> list[DecodeVariant]:
    """Every fp8-KV variant (both formats), as CI compiles them."""
    return [DecodeVariant(v.dtype, v.head_dim, v.row_tiles, kv_dtype=f) for v in all_variants()
            for f in KV_FP8_CODES]


def _nvrtc_compile(source: str, arch: str, name: str, extra_options=(), read=None):
    """Compile with NVRTC (no GPU needed) and return ``read(nvrtc, prog)``; a failure raises
    with the compiler's log."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, f"-arch={arch}", *extra_options])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise RuntimeError(f"NVRTC failed to compile {name} for {arch}: {exc}\n{log}") from None
        return read(nvrtc, prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_ptx(source: str, name: str = "kernel.cu", arch: str = "compute_90") -> str:
    """PTX of ``source``: what the tests read."""
    def read(nvrtc, prog):
        ptx = nvrtc.getPTX(prog)
        return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")

    return _nvrtc_compile(source, arch, name, read=read)


def compile_cubin(source: str, arch: str, name: str = "kernel.cu", verbose: bool = False):
    """Compile with NVRTC to a CUBIN without touching a GPU. Returns (cubin bytes, log)."""
    return _nvrtc_compile(
        source, arch, name, ["-Xptxas", "-v"] if verbose else [],
        read=lambda nvrtc, prog: (nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog).rstrip("\x00")))
