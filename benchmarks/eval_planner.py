"""Does the planner choose well on shapes the fit never saw?

For each held-out shape (batch 1..256, lengths 16..128k, equal and ragged, GQA groups 1..8;
and with ``--shapes classes`` or ``all``, the classes the standard set leaves out: head_dim 64
and 256, pages of 1 and 64 tokens, groups 16 and 32, hundreds of short requests, batch-1
requests of a few thousand tokens), time the planner's plan and a grid of alternatives (no
split; chunk sizes 64..16k tokens, each 'split_merge' and 'fused'); the oracle is the fastest
measured. Reports plan/oracle, the share
within 5%, the geometric mean, and the model's median absolute percentage error over every
measured plan, and writes benchmarks/results/h200-planner.json's format.

    python3 benchmarks/eval_planner.py --profile PATH --json OUT.json [--kv-dtype fp8_e4m3] \
        [--shapes standard|classes|all]

With --kv-dtype the K/V are fp8 codes and the planner plans with the profile's fp8 fit
(``Profile.cost_model(kv_dtype)``).

Offline, no GPU: ``--offline RUN.json --profile PATH`` scores another profile against a
recorded run (its K/V dtype and shape set): each shape's pick is matched to the run's timed
plan of the same chunks and strategy (the grid's plans, and the run's own pick rebuilt under
the run's profile); a pick the run never timed is counted, not scored.
"""

import argparse
import datetime
import json
import sys

import numpy as np

from splitkv.calibration.sweep import ragged_lengths
from splitkv.core.fp8 import fp8_format
from splitkv.core.plan import plan_chunk_tokens
from splitkv.core.problem import DecodeProblem
from splitkv.measure.timing import make_layers, time_plan_us
from splitkv.planner import choose_plan
from splitkv.planner.profile_lookup import load_profile
from splitkv.planner.profiles import SHIPPED_ORIGIN_PREFIX, read_profile, shipped_profile
from splitkv.runtime import device_info
from splitkv.testing import scattered_page_table

GRID = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def heldout_shapes(seed: int = 12345):
    """40+ shapes, drawn with a seed the calibration sweep does not use."""
    rng = np.random.default_rng(seed)
    shapes = []
    groups = [1, 2, 4, 5, 8]
    batches = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    while len(shapes) < 44:
        b = int(rng.choice(batches))
        g = int(rng.choice(groups))
        hk = int(rng.choice([2, 4, 8])) if g > 1 else int(rng.choice([8, 16, 32]))
        mean = int(np.exp(rng.uniform(np.log(16), np.log(131072))))
        ragged = bool(rng.random() < 0.4) and b > 1
        lens = ragged_lengths(b, mean, rng) if ragged else np.full(b, mean)
        kv_bytes = int(lens.sum()) * hk * 128 * 4
        if kv_bytes > (1 << 30) or kv_bytes < (1 << 18):
            continue
        name = f"{'r' if ragged else 'b'}{b}_n{mean}_g{g}_hk{hk}"
        shapes.append((name, DecodeProblem(lens, hk * g, hk, 128, 16, "bfloat16")))
    return shapes


def plan_key(plan) -> tuple:
    """What makes two plans the same launch: the strategy and every chunk."""
    return (plan.strategy, plan.chunk_request.tobytes(), plan.chunk_start.tobytes(),
            plan.chunk_end.tobytes())


