"""Q3: which class shapes the planner gets most wrong, and where the model's error sits:
per shape, the chosen and the best measured plan with measured and predicted times; per class,
the signed median error of the model over the measured candidates, and over the 'single' plan
and the split plans apart.

    cd /work/main && PYTHONPATH=. python3 benchmarks/offline/q3_worst_shapes.py
"""
import numpy as np

from common import evaluate, features, fit, load_set, planner_choice, score, shipped_model
from q1_refit_crossset import xy


def report(name, shapes, model, variant="base", lone="lib"):
    print(f"==== {name}")
    rows = evaluate(shapes, model, variant, lone)
    for s, r in sorted(zip(shapes, rows), key=lambda t: -(t[1]["ratio"] or 0)):
        if (r["ratio"] or 0) < 1.03:
            continue
        best = min(s.cands, key=lambda c: c.us)
        p = planner_choice(s.problem, model, variant, lone)
        pred = lambda plan: float(features(plan, variant, lone) @ model.coef_)
        us, _ = score(s, p)
        print(f"  {s.name:32s} ratio {r['ratio']:.3f}: chose {r['plan']:>15}({p.num_chunks:4d} ch,"
              f" max {int((p.chunk_end - p.chunk_start).max()):5d} tok) {us:7.2f} us pred "
              f"{pred(p):7.2f} | best {best.label:>15}({best.plan.num_chunks:4d} ch, chunk "
              f"{best.chunk}) {best.us:7.2f} us pred {pred(best.plan):7.2f}")
    by = {}
    for s in shapes:
        for c in s.cands:
            e = float(features(c.plan, variant, lone) @ model.coef_) / c.us - 1
            by.setdefault(s.cls, {"all": [], "single": [], "split": []})
            by[s.cls]["all"].append(e)
            by[s.cls]["single" if c.plan.num_splits == 1 else "split"].append(e)
    print("  signed median (pred/measured - 1) by class: all | single | split")
    for k, d in by.items():
        print(f"    {k:9s} {np.median(d['all']):+6.1%} | {np.median(d['single']):+6.1%} |"
              f" {np.median(d['split']):+6.1%}   (n={len(d['all'])})")


def main():
    std, cls = load_set("standard"), load_set("classes")
    report("shipped profile, class shapes", cls, shipped_model())
    report("refit on standard, class shapes", cls, fit(xy(std)))


if __name__ == "__main__":
    main()
