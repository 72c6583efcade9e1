"""Which build of the decode kernel runs a plan (``Build``: warps, tile length, stages, q in
shared memory, the page walk, occupancy, ...), decided in one place and without a GPU: from the
problem's shape, the plan's grid as a build sees it (``PlanGrid``), the device's properties as
plain data (``DeviceProperties``) and what an experiment forces (``BuildForces``).

``decode_build`` is the whole decision for a per-shape plan; ``shape_build``, ``plan_build``
and ``graph_build`` are its steps, as a wrapper meets them (its shape at construction, then each
plan, or a graph-stable wrapper's one fixed grid). The runtime compiles what they decide
(``runtime.compiled_builds``), and the cost model counts the tiles they decide
(``planner.features.build_tile_units``), so what runs and what was predicted cannot drift
apart. Each default was measured on the H200 (docs/design/kernel.md)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .execution import CLUSTER_SIZES
from .fp8 import FP8_FORMATS
from .geometry import MAX_HEADS_PER_CTA, RECORD_PAGES, WARPS_PER_CTA
from .validation import FP8_HEAD_DIMS
from .variants import PLAIN, KernelVariant

# Pipeline depth in tiles by head_dim: about 64-96 KiB of K+V in flight per CTA, so two or
# three CTAs fit on an SM. fp8 tiles are half the bytes: twice the tiles keeps the bytes in
# flight (and so the CTAs an SM holds), within the RECORD_PAGES the first tiles may take at
# page 16.
# Head dim 96 (192-byte rows): 3 stages, 72 KiB (its 188 registers hold two CTAs an SM, as 128's
# 219 do). On the H100 3 stages beat 4 (96 KiB) by 0.4-2.0% on five d96 shapes (2026-12-08,
# docs/design/kernel.md).
DEFAULT_STAGES = {64: 4, 96: 3, 128: 3, 256: 2}
DEFAULT_FP8_STAGES = {64: 6, 128: 6, 256: 4}


@dataclass(frozen=True)
class DeviceProperties:
    """What the build rules read of a GPU. ``shared_per_block_optin`` 0: not known (a cost
    model's device, which records its SMs only): every build is taken to fit."""

    num_sms: int
    shared_per_block_optin: int = 0    # bytes of shared memory one block may opt in to
    shared_per_sm: int = 0
    cc: int = 90                       # compute capability, major x 10 + minor
    name: str = ""


H200 = DeviceProperties(132, 232448, 233472, 90, "NVIDIA H200")


@dataclass(frozen=True)
class BuildForces:
    """What an experiment forces of a build (``runtime.DecodeExperiments``' build knobs, which
    say what each does); None: the rules below decide."""

    stages: int | None = None
    max_registers: int | None = None
    warps: int | None = None
    q_in_smem: bool | None = None
    pow2_pages: bool | None = None
    tile_per_warp: int | None = None
    dim_split: int | None = None

    @property
    def forced_warps(self) -> int | None:
        """The warps a CTA runs whatever the plan: ``warps``, else the 8 of ``dim_split=2`` or
        the 4 that ``tile_per_warp=32`` was measured at; None: the plan's (``plan_warps``)."""
        if self.warps:
            return self.warps
        return 8 if self.dim_split == 2 else 4 if self.tile_per_warp == 32 else None

    @property
    def forces_occupancy(self) -> bool:
        """Stages or a register cap given, so ``default_occupancy`` stands aside."""
        return self.stages is not None or self.max_registers is not None


NO_FORCES = BuildForces()


def row_tiles_for(group_size: int) -> int:
    """ROW_TILES of a CTA whose kv head has ``group_size`` query heads (with multi-token
    decode, q_len x the group): row tiles of 16 up to MAX_HEADS_PER_CTA rows."""
    rows = min(group_size, MAX_HEADS_PER_CTA)
    return 1 if rows <= 16 else 2 if rows <= 32 else 4


def row_step(head_dim: int, row_tiles: int, kv_bytes: int) -> int:
    """Token rows one pass of a row tile's threads copies (decode.cu's GROUP_THREADS /
    COPY_SLOTS, the 16-byte chunks of a row rounded up to a power of two): pages smaller than
    this take the page walk's per-copy division."""
    chunks = head_dim * kv_bytes // 16
    slots = 1 << (max(chunks, 4) - 1).bit_length()
    return max(1, 32 * row_tiles // slots)


@dataclass(frozen=True)
class Build:
    """One specialisation of decode.cu, as data (``runtime.kernel_source.KernelBuild`` adds
    its source and name)."""

    dtype: str          # "float16" | "bfloat16"
    head_dim: int       # 64 | 96 | 128 | 256 (fp8 K/V: not 96)
    row_tiles: int      # 1, 2 or 4 row tiles of 16 query heads per CTA (ROW_TILES)
    stages: int = 0     # pipeline depth in tiles; 0 = the default for head_dim
    max_registers: int = 0    # per-thread register cap (experiments); 0 = the compiler's choice
    cluster: int = 0    # S > 1: the S chunks of each request run as one thread-block cluster
                        # and merge through distributed shared memory (sm_90+); 0 = no cluster
    kv_dtype: str = ""  # "" (K/V in dtype), or an fp8 format: K/V are fp8 codes (KV_FP8)
    num_warps: int = WARPS_PER_CTA   # NUM_WARPS: 4, or 8 (128-token tiles, lone CTAs)
    variant: KernelVariant = PLAIN   # the variant's hooks compiled in (soft cap, ...)
    q_in_smem: int = 0     # 1: q's MMA fragments in shared memory (Q_SMEM)
    pow2_pages: int = 0    # 1: the page walk shifts for 2**k pages (POW2_PAGES)
    tile_per_warp: int = 16   # tokens per tile per warp: 16, or 32 (TILE_N)
    dim_split: int = 1     # warps that split O's head dim, 1 or 2 (an experiment; WARPS_D)

    def __post_init__(self):
        if self.kv_dtype not in ("", *FP8_FORMATS):
            raise ValueError(f"kv_dtype: expected '' or one of {FP8_FORMATS}, "
                             f"got {self.kv_dtype!r}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps: expected 4 or 8, got {self.num_warps}")
        if self.tile_per_warp not in (16, 32):
            raise ValueError(f"tile_per_warp: expected 16 or 32, got {self.tile_per_warp}")
        if self.dim_split not in (1, 2):
            raise ValueError(f"dim_split: expected 1 or 2, got {self.dim_split}")
        if not isinstance(self.variant, KernelVariant):
            raise TypeError(f"variant: expected a KernelVariant, got {self.variant!r}")
        if self.dim_split > 1 and (self.kv_dtype or self.variant.unified_max):
            raise ValueError("dim_split: 16-bit K/V and the running max only (fp8's V path and "
                             "the unified max's row check are per warp of all dims)")
        if self.num_warps < self.row_tiles * self.dim_split:
            raise ValueError(f"dim_split: {self.num_warps} warps cannot hold {self.row_tiles} "
                             f"row tiles x {self.dim_split} dim halves")
        if self.kv_dtype and self.head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"kv_dtype: fp8 K/V has no build at head_dim {self.head_dim}; "
                             f"expected one of {FP8_HEAD_DIMS}")
        if self.stages == 0:
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


# ---------------------------------------------------------------- the rules
# Warps of a CTA that is alone on its SM (``plan_warps``).
LONE_CTA_WARPS = 8
# A 16-bit lone CTA gets 8 warps only where its chunks are at least this long on average: the
# 128-token tiles' longer pipeline fill lost on short chunks (b1_n3k, 256 tokens a chunk).
LONG_CHUNK_TOKENS = 2048


def plan_warps(kv_dtype: str | None, num_ctas: int, forced: int | None = None, *,
               num_sms: int, row_tiles: int = 1, page_size: int = 16, head_dim: int = 128,
               mean_chunk_tokens: float = 0.0, multi_token: bool = False) -> int:
    """Warps per CTA of a per-shape plan's partial kernel: ``forced`` when an experiment says
    so; else 8 (128-token tiles) where a CTA is alone on its SM (the grid of ``num_ctas`` gives
    none of the ``num_sms`` two) and its 4 warps are issue-bound, 4 otherwise. Measured on the
    H200 (docs/design/kernel.md):
    - fp8 K/V, every lone grid: alone on its SM with 4 warps a CTA streams about half its
      share, and 8 give it the warps two CTAs would have (b1_n32k 29.6 -> 24.3 us, b8_n8k
      51.3 -> 40.4). Where CTAs run two to an SM, 8 warps lose (b128_n2k 151 -> 166).
    - 16-bit K/V, lone grids of long chunks (``LONG_CHUNK_TOKENS``) with two row tiles or more
      (groups past 16: g32_b32_n8k 84.7 -> 75.3 us) or pages smaller than ``row_step``
      (page 1: p1_b8_n8k 75.2 -> 69.7 us). Elsewhere 16-bit measured even or slower (page 16
      or 64, group 4 or 16: within 1%; b1_n3k's 256-token chunks 9.03 -> 9.90 us). Not at
      head_dim 256, whose 8-warp 16-bit build needs more shared memory than a block has, and
      not for multi-token plans (their rows make row tiles too, but 8 warps are not measured
      on them).
    A graph-stable wrapper keeps 4: its one captured grid serves every plan."""
    if forced is not None:
        return forced
    if num_ctas > num_sms:
        return 4
    if kv_dtype:
        return LONE_CTA_WARPS
    if head_dim > 128:            # 2 stages of 128-token 16-bit tiles: past a block's shared memory
        return 4
    if multi_token:               # 8 warps not measured on 16-bit multi-token plans
        return 4
    issue_bound = row_tiles >= 2 or page_size < row_step(head_dim, row_tiles, 2)
    return LONE_CTA_WARPS if issue_bound and mean_chunk_tokens >= LONG_CHUNK_TOKENS else 4


# Builds whose choice follows from the wrapper's shape alone, where an experiment does not say
# otherwise. Measured on the H200 (docs/design/kernel.md):
# - q's MMA fragments in shared memory at head_dim 256, where 64 registers of them make the
#   kernel spill: d256_b8_n8k 141.7 -> 137.1 us, d256_b1_n32k 85.0 -> 79.9, d256_b32_n4k
#   258.8 -> 253.9, fp8 d256_b8_n8k 74.2 -> 71.8; at head_dim 128 it measured even (+0.4-0.7%).
# - the page walk by shift and mask for 2**k pages smaller than a row step (the only pages that
#   walk by division): p1_b8_n8k 75.1 -> 74.6 us bf16, fp8 42.6 -> 41.8.
Q_IN_SMEM_HEAD_DIMS = (256,)


def default_q_in_smem(head_dim: int) -> bool:
    """Whether q's fragments live in shared memory (the Q_SMEM build) by default."""
    return head_dim in Q_IN_SMEM_HEAD_DIMS


def default_pow2_pages(page_size: int, head_dim: int, row_tiles: int, kv_bytes: int) -> bool:
    """Whether the page walk shifts instead of dividing (the POW2_PAGES build) by default: for
    pages that are a power of two and smaller than ``row_step``."""
    return (page_size & (page_size - 1) == 0
            and page_size < row_step(head_dim, row_tiles, kv_bytes))


# Occupancy and tile length where the shape alone decides them (the stages, register cap and
# tokens a warp's tile an experiment did not force). Measured on the H200 with
# ``benchmarks/ab.py`` (docs/design/kernel.md, occupancy and tiles):
# - 16-bit head_dim 64, one row tile, 4 warps: 3 stages (48 KiB) and a 128-register cap hold 4
#   CTAs an SM where the compiler's 133 registers and 4 stages held 3: d64_b64_n4k 137.7 ->
#   124.0 us, d64_b64_n2600 89.6 -> 80.5, d64_b8_n7790 37.0 -> 35.7, d64_b256_n1k 130.2 -> 127.8.
#   Not with two row tiles or more, or the unified max: under the cap they spill (NVRTC's
#   report; tests/kernels/test_kernels_compile.py pins the builds the rule gives).
# - fp8 K/V at head_dim 128 (128-byte rows), one row tile, grids of more CTAs than SMs (4 warps):
#   128-token tiles (32 tokens a warp, 3 stages): b128_n2k 151.2 -> 142.3 us, b32_n2k 38.8 ->
#   37.3, b32_n8k 132.8 -> 129.1, ragged_b32 66.0 -> 63.5. Lone grids keep 8 warps of 16 tokens
#   each (4 warps of 32 lost there: b8_n8k 39.3 -> 40.8, b1_n32k 24.1 -> 24.9).
FOUR_AN_SM = {"stages": 3, "max_registers": 128}


def default_occupancy(build, *, forced: bool):
    """``build`` with 4 CTAs an SM's stages and register cap where the rule above holds and
    no experiment forced its stages or registers (``forced``), else ``build``."""
    if (forced or build.kv_dtype or build.head_dim != 64 or build.row_tiles != 1
            or build.num_warps != 4 or build.tile_per_warp != 16 or build.dim_split != 1
            or build.variant.unified_max):
        return build
    return replace(build, **FOUR_AN_SM)


def default_tile_per_warp(kv_dtype: str | None, head_dim: int, warps: int, row_tiles: int,
                          multi_token: bool, *, forced: bool = False) -> int:
    """Tokens a warp's tile of a per-shape plan holds by default: 32 for fp8 head_dim 128 at 4
    warps and one row tile (the rule above), else 16. Not for multi-token plans (unmeasured),
    nor where an experiment forced the stages or warps the rule goes with (``forced``)."""
    if (not forced and kv_dtype and head_dim == 128 and warps == 4 and row_tiles == 1
            and not multi_token):
        return 32
    return 16


def fitting_build(build, *, q_default: bool, warps_default: bool, shared_limit: int,
                  stages: int = 0, split_default: bool = False):
    """``build``, or the nearest build whose shared memory one block may have
    (``shared_limit`` bytes; 0: not known, ``build``): the defaults above given up in turn (q
    in shared memory, then 8 warps, then stages down to 2 where ``stages`` is 0, the default;
    then, with ``split_default``, the head dim split between the warp pairs of 4 warps, whose
    32-token tiles halve a stage), never what an experiment forced. On the H200 and B200 every
    default fits; on GPUs with less shared memory a block (``core.architectures``: 99 KiB on
    sm_86/89/120, 163 KiB on the A100) a 16-bit 8-warp build at head_dim 128 (128 KiB) or fp8
    at head_dim 256 with 8 warps and q in shared memory (192 KiB) does not, and at 99 KiB
    neither does head_dim 256's 4-warp default (fp8: 4 stages of 64-token tiles, 128 KiB;
    16-bit: 2 stages, 128 KiB, which only the 32-token tiles bring under). If nothing fits,
    ``build`` (the runtime then refuses it, saying by how much it is over)."""
    if not shared_limit or build.shared_bytes <= shared_limit:
        return build
    options = [build]
    if q_default and build.q_in_smem:
        options.append(replace(build, q_in_smem=0))
    if warps_default and build.num_warps != 4:
        options += [replace(b, num_warps=4, stages=stages) for b in list(options)]
    # fewer stages before q's fragments: the bytes in flight matter more than q's registers
    if not stages:
        options += [replace(b, stages=n) for n in range(max(b.stages for b in options) - 1, 1, -1)
                    for b in options if b.stages > n]
    if (split_default and (warps_default or build.num_warps == 4) and not build.kv_dtype
            and not build.variant.unified_max and build.dim_split == 1 and build.row_tiles <= 2
            and build.tile_per_warp == 16 and not stages):
        splits = [replace(b, num_warps=4, dim_split=2, stages=0) for b in options
                  if b.num_warps == build.num_warps and b.stages == build.stages]
        options += [replace(b, stages=n) for n in range(splits[0].stages, 1, -1) for b in splits]
    return next((b for b in options if b.shared_bytes <= shared_limit), build)


# ---------------------------------------------------------------- the decisions
def shape_build(dtype: str, head_dim: int, group_size: int, page_size: int, kv_dtype,
                forces: BuildForces = NO_FORCES, *, build_type=Build):
    """The build a wrapper's shape gives (before any plan): q's fragments in shared memory at
    head_dim 256, the page walk by shift for small 2**k pages, and what ``forces`` say.
    ``build_type``: ``Build`` or a subclass of it (the runtime's ``KernelBuild``), which the
    later steps keep."""
    q_in_smem, pow2 = forces.q_in_smem, forces.pow2_pages
    if q_in_smem is None:
        q_in_smem = default_q_in_smem(head_dim)
    if pow2 is None:
        # the threads that share a tile's copies: its row tiles' warps (x dim_split's)
        pow2 = default_pow2_pages(page_size, head_dim,
                                  row_tiles_for(group_size) * (forces.dim_split or 1),
                                  1 if kv_dtype else 2)
    return build_type(dtype, head_dim, row_tiles_for(group_size), forces.stages or 0,
                      forces.max_registers or 0, 0, kv_dtype or "",
                      forces.forced_warps or WARPS_PER_CTA, q_in_smem=int(q_in_smem),
                      pow2_pages=int(pow2), tile_per_warp=forces.tile_per_warp or 16,
                      dim_split=forces.dim_split or 1)


@dataclass(frozen=True)
class PlanGrid:
    """A per-shape plan as its build sees it: the CTAs of its grid, its chunks' mean tokens,
    its cluster size, the row tiles of a CTA (the rows a kv head computes, up to the CTA's
    cap), and the variant's hooks its call runs."""

    ctas: int
    mean_chunk_tokens: float = 0.0
    cluster_size: int = 0
    row_tiles: int = 1
    variant: KernelVariant = PLAIN


def plan_build(base, grid: PlanGrid, *, page_size: int, device: DeviceProperties,
               forces: BuildForces = NO_FORCES):
    """The build a per-shape plan runs, from its wrapper's ``shape_build`` (``base``): the
    plan's cluster size, 8 warps where 4 are issue-bound (``plan_warps``), the tile a warp,
    the occupancy, given up in turn until the build fits the device's shared memory
    (``fitting_build``)."""
    forced_warps = forces.forced_warps
    warps = plan_warps(base.kv_dtype, grid.ctas, forced_warps, num_sms=device.num_sms,
                       row_tiles=grid.row_tiles, page_size=page_size, head_dim=base.head_dim,
                       mean_chunk_tokens=grid.mean_chunk_tokens,
                       multi_token=grid.variant.multi_token)
    tile_per_warp = forces.tile_per_warp or default_tile_per_warp(
        base.kv_dtype, base.head_dim, warps, grid.row_tiles, grid.variant.multi_token,
        forced=forces.stages is not None or forced_warps is not None)
    return _settled(base, forces, device, grid.cluster_size, grid.variant, warps,
                    grid.row_tiles, tile_per_warp)


@functools.lru_cache(maxsize=256)
def _settled(base, forces, device, cluster_size, variant, warps, row_tiles, tile_per_warp):
    """``plan_build`` past its cheap choices, once per distinct inputs: a decode loop meets a
    handful of builds, and replacing, checking occupancy and fit costs tens of microseconds."""
    build = default_occupancy(replace(
        base, cluster=cluster_size, variant=variant, num_warps=warps,
        stages=forces.stages or 0, row_tiles=row_tiles, tile_per_warp=tile_per_warp),
        forced=forces.forces_occupancy)
    return fitting_build(build, q_default=forces.q_in_smem is None,
                         warps_default=forces.forced_warps is None,
                         shared_limit=device.shared_per_block_optin, stages=forces.stages or 0,
                         split_default=forces.dim_split is None)


def graph_build(base, *, variant: KernelVariant, rows: int, device: DeviceProperties,
                forces: BuildForces = NO_FORCES):
    """The build of a graph-stable grid: no cluster, the wrapper's warps (4 unless forced: the
    one captured grid serves every plan), the ``variant``'s hooks (multi-token where the
    wrapper holds more than one query row a request), row tiles for ``rows`` (the query rows
    a request x the group), and the tile a warp ``default_tile_per_warp`` gives 4 warps: 32
    tokens for fp8 at head_dim 128 with one row tile. Measured on the H100 (2026-12-08,
    docs/design/graph-stable.md), fp8 graph-stable against 16 tokens a warp, each wrapper its
    own plan: 0.92-1.00x on all 12 standard cases (b1_n8k 14.41 -> 13.29 us, b32_n8k 192.1 ->
    187.5); the 16-bit builds keep 16 (b32_n2k 91.4 -> 94.2, b128_n2k 349.9 -> 357.8 with 32)."""
    row_tiles = row_tiles_for(rows)
    tile_per_warp = forces.tile_per_warp or default_tile_per_warp(
        base.kv_dtype, base.head_dim, base.num_warps, row_tiles, variant.multi_token,
        forced=forces.stages is not None or forces.forced_warps is not None)
    return fitting_build(default_occupancy(replace(
        base, variant=variant, row_tiles=row_tiles, tile_per_warp=tile_per_warp,
        stages=forces.stages or 0), forced=forces.forces_occupancy),
        q_default=forces.q_in_smem is None, warps_default=False,
        shared_limit=device.shared_per_block_optin, stages=forces.stages or 0,
        split_default=forces.dim_split is None)


def decode_build(dtype: str, head_dim: int, group_size: int, page_size: int, kv_dtype,
                 grid: PlanGrid, device: DeviceProperties,
                 forces: BuildForces = NO_FORCES) -> Build:
    """The build a per-shape plan of this shape runs on ``device``: ``shape_build`` then
    ``plan_build``. ``group_size``: the wrapper's query heads a kv head."""
    base = shape_build(dtype, head_dim, group_size, page_size, kv_dtype, forces)
    return plan_build(base, grid, page_size=page_size, device=device, forces=forces)


def reachable_builds(base, *, device: DeviceProperties, page_size: int, group_size: int,
                     soft_caps=(False,), max_q_len: int = 1, unified_max: bool = False,
                     clusters: bool = False, rows_per_cta: int = MAX_HEADS_PER_CTA,
                     graph_stable: bool = False, forces: BuildForces = NO_FORCES,
                     alibi: bool = False) -> frozenset:
    """Every build a wrapper of ``base``'s shape can run on ``device``: what ``warmup()``
    compiles so that no plan compiles in serving. ``plan_build`` reads a grid only through
    thresholds (CTAs past the SMs, chunks past ``LONG_CHUNK_TOKENS``), so one grid on each side
    of each stands for all; the rest are the options a wrapper's plans may take: the soft cap
    on or off (``soft_caps``), query rows a request up to ``max_q_len`` (multi-token decode),
    the unified max, ALiBi, clusters. A graph-stable wrapper runs ``graph_build`` only."""
    if graph_stable:
        return frozenset(graph_build(base, variant=KernelVariant(cap, max_q_len > 1, alibi=alibi),
                                     rows=group_size * max_q_len, device=device, forces=forces)
                         for cap in soft_caps)
    found = set()
    # (query rows a request, multi-token): plans without qo_indptr, then those with it
    rows = [(1, False)] + [(q, True) for q in range(1, max_q_len + 1) if max_q_len > 1]
    for q_len, multi_token in rows:
        row_tiles = row_tiles_for(min(group_size * q_len, rows_per_cta))
        for cap in soft_caps:
            for cluster in (0, *CLUSTER_SIZES) if clusters else (0,):
                for ctas in (1, device.num_sms + 1):
                    for mean_tokens in (0.0, float(LONG_CHUNK_TOKENS)):
                        grid = PlanGrid(ctas, mean_tokens, cluster, row_tiles,
                                        KernelVariant(cap, multi_token, unified_max, alibi))
                        found.add(plan_build(base, grid, page_size=page_size, device=device,
                                             forces=forces))
    return frozenset(found)
