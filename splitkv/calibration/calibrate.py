"""One calibration of a GPU, end to end: the sweep drawn under the device's roofline prior,
timed through the runtime, the cost model fitted to it, and the profile written with its
measurements. ``splitkv calibrate`` is this plus printing.
"""

from __future__ import annotations

from pathlib import Path

from ..core.builds import default_tile_per_warp, row_tiles_for
from ..core.geometry import WARPS_PER_CTA
from ..measure import timing as measure_timing
from ..planner import Profile
from ..planner.profiles import prior_profile, user_profile_path
from ..runtime.experiments import DecodeExperiments
from .fit import FitReport, fit_profile, fit_tile_rule
from .sweep import Measurement, SweepPoint, measure, sweep_points, write_measurements

QUICK_TIMING = {"trials": 3, "min_trial_ms": 10.0}


def graph_stable_experiments(kv_dtype: str):
    """The knobs that make a per-shape wrapper run a problem's graph-stable grid build: 4 warps,
    no one-CTA-an-SM spreading, and the tile a warp ``core.builds.graph_build`` gives (32 tokens
    for fp8 at head_dim 128 with one row tile, else 16)."""
    def experiments(problem) -> DecodeExperiments:
        tile = default_tile_per_warp(kv_dtype, problem.head_dim, WARPS_PER_CTA,
                                     row_tiles_for(problem.num_qo_heads // problem.num_kv_heads),
                                     False)
        return DecodeExperiments(warps=WARPS_PER_CTA, pdl_spread=False, tile_per_warp=tile)
    return experiments


def sweep_for(device: dict, quick: bool = False, seed: int = 0) -> list[SweepPoint]:
    """The ``SweepPoint``s to time on ``device`` (``splitkv.runtime.device_info()``): the
    candidates its roofline prior ranks."""
    prior = prior_profile(device["name"], device["num_sms"])
    return sweep_points(prior.cost_model(), quick, seed)


def calibrate(points: list[SweepPoint], device: dict, *, quick: bool = False, seed: int = 0,
              trials: int | None = None, min_trial_ms: float | None = None,
              progress=None, kv_dtype: str | None = None, graph_stable: bool = False
              ) -> tuple[Profile, FitReport, list[Measurement]]:
    """Time ``points`` (from ``sweep_for``) and fit a profile for ``device``; over fp8 K/V
    codes if ``kv_dtype`` names an fp8 format (``Profile.with_kv_fp8`` adds that fit to a
    16-bit profile); with ``graph_stable``, every CTA at 4 warps, as a graph-stable wrapper
    runs them (``core.builds.plan_warps``).

    The 16-bit fit times per-shape builds, and so the 8 warps that lone grids of groups past
    16 run (``core.builds.plan_warps``) where a graph-stable wrapper keeps 4: its plans of such
    shapes are predicted as the 8-warp build (a difference fp8, whose two fits are apart,
    does not have).

    Trials default to ``QUICK_TIMING`` for a quick sweep and to the runtime's otherwise;
    ``progress(i, n, point, us)`` is called after each point (``sweep.measure``). Returns
    (profile, ``FitReport``, measurements).
    """
    if graph_stable and not kv_dtype:
        raise ValueError("graph_stable: the graph-stable fit is fp8's (16-bit plans are fitted "
                         "on the per-shape builds); give kv_dtype too")
    timing = dict(QUICK_TIMING) if quick else {}
    if trials is not None:
        timing["trials"] = trials
    if min_trial_ms is not None:
        timing["min_trial_ms"] = min_trial_ms
    fp8 = {"kv_dtype": kv_dtype} if kv_dtype else {}
    # each point's build as a graph-stable fp8 wrapper runs its grid
    experiments = {"experiments": graph_stable_experiments(kv_dtype)} if graph_stable else {}
    measurements = measure(points, progress=progress, seed=seed, **timing, **fp8,
                           **experiments)
    measure_timing.release_cached_layers()

    sweep = {"name": "quick" if quick else "full", "seed": seed,
             "timing": timing or {"trials": measure_timing.TRIALS,
                                  "min_trial_ms": measure_timing.MIN_TRIAL_MS},
             **fp8, **({"graph_stable": True} if graph_stable else {})}
    profile, report = fit_profile(measurements, device, seed=seed, sweep=sweep,
                                  kv_bytes_per_element=1 if kv_dtype else 2,
                                  tile_rule=fit_tile_rule(kv_dtype, graph_stable))
    return profile, report, measurements


def profile_path(device_name: str, path=None) -> Path:
    """Where ``save`` writes the profile: ``path``, or the user cache's file for the device."""
    return Path(path) if path else user_profile_path(device_name)


def save(profile: Profile, measurements: list[Measurement], path=None,
         kv_dtype: str | None = None, graph_stable: bool = False) -> tuple[Path, Path]:
    """Write ``profile`` to ``path`` (default: the user cache, where ``load_profile`` finds it)
    and the measurements, with the predictions of the model they fitted (``kv_dtype``'s,
    ``graph_stable``'s), to a CSV beside it (``<name>.fp8.csv`` for fp8's,
    ``<name>.fp8-graph-stable.csv``). Returns (profile path, CSV path)."""
    path = profile_path(profile.device_name, path)
    profile.save(path)
    suffix = ".fp8-graph-stable.csv" if kv_dtype and graph_stable else ".fp8.csv" if kv_dtype \
        else ".csv"
    return path, write_measurements(path.with_suffix(suffix), measurements,
                                    profile.cost_model(kv_dtype, graph_stable))
