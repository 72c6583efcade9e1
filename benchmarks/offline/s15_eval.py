"""Offline planner evaluation of any eval_planner.py JSON (16-bit or fp8) with the library's
choose_plan: each profile's choice is matched to a measured candidate of the same strategy and
chunk boundaries and scored by its measured time over the best measured candidate. The
'planner' candidate is rebuilt with ``--eval-profile`` (the profile the device run planned
with), so its measured time can score another profile that picks the same plan.

    PYTHONPATH=$PWD python3 benchmarks/offline/s15_eval.py --json results/h200-planner-fp8.json \
        --eval-profile results/calibration/nvidia-h200-fp8-s15.yaml PROFILE.yaml [...]
"""
import argparse

import numpy as np

from common import same_plan
from s13_common import load_eval_json as load     # (shapes, kv dtype) of an eval JSON
from splitkv.planner import choose_plan
from splitkv.planner.profiles import load_profile


def evaluate(path, shapes, kv_dtype, verbose=True):
    model = load_profile(path=path).cost_model(kv_dtype)
    ratios, unmeasured, worst = [], [], []
    for s in shapes:
        plan = choose_plan(s.problem, model)
        hit = [c for c in s.cands if same_plan(c.plan, plan)]
        if not hit:
            unmeasured.append(f"{s.name}: {plan.strategy}/{plan.num_splits}")
            continue
        r = hit[0].us / s.best_us
        ratios.append(r)
        if r > 1.05:
            best = min(s.cands, key=lambda c: c.us)
            worst.append(f"{s.name} {hit[0].label}@{hit[0].chunk} {r:.3f} (best {best.label}"
                         f"@{best.chunk})")
    r = np.array(ratios)
    print(f"{path}: scored {r.size} of {len(shapes)}; within 5%: {np.mean(r <= 1.05):.1%} "
          f"({int(np.sum(r <= 1.05))}); geomean {np.exp(np.mean(np.log(r))):.4f}; "
          f"worst {r.max():.3f}")
    if verbose:
        for w in worst:
            print("   over 5%:", w)
        for u in unmeasured:
            print("   not measured:", u)
    return r


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--eval-profile", required=True)
    ap.add_argument("profiles", nargs="+")
    args = ap.parse_args()
    shapes, kv_dtype = load(args.json, args.eval_profile)
    for path in args.profiles:
        evaluate(path, shapes, kv_dtype)
