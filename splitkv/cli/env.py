"""``splitkv env``: what an operator needs to diagnose the GPU stack, one ``name: value`` line
each (``--json``: the same as one JSON object): splitkv, Python and its dependencies, the CuPy
installed (two CuPy distributions overwrite each other's files: said as a warning), the CUDA
runtime CuPy was built for, NVRTC, the driver, the devices, the profile planning would use on
this GPU (without one, as ``splitkv plan`` does) and why, the cache folders with their sizes,
and the environment variables that change any of these. The caches: splitkv's folder, its
profiles, its first-use models, the kernels ``splitkv precompile`` wrote ("precompiled
kernels") and CuPy's ("kernel cache").

Every probe is guarded: one that fails says why on its own line, so a broken install is
described rather than a traceback. Nothing is compiled or timed: a GPU without a profile is
not probed (the profile line says what a wrapper's first plan would do). CuPy is reached
through ``splitkv.runtime`` (``gpu_available`` imports it); the version lines read the module
it imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import warnings
from importlib import metadata
from pathlib import Path

from .._log import caught_notices
from .._version import __version__
from . import args as A
from . import cache as C

ENV_PREFIXES = ("SPLITKV_", "CUPY_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_PATH", "CUDA_HOME", "XDG_CACHE_HOME",
             "LD_LIBRARY_PATH")
MAX_DEVICES = 64
# the lines every report has, in order (devices add "device N" lines)
CUPY_KEYS = ("cupy", "cupy distributions", "cuda runtime", "nvrtc", "cuda driver", "gpu",
             "devices")
CACHE_KEYS = ("cache dir", "profiles cache", "first-use cache", "precompiled kernels",
              "kernel cache")
KEYS = ("splitkv", "python", "numpy", "scipy", "pyyaml", *CUPY_KEYS, "profile", *CACHE_KEYS,
        "environment")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for line in lines(report):
            print(line)
    return 0


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return A.one_line(f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)


def _guarded(probe, *args):
    """``probe(*args)``, or why it failed, in words: no probe stops the report."""
    try:
        return probe(*args)
    except Exception as exc:         # whatever a broken install raises
        return f"unavailable ({_why(exc)})"


def _cuda_version(value) -> str:
    """CUDA's integer version (13020) as 13.2."""
    value = int(value)
    return f"{value // 1000}.{value % 1000 // 10}"


def collect() -> dict:
    """The report: every key of ``KEYS``, and "warnings" (a list) where there are any;
    warnings raised and splitkv's notices logged while probing are gathered into it rather
    than printed."""
    report: dict = {}
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught, caught_notices() as noted:
        warnings.simplefilter("always")
        report["splitkv"] = f"{__version__} ({Path(__file__).resolve().parents[1]})"
        report["python"] = f"{platform.python_version()} ({sys.executable})"
        for key, module in (("numpy", "numpy"), ("scipy", "scipy"), ("pyyaml", "yaml")):
            report[key] = _guarded(_module_version, module)
        cupy = _guarded(_cupy_lines, report, found)
        if isinstance(cupy, str):           # the probe itself failed
            report.update({k: cupy for k in CUPY_KEYS if k not in report})
        report["profile"] = _guarded(_profile, report.get("_device"))
        report.pop("_device", None)
        for key, args in zip(CACHE_KEYS, ((C.cache_dir, True, C.cache_dir_source),
                                          (C.user_profile_dir,), (C.first_use_dir,),
                                          (C.cubin_dir,),
                                          (C.kernel_cache_dir, False, _kernel_cache_source))):
            report[key] = _guarded(_cache, *args)
        report["environment"] = {
            name: A.one_line(text) for name, text in sorted(os.environ.items())
            if name.startswith(ENV_PREFIXES) or name in ENV_NAMES}
        found += _bad_settings()
    found += [A.one_line(r.getMessage()) for r in noted]
    found += [A.one_line(w.message) for w in caught]
    ordered = {key: report.pop(key) for key in KEYS if key in report}
    if found:
        report["warnings"] = list(dict.fromkeys(found))
    return {**ordered, **report}


def _bad_settings() -> list[str]:
    """The environment's values that a later call would refuse: $SPLITKV_FIRST_USE (the first
    plan on a GPU without a profile raises on a bad one)."""
    from ..planner.first_use import first_use_mode

    try:
        first_use_mode()
    except ValueError as exc:
        return [f"{A.one_line(exc)} (a wrapper's first plan on a GPU without a profile raises "
                "this)"]
    return []


