"""Refit each feature variant on the sweep CSV (fit_profile's held-out split for the held-out
numbers; all 1,026 points for the coefficients) and score the 68 eval shapes: pick = argmin
predicted among the measured candidates.

    cd /work/main && python3 benchmarks/offline/s13_evaluate.py [variant ...]
"""
import sys

import numpy as np

from s13_common import fit_report, label, load_eval, score_eval
from s13_variants import features

VARIANTS = sys.argv[1:] or ["lib", "shared", "mgrid", "shared+mgrid", "sim"]
shapes = load_eval()
results = {}
for v in VARIANTS:
    f = lambda p, v=v: features(p, v)
    fr = fit_report(f)
    rows, summ = score_eval(shapes, f, fr["coef"])
    results[v] = (fr, rows, summ)
    print(f"=== {v}: fit RMS {fr['rms']:.2%} mean {fr['mape']:.2%} | held-out ({fr['n_held']} pts)"
          f" mean {fr['held_mape']:.2%} worst {fr['held_max']:.1%} held-out regret "
          f"{fr['held_regret']:.2%} within5 {fr['held_within5']:.0%} | eval within5 "
          f"{summ['within5']:.1%} geomean {summ['geomean']:.4f} worst {summ['worst']:.3f} "
          f"MdAPE {summ['mdape']:.1%}")
    print("    coef", np.round(fr["coef"], 4).tolist())
base = results.get("lib")
if base:
    b = {r["shape"]: r for r in base[1]}
    for v, (fr, rows, summ) in results.items():
        if v == "lib":
            continue
        ch = [(r["shape"], b[r["shape"]]["ratio"], r["ratio"], label(b[r["shape"]]["pick"]),
               label(r["pick"])) for r in rows if abs(r["ratio"] - b[r["shape"]]["ratio"]) > 1e-9]
        print(f"--- {v} vs lib: {len(ch)} shapes change pick")
        for s, r0, r1, p0, p1 in sorted(ch, key=lambda t: t[2] - t[1]):
            print(f"    {s:28s} {r0:.3f} -> {r1:.3f}  {p0} -> {p1}")
    print("--- misses (>5%) per variant")
    for v, (fr, rows, summ) in results.items():
        print(f"  {v}: " + ", ".join(f"{r['shape']} {r['ratio']:.3f}" for r in
                                    sorted(rows, key=lambda r: -r['ratio']) if r["ratio"] > 1.05))
