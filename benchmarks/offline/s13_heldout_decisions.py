"""Per held-out sweep shape: the pick's regret (fit on the sweep's training shapes only), per
variant.   cd /work/main && python3 benchmarks/offline/s13_heldout_decisions.py lib fluidc ..."""
import sys
import numpy as np
from s13_common import fit_xy, sweep
from s13_variants import features

allm, train, held = sweep()
shapes = sorted({s for s, _, _ in held})
res = {}
for v in sys.argv[1:]:
    f = lambda p: features(p, v)
    c = fit_xy(np.array([f(p) for _, p, _ in train]), np.array([u for _, _, u in train]))
    xh = np.array([f(p) for _, p, _ in held]); yh = np.array([u for _, _, u in held])
    ph = xh @ c
    out = {}
    for s in shapes:
        idx = [i for i, r in enumerate(held) if r[0] == s]
        pick = idx[int(np.argmin(ph[idx]))]
        out[s] = (yh[pick] / yh[idx].min(), held[pick][1].strategy, held[pick][1].num_chunks)
    res[v] = out
print(f"{'shape':30s}" + "".join(f"{v:>22s}" for v in res))
for s in shapes:
    row = [res[v][s] for v in res]
    if any(r[0] > 1.0 for r in row):
        print(f"{s:30s}" + "".join(f"{r[0]:8.3f} {r[1][:6]:>6s}/{r[2]:<5d}" for r in row))
print(f"{'mean regret':30s}" + "".join(f"{np.mean([res[v][s][0] - 1 for s in shapes]):>22.2%}" for v in res))
print(f"{'within 5%':30s}" + "".join(f"{np.mean([res[v][s][0] <= 1.05 for s in shapes]):>22.0%}" for v in res))
