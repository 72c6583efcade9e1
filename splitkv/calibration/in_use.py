"""Which profile splitkv plans with on a device, asked as a wrapper asks (``load_profile``
for the device's name and SM count, so ``$SPLITKV_PROFILE`` and the user cache count): the
one before a calibration (what its plans are compared with), and after it, whether the
profile just written is the one used, or which file wins over it and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .._log import caught_notices
from ..planner.profile_lookup import load_profile
from ..planner.profiles import PRIOR_ORIGIN, PROFILE_ENV, Profile, ProfileError
from ..planner.profiles import SHIPPED_ORIGIN_PREFIX as SHIPPED_PREFIX
from ..planner.profiles import prior_profile
from ..planner.profiles import user_profile_path as cache_file


def _load(device_name: str, num_sms: int) -> tuple[Profile | None, str | None, list[str]]:
    """(``load_profile``'s answer or None, its error, the notices it logged). The notices
    are caught: the prior's suggests running ``splitkv calibrate``, which is under way."""
    with caught_notices() as caught:
        try:
            profile, error = load_profile(device_name=device_name, num_sms=num_sms), None
        except ProfileError as exc:
            profile, error = None, str(exc)
    return profile, error, [record.getMessage() for record in caught]


def _same_file(a, b) -> bool:
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def describe_origin(origin: str, device_name: str) -> str:
    """A profile's origin in words: the prior, a shipped file, or a path and what put it in
    the lookup."""
    if origin == PRIOR_ORIGIN:
        return "the roofline prior (no calibrated profile for this GPU)"
    if origin.startswith(SHIPPED_PREFIX):
        return f"the profile shipped with splitkv ({origin.removeprefix(SHIPPED_PREFIX)})"
    env = os.environ.get(PROFILE_ENV)
    path = os.path.abspath(origin)          # the exact file, whatever folder one runs from
    if env and _same_file(origin, env):
        return f"{path} (named by ${PROFILE_ENV})"
    if _same_file(origin, cache_file(device_name)):
        return f"{path} (the user cache)"
    return path


def previous_profile(device_name: str, num_sms: int) -> tuple[Profile, str]:
    """The profile splitkv plans with on this device now, and where it comes from in words.
    Where none can be loaded (``$SPLITKV_PROFILE`` names a file that cannot be used), the
    roofline prior, with the reason."""
    profile, error, _ = _load(device_name, num_sms)
    if profile is None:
        return prior_profile(device_name, num_sms), f"the roofline prior ({error})"
    return profile, describe_origin(profile.origin, device_name)


@dataclass(frozen=True)
class ProfileInUse:
    """``profile_in_use``'s answer. ``used``: the origin of the profile wrappers on the device
    plan with, None when they cannot load one (``error`` says why); ``skipped``: the notices
    of files the lookup passed over."""

    written: Path
    device_name: str
    env: str | None                 # $SPLITKV_PROFILE when asked
    used: str | None
    error: str | None = None
    skipped: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return (self.used is not None and self.used != PRIOR_ORIGIN
                and not self.used.startswith(SHIPPED_PREFIX)
                and _same_file(self.used, self.written))

    def lines(self) -> list[str]:
        """One line when the written profile is the one used; else a warning, the profile
        that is used instead, and how to use the new one."""
        if self.ok:
            return ["splitkv plans with it on this GPU: "
                    + describe_origin(self.used, self.device_name)]
        fix = (f"set {PROFILE_ENV}={self.written} or pass profile=\"{self.written}\" to the "
               "wrapper")
        if self.error is not None:
            return [f"warning: splitkv cannot load a profile on this GPU (wrappers raise "
                    f"ProfileError): {self.error}",
                    f"  to plan with the new one: unset {PROFILE_ENV} or {fix}"]
        cache = cache_file(self.device_name)
        in_cache = _same_file(self.written, cache)
        if self.env:
            why = f"${PROFILE_ENV}={self.env} comes first"
            fix = (f"unset {PROFILE_ENV}" if in_cache else f"{fix}, or unset {PROFILE_ENV} "
                   f"and copy it to {cache}")
        elif in_cache:
            why = "it was skipped" + (f" ({self.skipped[0]})" if self.skipped else "")
        else:
            why = "it is not where splitkv looks"
            fix += f", or copy it to {cache}"
        return [f"warning: splitkv will not plan with this profile: {why}",
                f"  splitkv plans with: {describe_origin(self.used, self.device_name)}",
                f"  to plan with the new one: {fix}"]


def profile_in_use(written, device_name: str, num_sms: int) -> ProfileInUse:
    """Load the profile as a wrapper on this device would, and say whether it is the one at
    ``written`` (just saved by ``splitkv calibrate``)."""
    profile, error, caught = _load(device_name, num_sms)
    cache = str(cache_file(device_name))
    return ProfileInUse(Path(written), device_name, os.environ.get(PROFILE_ENV) or None,
                        None if profile is None else profile.origin, error,
                        tuple(w for w in caught if cache in w))
