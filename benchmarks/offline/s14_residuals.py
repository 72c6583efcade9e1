"""Where a profile's fit misses on a recorded sweep (no GPU): measured over predicted, by
bucket (slots an SM, i.e. head_dim; grid size over slots; strategy; group; chunk length;
predicted time). Session 14 found head_dim 256 (one CTA an SM) 6-25% slow this way, which
became the wide_waves column.

    PYTHONPATH=$PWD python3 benchmarks/offline/s14_residuals.py [PROFILE.yaml] [SWEEP.csv]
"""
import collections
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from splitkv.calibration.sweep import read_measurements
from splitkv.planner.cost_model import feature_constants
from splitkv.planner.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]


def main(profile=None, csv=None):
    csv = csv or ROOT / "benchmarks/results/calibration/nvidia-h200.csv"
    model = load_profile(path=profile).cost_model() if profile else load_profile().cost_model()
    # as they ran: eligible fused plans merged in clusters (as fit_profile sees them)
    measured = [replace(m, plan=m.plan.with_execution(clusters=model.clusters))
                for m in read_measurements(csv)]
    predicted = model.predict([m.plan for m in measured])
    rows = []
    for m, pred in zip(measured, predicted):
        p, plan = m.plan.problem, m.plan
        ipc, slots, _ = feature_constants(p.num_qo_heads, p.num_kv_heads, p.head_dim,
                                          model.num_sms, model.ctas_per_sm, model.bandwidth_gbps)
        chunk = (plan.chunk_end - plan.chunk_start).mean()
        rows.append({"ratio": m.measured_us / pred, "per_sm": slots // model.num_sms,
                     "grid": plan.num_chunks * ipc / slots, "strategy": plan.strategy,
                     "group": p.num_qo_heads // p.num_kv_heads, "chunk": chunk, "pred": pred})
    edges = {"grid": (0.5, 1, 2, 4), "chunk": (64, 256, 1024, 4096), "pred": (10, 30, 100)}

    def band(key, value):
        if key not in edges:
            return value
        for edge in edges[key]:
            if value <= edge:
                return f"<= {edge}"
        return f"> {edges[key][-1]}"

    for key in ("per_sm", "grid", "strategy", "group", "chunk", "pred"):
        groups = collections.defaultdict(list)
        for r in rows:
            groups[band(key, r[key])].append(r["ratio"])
        print(f"== measured / predicted by {key}")
        for name in sorted(groups, key=str):
            v = np.array(groups[name])
            print(f"  {str(name):10s} n={v.size:4d}  median {np.median(v):.3f}  "
                  f"p10 {np.quantile(v, 0.1):.3f}  p90 {np.quantile(v, 0.9):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
