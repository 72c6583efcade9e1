"""Refit the H200 profile from a recorded calibration sweep (no GPU needed), e.g. after the
cost model gains a feature. Plans are rebuilt from the CSV that `splitkv calibrate` wrote.

    PYTHONPATH=$PWD python3 benchmarks/refit_profile.py benchmarks/results/calibration/nvidia-h200.csv OUT.yaml
"""

import sys

from splitkv.calibration.fit import fit_profile
from splitkv.calibration.sweep import read_measurements

csv_path, out = sys.argv[1], sys.argv[2]
measurements = read_measurements(csv_path, quick=False, seed=0)
profile, report = fit_profile(measurements, {"name": "NVIDIA H200", "num_sms": 132, "cc": "90"},
                              sweep={"name": "full", "seed": 0,
                                     "timing": {"trials": 3, "min_trial_ms": 10.0},
                                     "refit_from": csv_path})
profile.save(out)
print("\n".join(report.lines()))
print({k: round(v, 4) for k, v in profile.coef.items()})
