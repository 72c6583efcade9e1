"""Offline planner evaluation with the library's own choose_plan (no GPU): for each of the 68
shapes of results/h200-planner.json, the plan a profile's model chooses is matched to a measured
candidate of the same strategy and chunk boundaries; its measured time over the best measured
candidate is the ratio. A choice that no candidate measured is reported as such, not scored.

    PYTHONPATH=$PWD python3 benchmarks/offline/s13_choose_plan_eval.py PROFILE.yaml [...]
"""
import sys

import numpy as np

from common import same_plan
from s13_common import load_eval
from splitkv.planner import choose_plan
from splitkv.planner.profiles import load_profile


def evaluate(path, shapes):
    model = load_profile(path=path).cost_model(None)
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
            worst.append(f"{s.name} {hit[0].label}@{hit[0].chunk} {r:.3f}")
    r = np.array(ratios)
    print(f"{path}: scored {r.size} of {len(shapes)}; within 5%: {np.mean(r <= 1.05):.1%} "
          f"({int(np.sum(r <= 1.05))}); geomean {np.exp(np.mean(np.log(r))):.4f}; "
          f"worst {r.max():.3f}")
    for w in worst:
        print("   over 5%:", w)
    for u in unmeasured:
        print("   not measured:", u)


if __name__ == "__main__":
    shapes = load_eval()
    for path in sys.argv[1:]:
        evaluate(path, shapes)
