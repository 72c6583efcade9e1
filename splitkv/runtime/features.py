"""What the current GPU can do for a launch, decided in one place: the options that need compute
capability 9.0 (thread-block clusters, programmatic dependent launch), the shared-memory size
that places one CTA per SM, and the warps a CTA of a grid gets."""

from __future__ import annotations

from . import device_info


def check_option(name: str, wanted):
    """An option of ``sm90_option``'s kind, checked when it is given: None, True or False."""
    if wanted is not None and not isinstance(wanted, bool):
        raise TypeError(f"{name}: expected None, True or False, got {wanted!r}")
    return wanted


def sm90_option(name: str, wanted, feature: str) -> bool:
    """An option that needs compute capability 9.0: None (use it where the device has it),
    False (never), or True (use it, raising where the device has none)."""
    check_option(name, wanted)
    info = device_info()
    has_it = int(info["cc"]) >= 90
    if wanted and not has_it:
        raise ValueError(f"{name}: {info['name']} (compute capability {info['cc']}) has no "
                         f"{feature}; it needs compute capability 9.0 or newer")
    return has_it and wanted is not False


def one_per_sm_shared_bytes(shared_bytes: int) -> int:
    """Dynamic shared memory (at least ``shared_bytes``) that leaves no room for a second CTA on
    an SM of the current device."""
    info = device_info()
    return min(max(shared_bytes, info["shared_per_sm"] // 2 + 16), info["shared_per_block_optin"])


def spreads_one_per_sm(num_ctas: int, cluster_size: int) -> bool:
    """Whether a PDL launch of ``num_ctas`` CTAs should reserve ``one_per_sm_shared_bytes``, so
    that the CTA scheduler must place them one per SM. It places a PDL grid while the kernel
    before it still holds the SMs, and a grid that a plain launch spreads one CTA per SM can then
    land two to an SM. Not for clusters of 4 or 8: each must find that many free SMs of one GPC
    at once, and spread they wait for the previous grid to leave (clusters of 2 gain from
    spreading like plain grids). The measurements are in docs/design/kernel.md (PDL)."""
    return num_ctas <= device_info()["num_sms"] and cluster_size <= 2


# Warps of a CTA that is alone on its SM (``plan_warps``).
LONE_CTA_WARPS = 8
# A 16-bit lone CTA gets 8 warps only where its chunks are at least this long on average: the
# 128-token tiles' longer pipeline fill lost on short chunks (b1_n3k, 256 tokens a chunk).
LONG_CHUNK_TOKENS = 2048


def row_step(head_dim: int, row_tiles: int, kv_bytes: int) -> int:
    """Token rows one pass of a row tile's threads copies (decode.cu's GROUP_THREADS /
    DCHUNKS): pages smaller than this take the page walk's per-copy division."""
    return max(1, 32 * row_tiles // (head_dim * kv_bytes // 16))


def plan_warps(kv_dtype: str | None, num_ctas: int, forced: int | None = None, *,
               row_tiles: int = 1, page_size: int = 16, head_dim: int = 128,
               mean_chunk_tokens: float = 0.0, multi_token: bool = False) -> int:
    """Warps per CTA of a per-shape plan's partial kernel: ``forced`` when an experiment says
    so; else 8 (128-token tiles) where a CTA is alone on its SM (the grid gives no SM two) and
    its 4 warps are issue-bound, 4 otherwise. Measured on the H200 (docs/design/kernel.md):
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
    if num_ctas > device_info()["num_sms"]:
        return 4
    if kv_dtype:
        return LONE_CTA_WARPS
    if head_dim > 128:            # 2 stages of 128-token 16-bit tiles: past a block's shared memory
        return 4
    if multi_token:               # 8 warps not measured on 16-bit multi-token plans
        return 4
    issue_bound = row_tiles >= 2 or page_size < row_step(head_dim, row_tiles, 2)
    return LONE_CTA_WARPS if issue_bound and mean_chunk_tokens >= LONG_CHUNK_TOKENS else 4


# Builds whose choice follows from the wrapper's shape alone (``BatchDecodeWrapper``), where an
# experiment does not say otherwise. Measured on the H200 (docs/design/kernel.md):
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


def default_occupancy(variant, *, forced: bool):
    """``variant`` with 4 CTAs an SM's stages and register cap where the rule above holds and
    no experiment forced its stages or registers (``forced``), else ``variant``."""
    from dataclasses import replace

    if (forced or variant.kv_dtype or variant.head_dim != 64 or variant.row_tiles != 1
            or variant.num_warps != 4 or variant.tile_per_warp != 16 or variant.dim_split != 1
            or variant.unified_max):
        return variant
    return replace(variant, **FOUR_AN_SM)


def default_tile_per_warp(kv_dtype: str | None, head_dim: int, warps: int, row_tiles: int,
                          multi_token: bool, *, forced: bool = False) -> int:
    """Tokens a warp's tile of a per-shape plan holds by default: 32 for fp8 head_dim 128 at 4
    warps and one row tile (the rule above), else 16. Not for multi-token plans (unmeasured),
    nor where an experiment forced the stages or warps the rule goes with (``forced``)."""
    if (not forced and kv_dtype and head_dim == 128 and warps == 4 and row_tiles == 1
            and not multi_token):
        return 32
    return 16


def fitting_build(variant, *, q_default: bool, warps_default: bool, stages: int = 0):
    """``variant`` (a ``DecodeVariant``), or the nearest build whose shared memory one block of
    the current device may have: the defaults above given up in turn (q in shared memory, then
    8 warps), never what an experiment forced. On the H200 every default fits; on GPUs with
    less shared memory a block (sm_86/89: 99 KiB, A100: 163 KiB) a 16-bit 8-warp build at
    head_dim 128 (128 KiB) or fp8 at head_dim 256 with 8 warps and q in shared memory (192 KiB)
    does not. ``stages``: the stages asked for (0: the default, which follows the warps). If
    nothing fits, ``variant`` (its build then says by how much it is over)."""
    from dataclasses import replace

    limit = device_info()["shared_per_block_optin"]
    options = [variant]
    if q_default and variant.q_in_smem:
        options.append(replace(variant, q_in_smem=0))
    if warps_default and variant.num_warps != 4:
        options += [replace(v, num_warps=4, stages=stages) for v in list(options)]
    return next((v for v in options if v.shared_bytes <= limit), variant)
