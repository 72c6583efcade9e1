"""split_merge against fused on a recorded sweep (no GPU): every cut timed both ways, the
measured difference beside a profile's predicted one. Session 14: the shipped model had the
sign right on 57% of 450 pairs, correlation 0.68 (NOTES.md).

    PYTHONPATH=$PWD python3 benchmarks/offline/s14_strategy_pairs.py [PROFILE.yaml] [SWEEP.csv] [-v]
"""
import collections
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from splitkv.calibration.sweep import read_measurements
from splitkv.planner.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]


def main(args):
    verbose = "-v" in args
    args = [a for a in args if a != "-v"]
    profile = args[0] if args else None
    csv = args[1] if len(args) > 1 else ROOT / "benchmarks/results/calibration/nvidia-h200.csv"
    model = load_profile(path=profile).cost_model() if profile else load_profile().cost_model()
    # as they ran: eligible fused plans merged in clusters (read_measurements rebuilds ticket
    # plans; fit_profile converts them the same way)
    measured = [replace(m, plan=m.plan.with_execution(clusters=model.clusters))
                for m in read_measurements(csv)]
    predicted = model.predict([m.plan for m in measured])
    pairs = collections.defaultdict(dict)
    for m, pred in zip(measured, predicted):
        if m.label != "no split":
            *cut, strategy = m.label.split()
            pairs[(m.shape, " ".join(cut))][strategy] = (m, pred)
    got, want = [], []
    for (shape, cut), d in sorted(pairs.items()):
        if {"split_merge", "fused"} <= set(d):
            (ms, ps), (mf, pf) = d["split_merge"], d["fused"]
            want.append(ms.measured_us - mf.measured_us)
            got.append(ps - pf)
            if verbose:
                print(f"{shape:28s} {cut:22s} batch {ms.plan.problem.batch_size:4d}  measured "
                      f"{want[-1]:7.2f}  predicted {got[-1]:7.2f}  fused merge {mf.plan.merge}")
    got, want = np.array(got), np.array(want)
    print(f"{got.size} pairs: measured split_merge - fused RMS {np.sqrt(np.mean(want ** 2)):.2f} us;"
          f" prediction error RMS {np.sqrt(np.mean((want - got) ** 2)):.2f} us, correlation "
          f"{np.corrcoef(want, got)[0, 1]:.2f}, sign right {np.mean(np.sign(want) == np.sign(got)):.0%}")


if __name__ == "__main__":
    main(sys.argv[1:])