def _module_version(name: str) -> str:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return f"not installed ({_why(exc)})"
    return f"{getattr(module, '__version__', '?')} ({Path(module.__file__).parent})"


def cupy_distributions() -> list[tuple[str, str]]:
    """(name, version) of every installed distribution whose name starts with "cupy"."""
    found = []
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").strip()
        if name.lower().startswith("cupy"):
            found.append((name, str(dist.version)))
    return sorted(set(found))


def _cupy_lines(report: dict, found: list) -> None:
    """The CuPy, CUDA, NVRTC, driver and device lines; the device profiles plan for, kept in
    report["_device"] for ``_profile``."""
    from ..runtime import cupy_build, device_info, gpu_available, nvrtc_available

    dists = _guarded(cupy_distributions)
    if isinstance(dists, list):
        report["cupy distributions"] = ", ".join(f"{n} {v}" for n, v in dists) or "none"
        if len(dists) > 1:
            found.append(f"{len(dists)} CuPy distributions are installed "
                         f"({report['cupy distributions']}): they install the same cupy package "
                         "over each other; uninstall all of them and install one (the "
                         "[cuda12] or [cuda13] extra)")
    else:
        report["cupy distributions"] = dists
    ok, reason = gpu_available()
    cupy = cupy_build()
    if cupy is None:
        report["cupy"] = reason
        for key in ("cuda runtime", "nvrtc", "cuda driver", "gpu", "devices"):
            report[key] = "n/a: no CuPy (see the cupy line)"
        return
    report["cupy"] = f"{cupy['version']} ({cupy['path']})"
    report["cuda runtime"] = ("unavailable (the CUDA runtime library does not load)"
                              if cupy["cuda_runtime"] is None
                              else f"{_cuda_version(cupy['cuda_runtime'])} (CuPy's build)")
    nvrtc_ok, nvrtc = nvrtc_available()
    report["nvrtc"] = nvrtc.removeprefix("NVRTC ") if nvrtc_ok else f"unavailable: {nvrtc}"
    report["cuda driver"] = _guarded(_driver)
    report["gpu"] = f"usable ({reason})" if ok else f"not usable: {reason}"
    devices, error = [], None
    for i in range(MAX_DEVICES):
        try:
            info = device_info(i)
        except Exception as exc:         # past the last device, or none usable
            error = exc
            break
        devices.append({"id": i, "name": info["name"],
                        "compute_capability": f"{info['cc'][:-1]}.{info['cc'][-1]}",
                        "sms": info["num_sms"]})
    report["devices"] = devices or f"none: {reason if not ok else _why(error)}"
    if devices:
        current = _guarded(device_info)          # the device a wrapper plans for
        report["_device"] = current if isinstance(current, dict) else {
            "name": devices[0]["name"], "num_sms": devices[0]["sms"]}


def _driver() -> str:
    from ..runtime import driver_version

    version = int(driver_version())
    if version == 0:
        return "none: no CUDA driver is installed (the driver reports version 0)"
    return f"{_cuda_version(version)} (the newest CUDA this driver runs)"


class _NoProbes:
    """A ``first_use`` source for ``load_profile`` that reads the first-use cache and times
    nothing: ``splitkv env`` reports, it does not measure."""

    def __init__(self):
        from ..runtime import driver_version

        self.driver_version = driver_version()

    def probe(self):
        from ..planner.first_use import ProbesDeferred

        raise ProbesDeferred("splitkv env times nothing")

    calibrate = probe


