"""Do the variants hold on the fp8 sweep (nvidia-h200.fp8.csv)? Fit RMS and held-out error only
(no fp8 planner evaluation with every candidate exists).

    cd /work/main && python3 benchmarks/offline/s13_fp8_check.py
"""
import s13_common as C
import s13_variants as V

C.SWEEP_CSV = C.RESULTS / "calibration" / "nvidia-h200.fp8.csv"
for v, r1 in [("lib", 70e3), ("fluidc", 70e3), ("fluidc", 100e3), ("fluidc", 140e3),
              ("mgrid", 70e3), ("fluidc+mgrid", 70e3), ("fluidc+soft+mgrid", 70e3)]:
    V.FLUID["r1"] = r1
    fr = C.fit_report(lambda p: V.features(p, v))
    print(f"fp8 {v:18s} r1 {r1/1e3:4.0f}: fit RMS {fr['rms']:.2%} held-out mean {fr['held_mape']:.2%} "
          f"worst {fr['held_max']:.1%} held-out regret {fr['held_regret']:.2%} "
          f"within5 {fr['held_within5']:.0%} (n {fr['n']})")
