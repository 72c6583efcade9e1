"""Q2, held out by shape within the class set: for each of the 24 class shapes, fit on the
standard set plus the other 23 class shapes (all measured 2026-12-01 on the same kernel) and
score the planner's choice on the one left out. Variants as q2_residency.py, plus 'hd8w-ext':
slots by head_dim and 1 for 8-warp plans, and an extra column holding the crit_tiles of 8-warp
plans (their own per-tile cost; lone_cta_us 0 for them), fitted with CostModel.fit's arithmetic; '+mrows': one more column, the merge kernel's rows
(it covers every request of a split_merge batch).

    cd /work/main && PYTHONPATH=. python3 benchmarks/offline/q2_loso.py
"""
import numpy as np

from common import evaluate, features, fit, fmt, load_set, summary

VARIANTS = {"base": ("base", "lib"), "hd": ("hd", "lib"), "hd8w": ("hd8w", "lib"),
            "hd8w-no8w": ("hd8w", "no8w"), "hd8w-ext": ("hd8w", "ext8w"),
            "base+mrows": ("base", "lib+mrows"), "hd8w-no8w+mrows": ("hd8w", "no8w+mrows")}


def main():
    std, cls = load_set("standard"), load_set("classes")
    for name, (v, lone) in VARIANTS.items():
        fx = lambda shapes: [(features(c.plan, v, lone), c.us) for s in shapes for c in s.cands]
        base_pairs = fx(std)
        per_shape = [fx([s]) for s in cls]
        rows = []
        for i, s in enumerate(cls):
            train = base_pairs + sum((per_shape[j] for j in range(len(cls)) if j != i), [])
            rows += evaluate([s], fit(train), v, lone)
        full = fit(base_pairs + sum(per_shape, []))
        ape = lambda pairs: float(np.median([abs(f @ full.coef_ / t - 1) for f, t in pairs]))
        print(f"{name:10s} LOSO classes: {fmt(summary(rows))}")
        bad = [(r['shape'], r['plan'], r['chunks'], None if r['ratio'] is None else round(r['ratio'], 3),
                r['how']) for r in rows if r['ratio'] is None or r['ratio'] > 1.05 or r['how'] != 'exact']
        print(f"           misses/stand-ins: {bad}")
        print(f"           fit on all 68 shapes: in-sample MdAPE standard {ape(base_pairs):.1%}, "
              f"classes {ape(sum(per_shape, [])):.1%}")


if __name__ == "__main__":
    main()
