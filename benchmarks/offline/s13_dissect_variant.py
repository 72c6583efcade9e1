"""Predicted vs measured of the named shapes' candidates under refitted variants.
    cd /work/main && python3 benchmarks/offline/s13_dissect_variant.py SHAPE [SHAPE ...]"""
import sys
from s13_common import fit_report, label, load_eval
from s13_variants import features

names = sys.argv[1:] or ["r256_n907_g5_hk2", "r2_n12414_g8_hk4", "r192_n322_g2_hk2"]
vs = ["lib", "fluidc", "fluidc+mgrid"]
coefs = {v: fit_report(lambda p, v=v: features(p, v))["coef"] for v in vs}
shapes = {s.name: s for s in load_eval()}
for n in names:
    s = shapes[n]
    print(f"== {n}   (measured us | predicted: " + " / ".join(vs) + ")")
    for c in sorted(s.cands, key=lambda c: c.us)[:8]:
        print(f"  {label(c):24s} {c.us:7.2f} | " + " / ".join(
            f"{features(c.plan, v) @ coefs[v]:7.2f}" for v in vs))
