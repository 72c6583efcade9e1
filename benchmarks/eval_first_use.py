"""How well does first-use planning choose, against the shipped profile and the roofline prior?

The shipped profile is hidden and the user cache is a fresh temporary folder, so the device is
one splitkv knows nothing of; the first-use probes run (timed: ``probe_seconds`` is the probes'
own wall time, first compiles of their kernels included where CuPy's cache is empty,
``probe_seconds_compiled`` a second run with every kernel compiled), and their
model, the shipped profile (where the device has one) and the roofline prior each plan the
planner evaluation's held-out shapes (``eval_planner.py``: 44 standard and 24 of the classes).
Every shape's plans are timed once in the same run: the three picks and eval_planner's grid (no
split; chunks of 64 to 16k tokens, each 'split_merge' and 'fused'); each pick is scored against
the best measured plan of its shape.

    python3 benchmarks/eval_first_use.py --json h200-first-use.json [--shapes all] [--limit N]
        [--kv-dtype fp8_e4m3]

Writes {"cases": [...], "within_5pct_frac", "geomean_ratio", "probe_seconds", ...} for the
first-use model, and the same table under "shipped" and "prior".
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from eval_planner import GRID, heldout_class_shapes, heldout_shapes  # noqa: E402

from splitkv.core.fp8 import fp8_format  # noqa: E402
from splitkv.core.plan import plan_chunk_tokens  # noqa: E402
from splitkv.measure.first_use_probes import run_probes  # noqa: E402
from splitkv.measure.timing import make_layers, time_plan_us  # noqa: E402
from splitkv.planner import choose_plan, profile_lookup, profiles  # noqa: E402
from splitkv.planner.first_use import derive_profile  # noqa: E402
from splitkv.planner.kin import kin_of, kin_profile  # noqa: E402
from splitkv.runtime import device_info  # noqa: E402
from splitkv.testing import scattered_page_table  # noqa: E402

# first_use: the probes' model; kin and kin_as_is: the shipped profile of another GPU of this
# architecture, rescaled to this one's SMs and streaming read (what first use plans with on such
# a GPU) and as it is
PICKS = ("first_use", "kin", "kin_as_is", "shipped", "prior")


def plan_key(plan):
    return (plan.strategy, plan.chunk_request.tobytes(), plan.chunk_start.tobytes(),
            plan.chunk_end.tobytes())


def table(rows, who):
    cases = [{"shape": r["shape"], "plan": r[who]["plan"], "plan_us": r[who]["us"],
              "predicted_us": r[who]["predicted_us"], "oracle_plan": r["oracle_plan"],
              "oracle_us": r["oracle_us"], "ratio": round(r[who]["us"] / r["oracle_us"], 4)}
             for r in rows if who in r]
    if not cases:
        return None
    ratios = np.array([c["ratio"] for c in cases])
    worst = sorted(cases, key=lambda c: -c["ratio"])[:5]
    return {"cases": cases, "within_5pct_frac": round(float(np.mean(ratios <= 1.05)), 4),
            "geomean_ratio": round(float(np.exp(np.mean(np.log(ratios)))), 4),
            "worst": worst}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="all", choices=["standard", "classes", "all"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--kv-dtype", default=None, help="fp8 K/V: fp8_e4m3 or fp8_e5m2 (each "
                    "model plans with its fp8 fit where it has one)")
    args = ap.parse_args()
    kv_dtype = fp8_format("--kv-dtype", args.kv_dtype)
    info = device_info()
    name, num_sms = info["name"], info["num_sms"]

    # the shipped profile, read before it is hidden
    shipped = profiles.shipped_profile(profiles.device_slug(name))
    models = {}
    if shipped is not None:
        models["shipped"] = shipped.cost_model(kv_dtype)
    # a device splitkv knows nothing of: no shipped profile, an empty user cache
    profile_lookup.shipped_profile = lambda slug: None
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="splitkv-first-use-")
    os.environ.pop(profiles.PROFILE_ENV, None)

    start = time.perf_counter()
    results = run_probes()
    wall = time.perf_counter() - start
    first = derive_profile(results)
    # again, every kernel compiled: what the probes cost on a machine that has compiled them
    # (another driver or splitkv version probes again with CuPy's cache warm)
    warm = run_probes()
    models["first_use"] = first.cost_model(kv_dtype)
    models["prior"] = profiles.prior_profile(name, num_sms).cost_model(kv_dtype)
    kin = kin_of(name, int(info["cc"]), results.bandwidth_gbps)
    if kin is not None:
        models["kin"] = kin_profile(kin, name, num_sms, results.bandwidth_gbps).cost_model(
            kv_dtype)
        models["kin_as_is"] = kin.cost_model(kv_dtype)
    print(f"probes: {results.seconds:.2f} s, {warm.seconds:.2f} s compiled "
          f"(phases {results.phase_seconds}, compiled {warm.phase_seconds}); bandwidth "
          f"{results.bandwidth_gbps:.0f} GB/s, empty kernel {results.empty_graph_us:.2f} us in "
          f"a graph, {results.empty_eager_us:.2f} alone; ctas/SM {first.ctas_per_sm}; probe "
          f"fit RMS {first.fit_error:.1%}", flush=True)
    print("first-use coef: " + ", ".join(f"{k}={v:.3g}" for k, v in first.coef.items()),
          flush=True)

    shapes = ((heldout_shapes() if args.shapes != "classes" else [])
              + (heldout_class_shapes() if args.shapes != "standard" else []))[: args.limit]
    rows = []
    for i, (shape, prob) in enumerate(shapes):
        pt, _ = scattered_page_table(prob.kv_lens, prob.page_size, np.random.default_rng(i), 0)
        data = make_layers(pt, prob.num_qo_heads, prob.num_kv_heads, prob.head_dim, prob.dtype,
                           kv_dtype=kv_dtype)
        plans = {}
        picks = {who: choose_plan(prob, model) for who, model in models.items()}
        for p in picks.values():
            plans.setdefault(plan_key(p), p)
        single = plan_chunk_tokens(prob, 1 << 30, "single")
        plans.setdefault(plan_key(single), single)
        for chunk in GRID:
            for strategy in ("split_merge", "fused"):
                p = plan_chunk_tokens(prob, chunk, strategy, align=64)
                if p.num_splits > 1:
                    plans.setdefault(plan_key(p), p)
        measured = {k: time_plan_us(p, pt, data=data, trials=3, min_trial_ms=10.0,
                                    kv_dtype=kv_dtype)
                    for k, p in plans.items()}
        best = min(measured, key=measured.get)
        row = {"shape": shape, "oracle_us": round(measured[best], 3),
               "oracle_plan": f"{plans[best].strategy}/{plans[best].num_splits}"}
        for who, p in picks.items():
            row[who] = {"plan": f"{p.strategy}/{p.num_splits}",
                        "us": round(measured[plan_key(p)], 3),
                        "predicted_us": round(float(p.predicted_us), 3)}
        rows.append(row)
        print(f"[{i + 1}/{len(shapes)}] {shape:>26}: oracle {row['oracle_plan']:>14} "
              f"{row['oracle_us']:8.2f} us | " + " | ".join(
                  f"{who} {row[who]['plan']} {row[who]['us'] / row['oracle_us']:.3f}"
                  for who in PICKS if who in row), flush=True)
        del data

    result = {"device": name, "date": datetime.date.today().isoformat(),
              "command": "python3 " + " ".join(sys.argv), "shape_set": args.shapes,
              "kv_dtype": kv_dtype,
              **table(rows, "first_use"), "probe_seconds": round(results.seconds, 3),
              "probe_wall_seconds": round(wall, 3),
              "probe_seconds_compiled": round(warm.seconds, 3), "probes": results.to_dict(),
              "probes_compiled": warm.to_dict(),
              "first_use_profile": first.to_dict()}
    for who in PICKS[1:]:
        result[who] = table(rows, who)
    for who in PICKS:
        t = result if who == "first_use" else result[who]
        if t:
            print(f"{who:>9}: within 5% {t['within_5pct_frac']:.1%}  geomean "
                  f"{t['geomean_ratio']:.4f}  worst {t['worst'][0]['shape']} "
                  f"{t['worst'][0]['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
