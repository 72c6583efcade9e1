"""Q2: slots per SM by head_dim (64: 3, 128: 2, 256: 1) and 1 for 16-bit plans that run
8-warp CTAs (runtime.features.plan_warps), in an offline copy of the features (per-plan
ctas_per_sm through cost_model.plan_features; the library is not edited). Each variant is
refitted with the library's CostModel.fit and the planner's choices re-made (the planner's
own candidate list, rescored per plan).

Variants (slots, lone_cta_us):
  base         2 everywhere                   library lone_cta_us
  hd           by head_dim                    library
  hd8w         by head_dim, 1 for 8-warp      library
  hd8w-no8w    by head_dim, 1 for 8-warp      0 for 8-warp plans
  hd8w-res1    by head_dim, 1 for 8-warp      0 for 8-warp; head_dim 256 plans always 'lone'

    cd /work/main && PYTHONPATH=. python3 benchmarks/offline/q2_residency.py
"""
import numpy as np

from common import (calibration_measurements, evaluate, features, fit, fmt, load_set, summary)

VARIANTS = {"base": ("base", "lib"), "hd": ("hd", "lib"), "hd8w": ("hd8w", "lib"),
            "hd8w-no8w": ("hd8w", "no8w"), "hd8w-res1": ("hd8w", "res1")}


def mdape(model, pairs):
    x = np.array([p for p, _ in pairs]); y = np.array([t for _, t in pairs])
    return float(np.median(np.abs(x @ model.coef_ / y - 1)))


def main():
    std, cls = load_set("standard"), load_set("classes")
    cal = calibration_measurements()
    for vname, (v, lone) in VARIANTS.items():
        xs = lambda shapes: [(features(c.plan, v, lone), c.us) for s in shapes for c in s.cands]
        xc = [(features(p, v, lone), us) for _, p, us in cal]
        sets = {"standard": xs(std), "classes": xs(cls), "calib": xc}
        print(f"##### variant {vname}")
        for train in ("standard", "classes", "calib+standard", "calib"):
            pairs = sum((sets[t] for t in train.split("+")), [])
            m = fit(pairs)
            ins = ", ".join(f"{k} {mdape(m, sets[k]):.1%}" for k in sets)
            print(f"== fit:{train}  MdAPE {ins}")
            print("   coef " + ", ".join(f"{k}={val:.3g}" for k, val in m.coef_dict().items()
                                         if val))
            for name, shapes in (("standard", std), ("classes", cls)):
                print(f"   on {name:8s}: {fmt(summary(evaluate(shapes, m, v, lone)))}")


if __name__ == "__main__":
    main()
