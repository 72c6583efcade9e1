"""Refit the H200 profile from a recorded calibration sweep (no GPU needed), e.g. after the
cost model gains a feature. The sweep's plans are rebuilt exactly (same prior ranking and seed)
and matched row by row with the measurements in the CSV that `splitkv calibrate` wrote.

    python3 benchmarks/refit_profile.py benchmarks/results/calibration/nvidia-h200.csv OUT.yaml
"""

import csv
import sys

from splitkv.calibration.fit import fit_profile
from splitkv.calibration.sweep import Measurement, sweep_shapes
from splitkv.planner.planner import CHUNK_TOKENS, NO_SPLIT, NUM_SPLITS, Candidate


def candidate_from_label(label: str) -> Candidate:
    """'no split', 'no split fused', 'chunk tokens 512 fused', 'num splits 16 split_merge'."""
    for kind in (NO_SPLIT, CHUNK_TOKENS, NUM_SPLITS):
        if label.startswith(kind):
            rest = label[len(kind):].split()
            value = int(rest.pop(0)) if kind != NO_SPLIT else 1
            strategy = rest[0] if rest else "single"
            return Candidate(kind, value, strategy, 0.0)
    raise ValueError(f"unknown plan label {label!r}")


csv_path, out = sys.argv[1], sys.argv[2]
shapes = {s.name: s.problem for s in sweep_shapes(False, 0)}
measurements = []
for r in csv.DictReader(open(csv_path)):
    plan = candidate_from_label(r["plan"]).build(shapes[r["shape"]])
    assert plan.num_chunks == int(r["num_chunks"]), r
    measurements.append(Measurement(r["shape"], r["plan"], plan, float(r["measured_us"])))
profile, report = fit_profile(measurements, {"name": "NVIDIA H200", "num_sms": 132},
                              sweep={"name": "full", "seed": 0,
                                     "timing": {"trials": 3, "min_trial_ms": 10.0},
                                     "refit_from": csv_path})
profile.save(out)
print("\n".join(report.lines()))
print({k: round(v, 4) for k, v in profile.coef.items()})
