"""The variants refitted without the sweep's head_dim 64 rows (timed on the 3-an-SM build while
the model now counts 4 slots an SM there), scored on the 68 eval shapes.

    cd /work/main && python3 benchmarks/offline/s13_no_d64.py
"""
from s13_common import fit_report, load_eval, score_eval
from s13_variants import features

shapes = load_eval()
no64 = lambda r: r[1].problem.head_dim == 64
for v in ["lib", "fluidc", "mgrid", "fluidc+mgrid", "fluidc+soft", "fluidc+soft+mgrid"]:
    f = lambda p, v=v: features(p, v)
    fr = fit_report(f, exclude=no64)
    _, s = score_eval(shapes, f, fr["coef"])
    print(f"no-d64 fit {v:18s}: RMS {fr['rms']:.2%} (n {fr['n']}) held-out mean {fr['held_mape']:.2%}"
          f" | eval within5 {s['within5']:.1%} geomean {s['geomean']:.4f} worst {s['worst']:.3f}")