def offline(run_path: str, profile_path: str) -> dict:
    """The scores of ``profile_path``'s picks against the run recorded in ``run_path``."""
    with open(run_path) as f:
        run = json.load(f)
    kv_dtype = run.get("kv_dtype")
    model = read_profile(profile_path).cost_model(kv_dtype)
    # the run's own pick is timed too: rebuilt under its profile (a file, or a shipped one)
    origin = run["profile"]
    if origin.startswith(SHIPPED_ORIGIN_PREFIX):
        run_profile = shipped_profile(origin[len(SHIPPED_ORIGIN_PREFIX):].removesuffix(".yaml"))
    else:
        run_profile = read_profile(origin)
    run_model = run_profile.cost_model(kv_dtype)
    shapes = dict(heldout_shapes() + heldout_class_shapes())
    ratios, untimed = [], []
    for row in run["shapes"]:
        problem, timed = shapes[row["shape"]], {}
        for c in row["candidates"]:
            tokens, strategy = c["chunk_tokens"], c["plan"].split("/")[0]
            if tokens == "planner":
                p = choose_plan(problem, run_model)
            elif tokens == "single":
                p = plan_chunk_tokens(problem, 1 << 30, "single")
            else:
                p = plan_chunk_tokens(problem, int(tokens), strategy, align=64)
            timed.setdefault(plan_key(p), c["us"])
        us = timed.get(plan_key(choose_plan(problem, model)))
        if us is None:
            untimed.append(row["shape"])
        else:
            ratios.append(us / row["oracle_us"])
    if not ratios:
        raise SystemExit(f"--offline: none of the picks was timed in {run_path}")
    r = np.array(ratios)
    return {"run": run_path, "profile": profile_path, "kv_dtype": kv_dtype, "scored": r.size,
            "within_5pct_frac": round(float(np.mean(r <= 1.05)), 4),
            "geomean_ratio": round(float(np.exp(np.mean(np.log(r)))), 4),
            "worst_ratio": round(float(r.max()), 4), "untimed": untimed}


