"""``splitkv calibrate``: time candidate plans on this GPU, fit the cost model, write a profile
where ``load_profile`` finds it.

    splitkv calibrate            # full sweep, a few minutes
    splitkv calibrate --quick    # a small sweep, about a minute
    splitkv calibrate --plot --out my-gpu.yaml --device 1
    splitkv calibrate --kv-dtype fp8_e4m3     # the fp8 fit, added to the profile in use
    splitkv calibrate --kv-dtype fp8_e4m3 --graph-stable   # the fit graph-stable fp8 wrappers use

While it times, a progress line with the time left goes to stderr (redrawn on a terminal, a
plain line every 30 s in a log, none with --quiet; --verbose prints each plan timed). At the
end: the fit, a table of how the standard cases' plans change against the profile used
before, where the profile was written, and whether splitkv will plan with it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import args as A


def _profile_out(text: str) -> str:
    """--out: a file to write, whose measurements CSV beside it (same name, .csv) is another."""
    path = A.output_file(text)
    if Path(path).suffix == ".csv":
        raise argparse.ArgumentTypeError(
            f"{path!r}: the measurements are written beside the profile as "
            f"{Path(path).with_suffix('.csv').name}; give the profile another suffix (.yaml)")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a small sweep with shorter trials (about a minute)")
    parser.add_argument("--plot", action="store_true",
                        help="also write PNGs next to the profile: predicted vs measured, and "
                             "the decision map (needs matplotlib)")
    parser.add_argument("--out", type=_profile_out, metavar="PATH",
                        help="profile to write (default: the user cache, where splitkv looks)")
    parser.add_argument("--device", type=A.int_range(0, A.INT32_MAX), default=None, metavar="N",
                        help="the CUDA device to calibrate (default: the current one)")
    parser.add_argument("--seed", type=A.non_negative_int, default=0,
                        help="seeds the ragged lengths and pages")
    parser.add_argument("--trials", type=A.positive_int, default=None,
                        help="timing trials per plan (default 7, or 3 with --quick)")
    parser.add_argument("--min-trial-ms", type=A.positive_float, default=None,
                        help="milliseconds per trial (default 30, or 10 with --quick)")
    parser.add_argument("--kv-dtype", type=A.fp8_kv_dtype, default=None, metavar="FP8",
                        help="time over fp8 K/V (float8_e4m3fn, float8_e5m2, or vLLM's fp8_e4m3 "
                             "/ fp8_e5m2) and add that fit to a profile as its kv_fp8 "
                             "parameters, which fp8 caches plan with")
    parser.add_argument("--graph-stable", action="store_true",
                        help="with --kv-dtype: time every plan with 4-warp CTAs, as graph-stable "
                             "wrappers (use_cuda_graph=True) run fp8, and add that fit as the "
                             "profile's kv_fp8_graph_stable parameters")
    parser.add_argument("--base", type=A.existing_file, default=None, metavar="PATH",
                        help="with --kv-dtype: the profile to add the fp8 fit to (default: the "
                             "one splitkv plans with on this GPU)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--quiet", "-q", action="store_true",
                        help="no progress line while timing (the results are still printed)")
    output.add_argument("--verbose", "-v", action="store_true",
                        help="print each plan as it is timed, with the prior's prediction")


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


def _timed_line(i, n, point, us) -> str:
    pred = point.plan.predicted_us
    return (f"[{i + 1:4d}/{n}] {point.shape:<30} {point.label:<34} {us:10.2f} us"
            f"   (prior {pred:9.2f})")


def run(args) -> int:
    if args.device is not None:
        error = _select_device(args.device)
        if error:
            return A.refuse("calibrate", error)
    if args.base is not None and args.kv_dtype is None:
        return A.refuse("calibrate", "--base is the profile an fp8 fit is added to: give "
                                     "--kv-dtype too")
    if args.graph_stable and args.kv_dtype is None:
        return A.refuse("calibrate", "--graph-stable fits the model graph-stable fp8 wrappers "
                                     "plan with: give --kv-dtype too")
    try:
        from ..runtime import device_info, gpu_available
    except ImportError as exc:
        return A.unavailable("calibrate", f"the GPU runtime cannot be imported ({exc})")
    ok, why = gpu_available()
    if not ok and args.device is not None:      # the device asked for is not there
        return A.refuse("calibrate", f"--device {args.device}: no such CUDA GPU here ({why})")
    if not ok:
        return A.unavailable("calibrate", f"needs a CUDA GPU to measure on ({why}). Without one, "
                                     "splitkv plans with its shipped profiles or a roofline prior.")

    from ..calibration.calibrate import calibrate, profile_path, save, sweep_for
    from ..calibration.in_use import describe_origin, previous_profile, profile_in_use
    from ..calibration.progress import Progress
    from ..calibration.summary import plan_changes, summary_table
    from ..calibration.sweep import MeasurementLog

    info = device_info()
    base = None
    if args.kv_dtype:
        from ..planner.profile_lookup import load_profile
        from ..planner.profiles import ProfileError

        try:
            base = load_profile(path=args.base, device_name=info["name"],
                                num_sms=info["num_sms"])
        except ProfileError as exc:
            return A.refuse("calibrate", str(exc))
        previous, previous_where = base, describe_origin(base.origin, info["name"])
    else:
        # read before the new profile may overwrite it in the user cache
        previous, previous_where = previous_profile(info["name"], info["num_sms"])
    points = sweep_for(info, args.quick, args.seed)
    shapes = len({p.shape for p in points})
    over = f" over {args.kv_dtype} K/V, for {base.origin}" if base else ""
    over += ", 4-warp CTAs (graph-stable wrappers)" if args.graph_stable else ""
    print(f"calibrating {info['name']} ({info['num_sms']} SMs): {len(points)} plans of "
          f"{shapes} shapes ({'quick' if args.quick else 'full'} sweep){over}", flush=True)
    # every measurement as it is taken, so a sweep cut off before its fit keeps what it timed
    partial = profile_path(info["name"], args.out).with_suffix(".partial.csv")
    partial.parent.mkdir(parents=True, exist_ok=True)
    log = MeasurementLog(partial)
    print(f"measurements so far: {partial} (removed once the fit is written)", flush=True)

    bar = Progress(len(points), sys.stderr, label="calibrating", unit="plans",
                   enabled=not args.quiet)

    def progress(i, n, point, us):
        log.append(point, us)
        if args.verbose:
            bar.write(_timed_line(i, n, point, us), sys.stdout)
        bar.advance(note=f"{point.shape}: {point.label}")

    try:
        with bar:
            profile, report, measurements = calibrate(
                points, info, quick=args.quick, seed=args.seed, trials=args.trials,
                min_trial_ms=args.min_trial_ms, progress=progress, kv_dtype=args.kv_dtype,
                graph_stable=args.graph_stable)
    finally:
        log.close()
    fitted = profile
    if base is not None:
        profile = base.with_kv_fp8(fitted, graph_stable=args.graph_stable)
    out, csv_path = save(profile, measurements, args.out, kv_dtype=args.kv_dtype,
                         graph_stable=args.graph_stable)
    partial.unlink(missing_ok=True)

    print()
    for line in report.lines():
        print(line)
    worst = sorted(report.decisions, key=lambda d: d.regret, reverse=True)[:3]
    for d in worst:
        if d.regret > 0:
            print(f"  {d.shape}: picks {d.chosen} ({d.chosen_us:.2f} us), best measured "
                  f"{d.best} ({d.best_us:.2f} us)")
    print("parameters: " + ", ".join(f"{k}={v:.3g}" for k, v in fitted.coef.items()))
    print(f"best decode bandwidth measured: {fitted.measured_bandwidth_gbps:,.0f} GB/s"
          + (" (of one-byte codes)" if base else ""))
    print()
    caches = ""
    if base is not None:
        caches = f" for {args.kv_dtype} caches" + (" in graph-stable wrappers"
                                                  if args.graph_stable else "")
    print(f"plans of the standard cases{caches}, previous: {previous_where}")
    changes = plan_changes(previous, profile, info["num_sms"], kv_dtype=args.kv_dtype,
                           graph_stable=args.graph_stable)
    for line in summary_table(changes):
        print("  " + line)
    print()
    print(f"profile written to {out} (measurements in {csv_path})")
    if args.plot:
        from ..calibration.plots import write_plots

        # the fit these measurements made (fp8's, or the graph-stable one), not the profile's
        # 16-bit model; named as the CSV beside it
        stem = csv_path.name[:-len(".csv")]
        for line in write_plots(out.parent, stem, measurements, fitted, report):
            print(line)
    # last, so that it is what one reads: whether the profile just written will be used
    in_use = profile_in_use(out, info["name"], info["num_sms"])
    sys.stdout.flush()                  # a warning on stderr comes after the lines above
    for line in in_use.lines():
        print(line, file=sys.stdout if in_use.ok else sys.stderr)
    return 0
