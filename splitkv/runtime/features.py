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
    spreading like plain grids). The measurements are in benchmarks/NOTES.md (session 6)."""
    return num_ctas <= device_info()["num_sms"] and cluster_size <= 2


# Warps of a CTA that is alone on its SM, for fp8 K/V (``plan_warps``).
LONE_CTA_WARPS = 8


def plan_warps(kv_dtype: str | None, num_ctas: int, forced: int | None = None) -> int:
    """Warps per CTA of a per-shape plan's partial kernel: ``forced`` when an experiment says
    so; else 8 (128-token tiles) for fp8 K/V when the grid gives no SM two CTAs, 4 otherwise.
    An fp8 CTA is issue- and latency-bound: alone on its SM with 4 warps it streams about half
    its share, and 8 warps give it the warps two CTAs would have (H200: b1_n32k 29.6 -> 24.3 us,
    b8_n8k 51.3 -> 40.4). Where CTAs already run two to an SM, 8 warps lose (b128_n2k 151 ->
    166: one 8-warp CTA an SM, 193 registers a thread). bf16 measured slower with 8 warps
    everywhere (benchmarks/NOTES.md). A graph-stable wrapper keeps 4: its one captured grid
    serves every plan."""
    if forced is not None:
        return forced
    if kv_dtype and num_ctas <= device_info()["num_sms"]:
        return LONE_CTA_WARPS
    return 4
