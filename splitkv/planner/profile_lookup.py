"""Which profile planning uses: ``load_profile`` looks in this order and takes the first that
answers:
  1. the ``path`` argument;
  2. ``$SPLITKV_PROFILE``;
  3. the user cache: ``<cache>/profiles/<device>.yaml``, where ``<cache>`` is
     ``$SPLITKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/splitkv``, else ``~/.cache/splitkv``;
  4. the profiles shipped in ``splitkv/planner/profiles/``, matched by device name;
  5. given a ``first_use`` source (a wrapper passes one for its device), the first-use
     model (``planner.first_use``): cached per GPU, driver and splitkv version under
     ``<cache>/profiles/first-use/``, else probed in a few seconds and cached;
     ``$SPLITKV_FIRST_USE`` = off skips this step, = calibrate runs the quick calibration
     instead (docs/design/first-use.md);
  6. a roofline prior computed from the SM count and a bandwidth guess, with a one-time
     notice that suggests ``splitkv calibrate``; also where the probes fail.
A broken or mismatched file named by 1 or 2 is an error (the user asked for it); one found in
3, 4 or the first-use cache is skipped with one notice naming it (a WARNING record of the
``splitkv`` logger, as is the prior's): no file on disk can stop planning.

The profiles themselves (reading, checking, the prior) are ``profiles``'; the first-use model is
``first_use``'s, which builds on ``profiles`` too, so this module sits above both and nothing
below it imports it.
"""

from __future__ import annotations

import os

from .._log import logger
from .cost_model import check_machine
from .first_use import resolve
from .profiles import (CACHE_DIR_ENV, PROFILE_ENV, REFERENCE_DEVICE, SHIPPED_ORIGIN_PREFIX,
                       Profile, ProfileError, check_device, device_slug, prior_profile,
                       read_profile, shipped_profile, user_profile_path, warn_skipped)

_warned_prior: set = set()
PRIOR_NOTICE = "splitkv has no calibrated profile"   # how the prior's notice begins


def _found(where: str, read, device_name: str, num_sms) -> Profile | None:
    """``read()``'s profile (None: no file) if made for this device; else None with one notice
    naming ``where`` and what is wrong: a file found on disk never stops planning."""
    try:
        profile = read()
        if profile is not None:
            check_device(profile, device_name, num_sms)
        return profile
    except (OSError, ValueError, TypeError, KeyError) as e:   # and what no check foresaw
        error = e if isinstance(e, ProfileError) else ProfileError(
            f"profile {where}: cannot read it ({type(e).__name__}: {e})")
    warn_skipped(error, "using the next profile found")
    return None


def load_profile(path=None, device_name: str | None = None, num_sms: int | None = None,
                 bandwidth_gbps: float | None = None, first_use=None) -> Profile:
    """The profile to plan with (see the module docstring for the lookup order).

    path: a profile file (str or os.PathLike), or None to look one up (an empty path is a
        ValueError, not None).
    device_name, num_sms: the device to plan for (the runtime passes ``device_info()``'s);
        without them, the reference device ``NVIDIA H200``. Given, they are checked against
        the profile found.
    bandwidth_gbps: the bandwidth guess for the roofline prior, if it comes to that.
    first_use: what can probe the device, for step 5 (a wrapper passes
        ``measure.first_use_probes.DeviceProbes``); None skips it (no device to measure).
        ``$SPLITKV_FIRST_USE`` is checked only then.
    """
    if path is not None and (not isinstance(path, (str, os.PathLike)) or not os.fspath(path)):
        raise (ValueError if isinstance(path, (str, os.PathLike)) else TypeError)(
            f"path: expected a profile file's path (str or os.PathLike), or None to look one "
            f"up; got {type(path).__name__} {path!r:.80}")
    if device_name is not None and (not isinstance(device_name, str) or not device_name):
        raise ValueError(f"device_name: expected a GPU's name or None, got {device_name!r}")
    check_machine(num_sms, None, bandwidth_gbps, optional=True)
    for explicit, what in ((path, "the path given"),
                           (os.environ.get(PROFILE_ENV), f"${PROFILE_ENV}")):
        if explicit:
            try:
                profile = read_profile(explicit)
                check_device(profile, device_name, num_sms)
            except ProfileError as e:
                raise ProfileError(f"{e} (named by {what})") from None
            return profile

    name = device_name or REFERENCE_DEVICE
    slug = device_slug(name)
    cached = user_profile_path(name)
    for where, read in ((cached, lambda: read_profile(cached) if cached.is_file() else None),
                        (f"{SHIPPED_ORIGIN_PREFIX}{slug}.yaml", lambda: shipped_profile(slug))):
        profile = _found(where, read, name, num_sms)
        if profile is not None:
            return profile
    if first_use is not None:
        profile = resolve(name, num_sms, first_use)
        if profile is not None:
            return profile

    key = (slug, num_sms)
    if key not in _warned_prior:
        _warned_prior.add(key)
        logger.warning(f"{PRIOR_NOTICE} for {name!r}"
                       f"{f' with {num_sms} SMs' if num_sms else ''}; planning with a roofline "
                       "prior. Run `splitkv calibrate` on this GPU for better plans.")
    return prior_profile(name, num_sms, bandwidth_gbps)


_default: dict = {}


def default_profile() -> Profile:
    """``load_profile()`` for the reference device, remembered (planning runs every step)."""
    key = tuple(os.environ.get(k) for k in (PROFILE_ENV, CACHE_DIR_ENV, "XDG_CACHE_HOME"))
    profile = _default.get(key)
    if profile is None:
        profile = _default[key] = load_profile()
    return profile
