"""Reproduce the session-13 baseline offline: the shipped profile's picks among the measured
candidates (and the JSON's predicted_us), then a refit of the library's features on the sweep.

    cd /work/main && python3 benchmarks/offline/s13_baseline.py
"""
import numpy as np
from s13_common import (fit_report, lib_features, load_eval, score_eval, shipped_model, label)

shapes = load_eval()
m = shipped_model()
# the JSON's predictions reproduce?
d = max(abs(float(lib_features(c.plan) @ m.coef_) - c.pred_json) / c.pred_json
        for s in shapes for c in s.cands)
print(f"max rel diff of recomputed predictions vs JSON predicted_us: {d:.2e}")
rows, summ = score_eval(shapes, lib_features, m.coef_)
print("shipped coef, argmin over measured:", summ)
for r in sorted(rows, key=lambda r: -r["ratio"])[:10]:
    s = next(x for x in shapes if x.name == r["shape"])
    b = min(s.cands, key=lambda c: c.us)
    print(f"  {r['shape']:28s} {r['ratio']:.3f} pick {label(r['pick'])} {r['pick'].us:.2f} "
          f"(pred {r['pick'].pred_json:.2f}) best {label(b)} {b.us:.2f} (pred {b.pred_json:.2f})")
fr = fit_report(lib_features)
print({k: v for k, v in fr.items() if not k.startswith("coef")})
print("refit coef:", np.round(fr["coef"], 4))
print("shipped   :", np.round(m.coef_, 4))
rows, summ = score_eval(shapes, lib_features, fr["coef"])
print("refit (all sweep) argmin over measured:", summ)
