"""Refit the H200 profile from recorded calibration sweeps (no GPU needed), e.g. after the
cost model gains a feature. Plans are rebuilt from the CSVs that `splitkv calibrate` wrote.

    # the 16-bit fit alone
    C=benchmarks/results/calibration
    PYTHONPATH=$PWD python3 benchmarks/refit_profile.py $C/nvidia-h200.csv OUT.yaml
    # and the fp8 fits beside it (kv_fp8, kv_fp8_graph_stable), as a profile ships them
    PYTHONPATH=$PWD python3 benchmarks/refit_profile.py $C/nvidia-h200.csv OUT.yaml \
        --fp8 $C/nvidia-h200.fp8.csv --fp8-graph-stable $C/nvidia-h200.fp8-graph-stable.csv

An fp8 fit not named stays the one ``--like`` has (by default the shipped profile). Each refit
keeps the sweep record (name, seed, timing) of the fit it replaces there and adds the CSV it
was refitted from.
"""

import argparse
from dataclasses import replace
from pathlib import Path

from splitkv.calibration.fit import fit_profile, fit_tile_rule
from splitkv.calibration.sweep import read_measurements
from splitkv.planner.profile_lookup import load_profile

DEVICE = {"name": "NVIDIA H200", "num_sms": 132, "cc": "90"}
SHIPPED = Path(__file__).resolve().parents[1] / "splitkv/planner/profiles/nvidia-h200.yaml"


def refit(csv_path, like_sweep: dict, fp8: bool, graph_stable: bool = False):
    measurements = read_measurements(csv_path, quick=False, seed=0)
    sweep = {**(like_sweep or {}), "refit_from": str(csv_path)}
    sweep.pop("points", None)
    sweep.pop("shapes", None)
    sweep.pop("heldout_shapes", None)
    profile, report = fit_profile(measurements, DEVICE, sweep=sweep,
                                  kv_bytes_per_element=1 if fp8 else 2,
                                  tile_rule=fit_tile_rule("fp8" if fp8 else None, graph_stable))
    return profile, report


def show(what, profile, report):
    print(f"== {what}")
    print("\n".join(report.lines()[:3]))
    print({k: round(v, 4) for k, v in profile.coef.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="the 16-bit sweep's CSV")
    ap.add_argument("out", help="the profile to write")
    ap.add_argument("--fp8", help="the fp8 sweep's CSV: refit kv_fp8 too")
    ap.add_argument("--fp8-graph-stable", help="the graph-stable fp8 sweep's CSV: refit "
                                               "kv_fp8_graph_stable too")
    ap.add_argument("--like", default=SHIPPED, help="the profile whose sweeps' records the "
                                                    "refits keep (default: the shipped one)")
    args = ap.parse_args()
    like = load_profile(path=args.like)
    profile, report = refit(args.csv, like.sweep, fp8=False)
    show("16-bit", profile, report)
    # the fp8 fits not refitted stay what --like has
    profile = replace(profile, kv_fp8=like.kv_fp8, kv_fp8_graph_stable=like.kv_fp8_graph_stable)
    for path, graph_stable, old in ((args.fp8, False, like.kv_fp8),
                                    (args.fp8_graph_stable, True, like.kv_fp8_graph_stable)):
        if path:
            fit, rep = refit(path, (old or {}).get("sweep"), fp8=True, graph_stable=graph_stable)
            show("fp8 graph-stable" if graph_stable else "fp8", fit, rep)
            profile = profile.with_kv_fp8(fit, graph_stable=graph_stable)
    profile.save(args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
