"""Tuning knobs for experiments: what the benchmarks A/B against the shipped kernel. Users leave
them alone; the cost-model profile was calibrated with the defaults."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from ..core import validation as V
from ..core.builds import BuildForces
from .device_features import check_option

# Where a PDL partial kernel lets the next kernel launch: 'early', as soon as its CTAs read
# their records; 'late', once every CTA finished streaming its chunk.
PDL_TRIGGERS = ("early", "late")


@dataclass(frozen=True)
class DecodeExperiments(BuildForces):
    """Knobs ``BatchDecodeWrapper(..., experiments=...)`` passes to the kernel and its launch.

    stages: pipeline depth of the partial kernel in tiles (at least 2); None: the default for
        the head dim (``core.builds.DEFAULT_STAGES``, fewer for tiles of more tokens), or 3
        where ``core.builds.default_occupancy`` holds 4 CTAs an SM (16-bit head_dim 64, one row
        tile). Forcing it (or max_registers) gives that default up.
    max_registers: per-thread register cap of the partial kernel; None: the compiler's choice,
        or 128 where ``core.builds.default_occupancy`` holds 4 CTAs an SM; 0: the compiler's.
    warps: warps per CTA of the partial kernel, 4 or 8 (128-token tiles); None: the default,
        ``core.builds.plan_warps``: 8 where the grid gives no SM two CTAs and 4 warps are
        issue-bound (fp8; 16-bit with two row tiles or small pages, on long chunks), else 4
        (a graph-stable wrapper: always 4 unless forced).
    pdl_trigger: where a PDL partial kernel lets the next kernel launch (``PDL_TRIGGERS``):
        'late' (the default; neither wins everywhere, docs/design/kernel.md) or 'early'. Only
        with programmatic dependent launch (the wrapper's ``pdl``).
    pdl_spread: force whether a PDL launch pads its shared memory so that one CTA lands per SM
        (True / False); None: ``device_features.spreads_one_per_sm`` decides.
    q_in_smem: keep q's MMA fragments in shared memory, read back every tile, instead of in
        registers (the Q_SMEM build): at head_dim 256 they are 64 registers and the kernel
        spills without it (docs/design/kernel.md); None: the default
        (``core.builds.default_q_in_smem``: at head_dim 256); False: registers.
    pow2_pages: the page walk shifts and masks instead of dividing (the POW2_PAGES build): for
        pages smaller than a thread's row step (page size 1, and 2 at head_dim 64), where each
        16-byte copy's page is a division (docs/design/kernel.md); the wrapper's
        page_size must be a power of two. None: the default (``core.builds.default_pow2_pages``:
        2**k pages smaller than the row step); False: divide.
    tile_per_warp: tokens each warp's tile holds a pipeline stage, 16 (the default) or 32: 32
        makes tiles of 128 tokens at 4 warps, so the costs paid once a tile (the barrier, the
        page lookups ahead, the softmax's cross-lane max and rescale check) are paid half as
        often per byte, where rows are 128 bytes (16-bit head_dim 64, fp8 head_dim 128);
        the stages halve with it, and a per-shape plan keeps 4 warps unless ``warps`` says
        otherwise (docs/design/kernel.md). None: 32 for fp8 head_dim 128
        per-shape plans of 4 warps and one row tile where neither stages nor warps are forced
        (``core.builds.default_tile_per_warp``; not multi-token plans; graph-stable fp8
        wrappers take it too), else 16.
    dim_split: 2 splits the head dim of O = P V between pairs of warps, each computing the same
        scores and accumulating half of O (WARPS_D): CTAs of 8 warps keep 64-token tiles, so
        head_dim 256, one 4-warp CTA an SM by default, gets 8 warps an SM in 128 KiB, and O's
        registers halve (docs/design/rejected.md). 16-bit K/V and the running max only; a plan
        then runs 8 warps unless ``warps`` says otherwise. None / 1: every warp all dims.
    compact_merge: a split_merge plan's merge kernel runs a thread per (split request, head,
        4 dims) instead of per (request, head, 4 dims) of the whole batch, whose unsplit rows
        return at once but are still CTAs to schedule: 3-7 us where a few requests of a large
        batch split (docs/design/rejected.md).
        Per-shape plans; graph-stable wrappers keep their capacity's merge grid. None / False:
        the whole batch.
    rows_per_cta: the most query heads (rows) one CTA computes, 16, 32 or 64 (the default, 64):
        a GQA group past it runs in more CTAs a kv head, each reading the kv head's K/V (the
        second from L2), with fewer row tiles each and so more warps splitting the tokens
        (docs/design/rejected.md, for groups 16-32). Per-shape wrappers only.
    """

    # stages, max_registers, warps, q_in_smem, pow2_pages, tile_per_warp, dim_split: the
    # build knobs, declared by BuildForces (which also says what forced_warps and
    # forces_occupancy make of them)
    pdl_trigger: str = "late"
    pdl_spread: bool | None = None
    rows_per_cta: int | None = None
    compact_merge: bool | None = None

    def __post_init__(self):
        if self.stages is not None:
            V.check_int("stages", self.stages, 2)
        if self.max_registers is not None:
            V.check_int("max_registers", self.max_registers, 0)
        if self.warps is not None:
            V.check_int("warps", self.warps, 4, 8)
            if self.warps not in (4, 8):
                raise ValueError(f"warps: expected 4 or 8 (or None: the default), got {self.warps!r}")
        if self.pdl_trigger not in PDL_TRIGGERS:
            raise ValueError(f"pdl_trigger: expected one of {PDL_TRIGGERS}, "
                             f"got {self.pdl_trigger!r}")
        check_option("pdl_spread", self.pdl_spread)
        check_option("q_in_smem", self.q_in_smem)
        check_option("pow2_pages", self.pow2_pages)
        check_option("compact_merge", self.compact_merge)
        if self.dim_split is not None and (isinstance(self.dim_split, bool)
                                           or self.dim_split not in (1, 2)):
            raise ValueError(f"dim_split: expected 1 or 2 (or None: 1), got {self.dim_split!r}")
        if self.tile_per_warp is not None and (isinstance(self.tile_per_warp, bool)
                                               or self.tile_per_warp not in (16, 32)):
            raise ValueError(f"tile_per_warp: expected 16 or 32 (or None: the default), got "
                             f"{self.tile_per_warp!r}")
        if self.rows_per_cta is not None and (isinstance(self.rows_per_cta, bool)
                                              or self.rows_per_cta not in (16, 32, 64)):
            raise ValueError(f"rows_per_cta: expected 16, 32 or 64 (or None: 64), got "
                             f"{self.rows_per_cta!r}")

    @cached_property
    def build_forces(self) -> BuildForces:
        """The build knobs alone (``core.builds`` decides the rest): plans that differ in
        the other knobs share their builds."""
        return BuildForces(**{f.name: getattr(self, f.name) for f in fields(BuildForces)})
