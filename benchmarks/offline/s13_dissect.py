"""Per-candidate feature contributions (shipped coefficients) for the worst-missed shapes.

    cd /work/main && python3 benchmarks/offline/s13_dissect.py [shape ...]
"""
import sys
import numpy as np
from s13_common import lib_features, load_eval, shipped_model, label

names = sys.argv[1:] or ["r256_n907_g5_hk2", "r192_n322_g2_hk2", "r2_n12414_g8_hk4",
                         "b8_n757_g5_hk4", "page1_b8_n2243_h32/8"]
shapes = {s.name: s for s in load_eval()}
m = shipped_model()
short = ["cst", "lau", "kv", "crit", "tile", "trow", "wav", "part", "ftail", "fmrg", "mchn",
         "tail", "clus", "lone"]
for n in names:
    s = shapes[n]
    p = s.problem
    lens = p.kv_lens
    print(f"==== {n}: batch {p.batch_size} hq {p.num_qo_heads} hk {p.num_kv_heads} d {p.head_dim}"
          f" page {p.page_size} lens min {lens.min()} med {int(np.median(lens))} max {lens.max()}"
          f" sum {lens.sum()}")
    print(f"{'cand':24s} {'ch':>5s} {'maxc':>5s} {'merge':>7s} {'us':>7s} {'pred':>7s} {'err':>6s} | "
          + " ".join(f"{k:>5s}" for k in short))
    for c in sorted(s.cands, key=lambda c: c.us):
        x = lib_features(c.plan)
        contrib = x * m.coef_
        pred = contrib.sum()
        mx = int((c.plan.chunk_end - c.plan.chunk_start).max())
        print(f"{label(c):24s} {c.plan.num_chunks:5d} {mx:5d} {c.plan.merge[:7]:>7s} {c.us:7.2f} "
              f"{pred:7.2f} {pred / c.us - 1:+6.1%} | " + " ".join(f"{v:5.2f}" for v in contrib))