def _profile(device) -> str:
    """The profile ``load_profile`` picks for the device and its origin: explicit, user cache,
    shipped, first-use or prior. Without a GPU, asked as planning without one asks
    (``load_profile()``: ``splitkv plan``, ``choose_plan``): the reference device's, or the
    ``$SPLITKV_PROFILE`` file whatever GPU it was calibrated on, which a note then names."""
    from ..planner.first_use import FIRST_USE_ENV, first_use_mode
    from ..planner.profile_lookup import load_profile
    from ..planner.profiles import (PRIOR_ORIGIN, PROFILE_ENV, REFERENCE_DEVICE,
                                    SHIPPED_ORIGIN_PREFIX, ProfileError, device_slug)

    if device is None:
        name, num_sms, source = None, None, None
    else:
        name, num_sms, source = device["name"], device["num_sms"], _NoProbes()
    try:
        profile = load_profile(device_name=name, num_sms=num_sms, first_use=source)
    except (ProfileError, ValueError) as exc:
        return f"error: {A.one_line(exc)}{_refused(device)}"
    note = ""
    if device is not None:
        where = f"for {name}, {num_sms} SMs"
    elif device_slug(profile.device_name) == device_slug(REFERENCE_DEVICE):
        where = f"for {REFERENCE_DEVICE}, the reference device: no GPU here"
    else:
        where = f"for {profile.device_name}, {profile.num_sms} SMs, the profile's GPU: no GPU here"
        note = (f"; calibrated on another GPU than the reference {REFERENCE_DEVICE}: planning "
                "without a GPU plans for its GPU with it, a wrapper on another GPU refuses it")
    origin = profile.origin
    if origin == PRIOR_ORIGIN:
        kind = "prior"
    elif origin.startswith(SHIPPED_ORIGIN_PREFIX):
        kind = "shipped"
    elif os.environ.get(PROFILE_ENV):
        kind = f"explicit (${PROFILE_ENV})"
    elif Path(origin).parent == C.first_use_dir():
        kind = "first-use"
    else:
        kind = "user cache"
    text = f"{kind}: {origin} ({where}){note}"
    if kind == "prior" and source is not None:
        try:
            mode = first_use_mode()
        except ValueError as exc:
            return f"{text}; {A.one_line(exc)}"
        text += {"probe": "; a wrapper's first plan times the first-use probes (seconds) and "
                          f"caches the model in {C.first_use_dir()}",
                 "calibrate": f"; a wrapper's first plan runs the quick calibration "
                              f"(${FIRST_USE_ENV}=calibrate)",
                 "off": f"; ${FIRST_USE_ENV}=off keeps it"}[mode]
    return text


def _refused(device) -> str:
    """Where ``load_profile`` refused the ``$SPLITKV_PROFILE`` file for this GPU because it was
    calibrated on another one: a note saying so and what planning does with it; else ""."""
    from ..planner.profiles import PROFILE_ENV, device_slug, read_profile

    named = os.environ.get(PROFILE_ENV)
    if device is None or not named:
        return ""
    try:
        profile = read_profile(named)
    except Exception:                # unreadable: the error says why
        return ""
    if (device_slug(profile.device_name) == device_slug(device["name"])
            and profile.num_sms == device["num_sms"]):
        return ""
    return ("; calibrated on another GPU: a wrapper on this one refuses it as well, planning "
            f"without a GPU (splitkv plan) plans for {profile.device_name} with it")


def _cache(folder, recursive=False, source=None) -> dict:
    """A cache folder's ``folder_usage`` and what chose the folder."""
    usage = C.folder_usage(folder(), recursive)
    return {**usage, "from": source()} if source else usage


def _kernel_cache_source() -> str:
    return (f"from ${C.CUPY_CACHE_ENV}" if os.environ.get(C.CUPY_CACHE_ENV) is not None
            else "CuPy's default")


def lines(report: dict) -> list[str]:
    """The report as ``name: value`` lines."""
    out = []
    for key, value in report.items():
        if key == "warnings":
            out += [f"warning: {w}" for w in value]
        elif key == "environment":
            out += ([f"${name}: {v}" for name, v in value.items()] if value else
                    [f"environment: none of {', '.join(p + '*' for p in ENV_PREFIXES)}, "
                     f"{', '.join(ENV_NAMES)} is set"])
        elif key == "devices" and isinstance(value, list):
            out.append(f"devices: {len(value)}")
            out += [f"device {d['id']}: {d['name']}, compute capability "
                    f"{d['compute_capability']}, {d['sms']} SMs" for d in value]
        elif isinstance(value, dict) and "files" in value:
            if value["path"] is None:
                out.append(f"{key}: none (${C.CUPY_CACHE_ENV} is set but empty: CuPy writes "
                           "into the working folder)")
                continue
            size = (C.files_and_bytes(value["files"], value["bytes"]) if value["exists"]
                    else "not a folder" if value.get("not_a_folder") else "absent")
            source = f"; {value['from']}" if value.get("from") else ""
            out.append(f"{key}: {value['path']} ({size}{source})")
        else:
            out.append(f"{key}: {value}")
    return out
