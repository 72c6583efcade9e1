"""Q2 detail: per class shape, the planner's choice under base and head_dim slots for one fit;
and the model's signed error by class and by wave count (d64/d256), base vs 'hd'.

    cd /work/main && PYTHONPATH=. python3 benchmarks/offline/q2_detail.py
"""
import numpy as np

from common import calibration_measurements, evaluate, features, fit, load_set


def main():
    std, cls = load_set("standard"), load_set("classes")
    cal = calibration_measurements()
    for train in ("standard", "calib+standard", "calib"):
        res = {}
        for v in ("base", "hd"):
            pairs = []
            if "standard" in train:
                pairs += [(features(c.plan, v), c.us) for s in std for c in s.cands]
            if "calib" in train:
                pairs += [(features(p, v), us) for _, p, us in cal]
            m = fit(pairs)
            res[v] = (m, evaluate(cls, m, v))
        print(f"==== fit:{train}: class shapes whose choice or score differs (base -> hd)")
        for s, a, b in zip(cls, res["base"][1], res["hd"][1]):
            if a["plan"] != b["plan"] or a["chunks"] != b["chunks"] or a["ratio"] != b["ratio"]:
                fr = lambda r: "n/a" if r is None else f"{r:.3f}"
                print(f"  {s.name:32s} {a['plan']:>15}/{a['chunks']:<5d} {fr(a['ratio'])} ({a['how']})"
                      f" -> {b['plan']:>15}/{b['chunks']:<5d} {fr(b['ratio'])} ({b['how']})")
        print("  signed median error on d64 / d256 candidates, by waves under 2 slots/SM:")
        for v in ("base", "hd"):
            m = res[v][0]
            for d in (64, 256):
                buckets = {"1": [], "2-4": [], "5+": []}
                for s in cls:
                    if s.problem.head_dim != d:
                        continue
                    for c in s.cands:
                        w = features(c.plan, "base")[6]
                        e = float(features(c.plan, v) @ m.coef_) / c.us - 1
                        buckets["1" if w <= 1 else "2-4" if w <= 4 else "5+"].append(e)
                txt = "  ".join(f"w{k}: {np.median(e):+.1%} (n={len(e)})" for k, e in buckets.items() if e)
                print(f"    {v:4s} d{d}: {txt}")


if __name__ == "__main__":
    main()
