"""First use on a GPU of an architecture splitkv already has a profile for: the shipped profile
of that architecture's GPU, rescaled to this one by what a read probe measures.

Two GPUs of one compute capability run the same builds with the same SM: what a launch, a wave,
a tile or a merge costs is the architecture's (and its clocks'), while what streaming the K/V
costs is the memory's. So every fit of the shipped profile (16-bit, fp8, graph-stable fp8) is
kept, with this device's SM count, and the bandwidth its streaming read reached becomes the
byte columns' unit. On an H100 (the H200's architecture) the H200's profile as it is planned
93% of the held-out shapes within 5% of the best, against 89% for the first-use probes' own
model (docs/design/first-use.md); and only the read probe runs, no decode build is compiled.
"""

from __future__ import annotations

import datetime
import functools
import math
from dataclasses import replace
from importlib import resources

from ..core.architectures import GPU_SMS
from .profiles import SHIPPED_ORIGIN_PREFIX, Profile, device_slug, parse_profile

KIN_SOURCE = "first use: a shipped profile of the same architecture"


@functools.lru_cache(maxsize=1)
def shipped_profiles() -> tuple[Profile, ...]:
    """Every profile splitkv ships, by file name; read once (they are part of the package, and
    first use asks before and after its read probe)."""
    folder = resources.files(__package__).joinpath("profiles")
    return tuple(parse_profile(f.read_bytes(), f"{SHIPPED_ORIGIN_PREFIX}{f.name}")
                 for f in sorted(folder.iterdir(), key=lambda f: f.name)
                 if f.name.endswith(".yaml"))


def kin_of(device_name: str, cc: int | None, gbps: float | None = None) -> Profile | None:
    """The shipped profile of another GPU of compute capability ``cc`` (a GPU of
    ``core.architectures.GPU_SMS``), or None. Where the architecture has several (an H100's and
    an H200's), the one whose measured streaming bandwidth is nearest ``gbps`` (this GPU's
    read, in ratio): an H100 PCIe takes the H100's, an H200 NVL the H200's; without ``gbps``,
    the first by file name."""
    if cc is None:
        return None
    kins = [p for p in shipped_profiles()
            if (GPU_SMS.get(p.device_name) or (None,))[0] == cc
            and device_slug(p.device_name) != device_slug(device_name)]
    if not kins:
        return None
    if gbps is None or gbps <= 0:
        return kins[0]
    return min(kins, key=lambda p: abs(math.log(_read_gbps(p) / gbps)))


def _read_gbps(profile: Profile) -> float:
    """The streaming bandwidth a profile's GPU reached in its calibration (its guess without)."""
    return float(profile.measured_bandwidth_gbps or profile.bandwidth_gbps)


def known_gpu(device_name: str) -> tuple[int, int] | None:
    """(compute capability, SMs) of a GPU of ``GPU_SMS`` named ``device_name`` in any case or
    spacing (as profile files are matched: ``device_slug``), else None."""
    slug = device_slug(device_name)
    return next((cc_sms for name, cc_sms in GPU_SMS.items() if device_slug(name) == slug), None)


def kin_by_name(device_name: str, num_sms: int | None = None) -> Profile | None:
    """Without the GPU: what first use on a GPU named ``device_name`` (of ``GPU_SMS``) would
    take, its kin rescaled to the bandwidth guessed from its name (the GPU measures its own
    read), for ``splitkv plan --device-name``; None where its architecture has no shipped
    profile of another GPU."""
    from .profiles import guess_bandwidth_gbps

    known = known_gpu(device_name)
    if known is None:
        return None
    gbps = guess_bandwidth_gbps(device_name)
    kin = kin_of(device_name, known[0], gbps)
    if kin is None:
        return None
    profile = kin_profile(kin, device_name, num_sms or known[1], gbps)
    return replace(profile, origin=f"the shipped profile of {kin.device_name} at a guessed "
                                   f"{gbps:,.0f} GB/s (the GPU measures its own streaming read)")


def kin_profile(shipped: Profile, device_name: str, num_sms: int, bandwidth_gbps: float,
                seconds: float = 0.0) -> Profile:
    """``shipped`` for this device: its fits, this device's SMs and streaming bandwidth (the
    byte columns' unit), the date, and where it came from in ``source`` and ``sweep``."""
    from .._version import __version__

    return replace(shipped, device_name=device_name, num_sms=int(num_sms),
                   bandwidth_gbps=round(float(bandwidth_gbps), 1), measured_bandwidth_gbps=None,
                   fit_error=None, heldout_error=None,
                   date=datetime.date.today().isoformat(), splitkv_version=__version__,
                   source=KIN_SOURCE,
                   sweep={"name": KIN_SOURCE, "from": shipped.device_name,
                          "from_bandwidth_gbps": shipped.bandwidth_gbps,
                          "read_gbps": round(float(bandwidth_gbps), 1),
                          "seconds": round(seconds, 3)},
                   origin=f"{KIN_SOURCE} ({shipped.device_name})")
