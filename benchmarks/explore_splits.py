"""Time a grid of explicit plans (chunk size x strategy) on the standard cases: the landscape
the planner has to choose from, and the oracle for each case.

    python3 benchmarks/explore_splits.py [--cases b1_n1k,...] [--json out.json]
"""

import argparse
import json

import numpy as np

from splitkv.bench.bandwidth import read_bandwidth_gbps
from splitkv.bench.cases import select
from splitkv.core.plan import plan_chunk_tokens
from splitkv.core.problem import DecodeProblem
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_plan_us

CHUNKS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 1 << 30]

parser = argparse.ArgumentParser()
parser.add_argument("--cases", default=None)
parser.add_argument("--json", default=None)
parser.add_argument("--trials", type=int, default=5)
parser.add_argument("--stages", default="0",
                    help="comma-separated kernel configs: pipeline depth (0 = default), optionally "
                         "':' and a per-thread register cap, e.g. 3,2:168")
parser.add_argument("--chunks", default=None, help="comma-separated chunk sizes in tokens")
parser.add_argument("--min-trial-ms", type=float, default=10.0)
args = parser.parse_args()
if args.chunks:
    CHUNKS = [int(c) for c in args.chunks.split(",")]

bw = read_bandwidth_gbps()
print(f"read bw {bw:.0f} GB/s", flush=True)
results = []
for case in select(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0), 0)
    prob = DecodeProblem.from_page_table(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, prob.num_qo_heads, prob.num_kv_heads, prob.head_dim, prob.dtype)
    for config in args.stages.split(","):
      stages, _, regs = config.partition(":")
      stages, regs = int(stages), int(regs) if regs else None
      seen = set()
      line = []
      for chunk in CHUNKS:
        for strategy in ("split_merge", "fused"):
            align = 64 if chunk >= 64 else 16
            plan = plan_chunk_tokens(prob, chunk, strategy, align=align)
            if plan.num_splits == 1:
                plan = plan_chunk_tokens(prob, chunk, "single")
            key = (tuple(plan.chunk_start), tuple(plan.chunk_end), plan.strategy)
            if key in seen or plan.num_splits > 512:
                continue
            seen.add(key)
            us = time_plan_us(plan, pt, data=data, trials=args.trials, min_trial_ms=args.min_trial_ms,
                              experiments=DecodeExperiments(stages=stages or None, max_registers=regs))
            results.append({"case": case.name, "stages": config, "chunk_tokens": chunk,
                            "strategy": plan.strategy, "num_splits": plan.num_splits,
                            "num_chunks": plan.num_chunks, "us": us,
                            "frac_bw": prob.kv_bytes / (us * 1e-6) / 1e9 / bw})
            line.append(f"{plan.strategy[0]}{plan.num_splits}:{us:.1f}")
      best = min((r for r in results if r["case"] == case.name and r["stages"] == config),
                 key=lambda r: r["us"])
      print(f"{case.name:>12} st{config} best {best['strategy']}/{best['num_splits']} {best['us']:.2f} us "
            f"({100 * best['frac_bw']:.0f}% bw) | " + " ".join(line), flush=True)
    del data
if args.json:
    with open(args.json, "w") as f:
        json.dump({"read_gbps": bw, "results": results}, f, indent=1)