def heldout_class_shapes(seed: int = 54321):
    """24 shapes of the classes (3 or 4 of each, in turn), drawn with their own seed;
    the group class alternates groups of 16 and 32."""
    rng = np.random.default_rng(seed)

    def lengths(b, lo, hi):          # a mean drawn log-uniformly; ragged around it or equal
        mean = int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        return ragged_lengths(b, mean, rng) if b > 1 and rng.random() < 0.4 else np.full(b, mean)

    classes = [  # (name, kv lengths, qo heads, kv heads, head_dim, page size)
        ("d64", lambda: lengths(int(rng.choice([8, 64, 256])), 512, 16384), 32, 8, 64, 16),
        ("d256", lambda: lengths(int(rng.choice([1, 8, 32])), 1024, 32768), 16, 8, 256, 16),
        ("page1", lambda: lengths(int(rng.choice([1, 8, 32])), 1024, 16384), 32, 8, 128, 1),
        ("page64", lambda: lengths(int(rng.choice([1, 8, 32])), 1024, 32768), 32, 8, 128, 64),
        ("g16", lambda: lengths(int(rng.choice([1, 8, 32])), 1024, 32768),
         int(rng.choice([32, 64])), None, 128, 16),
        ("short", lambda: lengths(int(rng.choice([200, 400])), 100, 600), 32, 8, 128, 16),
        ("b1_few_k", lambda: np.array([int(rng.integers(1500, 6000))]), 32, 8, 128, 16),
    ]
    shapes = []
    while len(shapes) < 24:
        name, lens_of, hq, hk, d, page = classes[len(shapes) % len(classes)]
        lens = lens_of()
        if hk is None:                       # groups of 16 and 32 in turn
            hk = hq // (16, 32)[len(shapes) // len(classes) % 2]
        problem = DecodeProblem(lens, hq, hk, d, page, "bfloat16")
        if not (1 << 18) <= problem.kv_bytes <= (1 << 30):
            continue
        tag = "r" if len(set(lens.tolist())) > 1 else "b"
        shapes.append((f"{name}_{tag}{lens.size}_n{int(lens.mean())}_h{hq}/{hk}", problem))
    return shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--kv-dtype", default=None, help="fp8 K/V: fp8_e4m3 or fp8_e5m2")
    ap.add_argument("--shapes", default="all", choices=["standard", "classes", "all"],
                    help="the 44 standard held-out shapes, the 24 class shapes, or both")
    ap.add_argument("--only", default=None,
                    help="comma-separated shape names: time these of the set only (e.g. the "
                         "shapes whose choice a new profile moves)")
    ap.add_argument("--offline", default=None, metavar="RUN.json",
                    help="no GPU: score --profile against this recorded run")
    args = ap.parse_args()
    if args.offline:
        if not args.profile:
            ap.error("--offline: needs --profile, the profile to score")
        result = offline(args.offline, args.profile)
        print(f"{result['profile']} on {result['run']}: within 5% "
              f"{result['within_5pct_frac']:.1%} of {result['scored']} scored shapes, geomean "
              f"{result['geomean_ratio']:.4f}, worst {result['worst_ratio']:.3f}; "
              f"untimed picks: {', '.join(result['untimed']) or 'none'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    kv_dtype = fp8_format("--kv-dtype", args.kv_dtype)
    info = device_info()
    profile = load_profile(args.profile, device_name=info["name"], num_sms=info["num_sms"])
    model = profile.cost_model(kv_dtype)
    rows, abs_pct = [], []
    shapes = ((heldout_shapes() if args.shapes != "classes" else [])
              + (heldout_class_shapes() if args.shapes != "standard" else []))[: args.limit]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {name for name, _ in shapes})
        if unknown:
            ap.error(f"--only: no shapes {unknown} in --shapes {args.shapes}")
    # each shape keeps its index in the set: its page table's seed, as in a whole run
    seeds = {name: i for i, (name, _) in enumerate(shapes)}
    if args.only:
        shapes = [(name, prob) for name, prob in shapes if name in wanted]
    for i, (name, prob) in enumerate(shapes):
        pt, _ = scattered_page_table(prob.kv_lens, prob.page_size,
                                     np.random.default_rng(seeds[name]), 0)
        data = make_layers(pt, prob.num_qo_heads, prob.num_kv_heads, prob.head_dim, prob.dtype,
                           kv_dtype=kv_dtype)
        chosen = choose_plan(prob, model)
        plans = {("planner",): chosen}
        plans[("single",)] = plan_chunk_tokens(prob, 1 << 30, "single")
        for chunk in GRID:
            for strategy in ("split_merge", "fused"):
                p = plan_chunk_tokens(prob, chunk, strategy, align=64)
                if p.num_splits > 1:
                    plans[(chunk, strategy)] = p
        measured, candidates = {}, []
        for key, p in plans.items():
            us = time_plan_us(p, pt, data=data, trials=3, min_trial_ms=10.0, kv_dtype=kv_dtype)
            measured[key] = us
            pred = model.predict(p)
            abs_pct.append(abs(pred - us) / us)
            candidates.append({"plan": f"{p.strategy}/{p.num_splits}", "chunk_tokens": key[0],
                               "num_chunks": p.num_chunks, "us": round(us, 3),
                               "predicted_us": round(float(pred), 3)})
        oracle_key = min(measured, key=measured.get)
        row = {"shape": name, "batch": prob.batch_size, "tokens": prob.total_tokens,
               "group": prob.group_size, "kv_heads": prob.num_kv_heads,
               "plan": f"{chosen.strategy}/{chosen.num_splits}",
               "plan_us": round(measured[("planner",)], 2),
               "oracle_us": round(measured[oracle_key], 2),
               "oracle_plan": f"{plans[oracle_key].strategy}/{plans[oracle_key].num_splits}",
               "predicted_us": round(chosen.predicted_us, 2)}
        row["ratio"] = round(row["plan_us"] / row["oracle_us"], 4)
        # every measured plan, so that planner changes can be judged offline against this run
        row["candidates"] = candidates
        rows.append(row)
        print(f"[{i + 1}/{len(shapes)}] {name:>24}: plan {row['plan']:>14} {row['plan_us']:8.2f} us"
              f" (pred {row['predicted_us']:8.2f}) oracle {row['oracle_plan']:>14} "
              f"{row['oracle_us']:8.2f} us ratio {row['ratio']:.3f}", flush=True)
        del data
    ratios = np.array([r["ratio"] for r in rows])
    result = {"device": info["name"], "date": datetime.date.today().isoformat(),
              "command": "python3 " + " ".join(sys.argv), "profile": profile.origin,
              "kv_dtype": kv_dtype, "shape_set": args.shapes,
              "within_5pct_frac": round(float(np.mean(ratios <= 1.05)), 4),
              "geomean_ratio": round(float(np.exp(np.mean(np.log(ratios)))), 4),
              "mape": round(float(np.median(abs_pct)), 4),
              "mape_note": "median absolute percentage error of the model over every measured plan",
              "shapes": rows}
    worst = [{k: v for k, v in r.items() if k != "candidates"}
             for r in sorted(rows, key=lambda r: -r["ratio"])[:5]]
    result["worst"] = worst
    print(f"within 5%: {result['within_5pct_frac']:.2%}  geomean plan/oracle "
          f"{result['geomean_ratio']:.4f}  model median APE {result['mape']:.1%}")
    for r in worst:
        print(f"  worst: {r['shape']} plan {r['plan']} {r['plan_us']} us vs oracle "
              f"{r['oracle_plan']} {r['oracle_us']} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
