"""``splitkv calibrate``: time candidate plans on this GPU, fit the cost model, write a profile
where ``load_profile`` finds it.

    splitkv calibrate            # full sweep, a few minutes
    splitkv calibrate --quick    # a small sweep, about a minute
    splitkv calibrate --plot --out my-gpu.yaml --device 1
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from ..runtime import timing as runtime_timing

QUICK_TIMING = {"trials": 3, "min_trial_ms": 10.0}

# A few batches whose plans the summary shows (ANCHORS.md's standard cases).
EXAMPLES = [("b1_n1k", [1024], 32, 8), ("b1_n32k", [32768], 32, 8),
            ("b8_n8k", [8192] * 8, 32, 8), ("b128_n2k", [2048] * 128, 32, 8),
            ("g8_b1_n32k", [32768], 64, 8)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a small sweep with shorter trials (about a minute)")
    parser.add_argument("--plot", action="store_true",
                        help="also write PNGs next to the profile: predicted vs measured, and "
                             "the decision map (needs matplotlib)")
    parser.add_argument("--out", metavar="PATH",
                        help="profile to write (default: the user cache, where splitkv looks)")
    parser.add_argument("--device", type=int, default=None, metavar="N",
                        help="the CUDA device to calibrate (default: the current one)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the ragged lengths and pages")
    parser.add_argument("--trials", type=int, default=None,
                        help="timing trials per plan (default 7, or 3 with --quick)")
    parser.add_argument("--min-trial-ms", type=float, default=None,
                        help="milliseconds per trial (default 30, or 10 with --quick)")


def _select_device(n: int) -> str | None:
    """Make device ``n`` the only one CUDA sees (before CUDA starts); an error message if not."""
    if "cupy" in sys.modules:
        return "--device must be chosen before CUDA starts in this process"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if not 0 <= n < len(ids):
            return f"--device {n}: CUDA_VISIBLE_DEVICES={visible} shows {len(ids)} device(s)"
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[n]
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(n)
    return None


def _progress(i, n, point, us):
    pred = point.plan.predicted_us
    print(f"[{i + 1:4d}/{n}] {point.shape:<30} {point.label:<34} {us:10.2f} us"
          f"   (prior {pred:9.2f})", flush=True)


def example_lines(profile) -> list[str]:
    from ..planner import choose_plan
    from ..problem import DecodeProblem

    out = []
    for name, lens, hq, hk in EXAMPLES:
        problem = DecodeProblem(np.array(lens), hq, hk, 128, 16)
        plan = choose_plan(problem, profile)
        s = plan.summary()
        out.append(f"  {name:<12} {s['strategy']:<12} {s['num_splits']:>4} splits, "
                   f"{s['num_work_items']:>5} work items, predicted {plan.predicted_us:8.2f} us")
    return out


def run(args) -> int:
    if args.device is not None:
        error = _select_device(args.device)
        if error:
            print(f"splitkv calibrate: {error}", file=sys.stderr)
            return 2
    try:
        from ..runtime import device_info, gpu_available
    except ImportError as exc:
        print(f"splitkv calibrate: the GPU runtime cannot be imported ({exc})", file=sys.stderr)
        return 2
    ok, why = gpu_available()
    if not ok:
        print(f"splitkv calibrate: needs a CUDA GPU to measure on ({why}). Without one, "
              "splitkv plans with its shipped profiles or a roofline prior.", file=sys.stderr)
        return 2

    from ..planner.profiles import device_slug, prior_profile, user_profile_dir
    from .fit import fit_profile
    from .sweep import measure, sweep_points, write_measurements

    info = device_info()
    prior = prior_profile(info["name"], info["num_sms"])
    points = sweep_points(prior.cost_model(), args.quick, args.seed)
    shapes = len({p.shape for p in points})
    timing = dict(QUICK_TIMING) if args.quick else {}
    if args.trials is not None:
        timing["trials"] = args.trials
    if args.min_trial_ms is not None:
        timing["min_trial_ms"] = args.min_trial_ms
    print(f"calibrating {info['name']} ({info['num_sms']} SMs): {len(points)} plans of "
          f"{shapes} shapes ({'quick' if args.quick else 'full'} sweep)", flush=True)
    measurements = measure(points, progress=_progress, seed=args.seed, **timing)
    runtime_timing.release_cached_layers()

    sweep = {"name": "quick" if args.quick else "full", "seed": args.seed,
             "timing": timing or {"trials": runtime_timing.TRIALS,
                                  "min_trial_ms": runtime_timing.MIN_TRIAL_MS}}
    profile, report = fit_profile(measurements, info, seed=args.seed, sweep=sweep)
    out = Path(args.out) if args.out else user_profile_dir() / f"{device_slug(info['name'])}.yaml"
    profile.save(out)
    csv_path = write_measurements(out.with_suffix(".csv"), measurements, profile.cost_model())

    print()
    for line in report.lines():
        print(line)
    worst = sorted(report.decisions, key=lambda d: d.regret, reverse=True)[:3]
    for d in worst:
        if d.regret > 0:
            print(f"  {d.shape}: picks {d.chosen} ({d.chosen_us:.2f} us), best measured "
                  f"{d.best} ({d.best_us:.2f} us)")
    print("parameters: " + ", ".join(f"{k}={v:.3g}" for k, v in profile.coef.items()))
    print(f"best decode bandwidth measured: {profile.measured_bandwidth_gbps:,.0f} GB/s")
    print("plans it now chooses:")
    for line in example_lines(profile):
        print(line)
    print(f"profile written to {out} (measurements in {csv_path})")
    if args.plot:
        from .plots import write_plots

        for line in write_plots(out.parent, out.stem, measurements, profile, report):
            print(line)
    return 0
