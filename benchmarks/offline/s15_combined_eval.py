"""Session 15: the planner evaluation of a new profile from a whole evaluation under the old
one plus a device re-run of just the shapes whose choice moved (eval_planner.py --only). Every
other shape's choice is checked to be the same plan under both profiles, so its recorded ratio
stands; a moved shape's ratio is the re-run's (plan and oracle timed in one run).

    PYTHONPATH=$PWD python3 benchmarks/offline/s15_combined_eval.py
"""
import json

import numpy as np

import s13_common as C
from common import same_plan
from splitkv.planner import choose_plan
from splitkv.planner.profiles import load_profile

NEW = C.ROOT / "splitkv" / "planner" / "profiles" / "nvidia-h200.yaml"
RUNS = [("16-bit", "h200-planner.json", "calibration/nvidia-h200-s15.yaml",
         "h200-planner-moved-s15.json"),
        ("fp8", "h200-planner-fp8.json", "calibration/nvidia-h200-fp8-s15.yaml",
         "h200-planner-fp8-moved-s15.json")]


def combined(whole, old_profile, moved):
    shapes, kv = C.load_eval_json(C.RESULTS / whole, C.RESULTS / old_profile)
    new = load_profile(path=NEW).cost_model(kv)
    rerun = {r["shape"]: r for r in json.load(open(C.RESULTS / moved))["shapes"]}
    recorded = {r["shape"]: r for r in json.load(open(C.RESULTS / whole))["shapes"]}
    ratios, misses = {}, []
    for s in shapes:
        planner = next(c for c in s.cands if c.chunk == "planner")
        if s.name in rerun:
            r = rerun[s.name]
        else:
            assert same_plan(choose_plan(s.problem, new), planner.plan), \
                f"{s.name}: the new profile moves it, but it was not re-run"
            r = recorded[s.name]
        ratios[s.name] = r["plan_us"] / r["oracle_us"]
        if ratios[s.name] > 1.05:
            misses.append(f"{s.name} {r['plan']} {r['plan_us']} us vs {r['oracle_plan']} "
                          f"{r['oracle_us']} ({ratios[s.name]:.3f})")
    v = np.array(list(ratios.values()))
    return v, misses, len(rerun)


if __name__ == "__main__":
    for name, whole, old, moved in RUNS:
        v, misses, n = combined(whole, old, moved)
        print(f"{name}: {v.size} shapes ({n} re-run): within 5% {np.mean(v <= 1.05):.1%} "
              f"({int(np.sum(v <= 1.05))}), geomean {np.exp(np.mean(np.log(v))):.4f}")
        for m in misses:
            print("   over 5%:", m)
