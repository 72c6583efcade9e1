"""What the current GPU can do for a launch, decided in one place: the options that need compute
capability 9.0 (thread-block clusters, programmatic dependent launch), the shared-memory size
that places one CTA per SM, and the device's properties that the build rules read
(``device_properties``; the rules themselves are ``core.builds``)."""

from __future__ import annotations

from functools import lru_cache

from ..core.builds import DeviceProperties
from . import device_info


def device_properties() -> DeviceProperties:
    """The current device's ``core.builds.DeviceProperties``."""
    info = device_info()
    return _properties(info["device_id"])


@lru_cache(maxsize=None)
def _properties(device_id: int) -> DeviceProperties:
    info = device_info(device_id)
    return DeviceProperties(info["num_sms"], info["shared_per_block_optin"],
                            info["shared_per_sm"], int(info["cc"]), info["name"])


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
