"""Choose the fluid closed form's lone-CTA rate r1 (and DRAM rate) on the SWEEP ONLY: fit RMS and
held-out error per value; the eval numbers are printed for information, not used to choose.

    cd /work/main && python3 benchmarks/offline/s13_r1_scan.py
"""
from s13_common import fit_report, load_eval, score_eval  # noqa: sets the path
import s13_variants as V

shapes = load_eval()
for bw in (4460e3, 4000e3):
    for r1 in (25e3, 30e3, 35e3, 40e3, 45e3, 50e3, 55e3, 60e3, 70e3, 80e3, 100e3):
        V.FLUID.update(r1=r1, bw=bw)
        f = lambda p: V.features(p, "fluidc")
        fr = fit_report(f)
        _, s = score_eval(shapes, f, fr["coef"])
        print(f"bw {bw/1e3:.0f} r1 {r1/1e3:4.0f} GB/s: fit RMS {fr['rms']:.3%} held-out mean "
              f"{fr['held_mape']:.3%} held-out regret {fr['held_regret']:.2%} crit_us coef "
              f"{fr['coef'][3]:.3f} | eval {s['within5']:.1%} {s['geomean']:.4f}")
