"""Q1: refit the cost model (library features, CostModel.fit as fit_profile uses it, H200
hyperparameters incl. clusters) on one eval set's measured candidates and score the planner's
choices on the other set, against the shipped profile.

    cd /work/main && PYTHONPATH=. python3 benchmarks/offline/q1_refit_crossset.py
"""
import numpy as np

from common import (calibration_measurements, evaluate, features, fit, fmt, load_set,
                    shipped_model, summary)


def xy(shapes):
    return [(features(c.plan), c.us) for s in shapes for c in s.cands]


def in_sample(model, shapes):
    pairs = xy(shapes)
    x = np.array([p for p, _ in pairs]); y = np.array([t for _, t in pairs])
    return float(np.median(np.abs(x @ model.coef_ / y - 1)))


def main():
    std, cls = load_set("standard"), load_set("classes")
    cal = [(features(p), us) for _, p, us in calibration_measurements()]
    models = {"shipped": shipped_model(),
              "fit:standard": fit(xy(std)),
              "fit:classes": fit(xy(cls)),
              "fit:calib+standard": fit(cal + xy(std)),
              "fit:calib (=shipped refit)": fit(cal)}
    for name, m in models.items():
        print(f"== {name}: in-sample MdAPE standard {in_sample(m, std):.1%}, classes "
              f"{in_sample(m, cls):.1%}")
        print("   coef " + ", ".join(f"{k}={v:.3g}" for k, v in m.coef_dict().items()))
        for set_name, shapes in (("standard", std), ("classes", cls)):
            rows = evaluate(shapes, m)
            print(f"   on {set_name:8s}: {fmt(summary(rows))}")
            hows = [r["how"] for r in rows if r["how"] != "exact"]
            if hows:
                print(f"      stand-ins: {hows}")


if __name__ == "__main__":
    main()
