"""Robustness check on a second measurement of the same 68 shapes: session 12's planner
evaluations (h200-planner-standard-s12.json, h200-planner-classes.json, dee7c27: older builds,
head_dim 64 at 3 CTAs an SM). Only the grid and 'single' candidates (the 'planner' candidate
was session 12's own pick and cannot be rebuilt now). Coefficients: each variant refitted on
the session-13 sweep, as in s13_evaluate.py. The same grid-only scoring is printed for the
session-13 evaluation.

    cd /work/main && python3 benchmarks/offline/s13_s12check.py [variant ...]
"""
import sys

import numpy as np

from s13_common import RESULTS, fit_report, load_eval, load_eval_json
from s13_variants import features


def load_json(path):
    """The grid and 'single' candidates of an older eval JSON (its planner's profile is gone)."""
    return load_eval_json(path, None)[0]


def score(shapes, f, coef):
    r = []
    for s in shapes:
        pred = np.array([f(c.plan) for c in s.cands]) @ coef
        r.append(s.cands[int(np.argmin(pred))].us / s.best_us)
    r = np.array(r)
    return float(np.mean(r <= 1.05)), float(np.exp(np.mean(np.log(r)))), r


s12 = (load_json(RESULTS / "h200-planner-standard-s12.json")
       + load_json(RESULTS / "h200-planner-classes.json"))
s13 = load_eval()
for s in s13:
    s.cands = [c for c in s.cands if c.chunk != "planner"]
variants = sys.argv[1:] or ["lib", "fluidc", "mgrid", "fluidc+mgrid", "fluidc+soft",
                            "fluidc+soft+mgrid", "tailx", "soft+tailx+mgrid"]
base = None
for v in variants:
    f = lambda p, v=v: features(p, v)
    coef = fit_report(f)["coef"]
    w12, g12, r12 = score(s12, f, coef)
    w13, g13, r13 = score(s13, f, coef)
    if base is None:
        base = (r12, r13)
    better12 = int(np.sum(r12 < base[0] - 1e-9)); worse12 = int(np.sum(r12 > base[0] + 1e-9))
    print(f"{v:22s} s12 measurement (grid+single): within5 {w12:.1%} geomean {g12:.4f} "
          f"(vs lib: {better12} better, {worse12} worse) | s13 (grid+single): within5 {w13:.1%} "
          f"geomean {g13:.4f}")
