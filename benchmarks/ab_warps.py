"""A/B: the planner's plans for short chunks run by the default kernel (4 warps, 64-token tiles)
and by an 8-warp variant (128-token tiles: a chunk of up to 128 tokens is one tile instead of
two, its math spread over twice the warps), interleaved in one process, timed like the bench.
Each variant's output is checked against the float64 reference (relative L2 error).

    PYTHONPATH=$PWD python3 benchmarks/ab_warps.py [--shapes b1_n1024,b4_n512]
"""

import argparse
from dataclasses import replace

import numpy as np

from splitkv.bench.cli import _rel_err_subset
from splitkv.planner import choose_plan, load_profile
from splitkv.problem import DecodeProblem
from splitkv.runtime import device_info
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--shapes", default="b1_n1024,b1_n512,b1_n2048,b2_n1024,b4_n512,b8_n1024,"
                                        "b1_n8192,b16_n512")
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

info = device_info()
profile = load_profile(device_name=info["name"], num_sms=info["num_sms"])
VARIANTS = {"4 warps": {}, "8 warps s2": {"warps": 8, "stages": 2},
            "8 warps s3": {"warps": 8, "stages": 3}}
print(f"{'shape':>10} {'plan':>16} " + " ".join(f"{v:>18}" for v in VARIANTS) + "  rel err")
for name in args.shapes.split(","):
    b, n = (int(x) for x in name[1:].split("_n"))
    pt, _ = scattered_page_table([n] * b, 16, np.random.default_rng(0), 0)
    problem = DecodeProblem.from_page_table(pt, 32, 8, 128)
    data = make_layers(pt, 32, 8, 128, "bfloat16")
    plan = choose_plan(problem, profile)
    us = {v: [] for v in VARIANTS}
    errs = {}
    for _ in range(args.rounds):
        for label, change in VARIANTS.items():
            w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", profile=profile)
            w.variant = replace(w.variant, **change)
            w.plan(pt, plan=plan)
            us[label].append(time_wrapper_us(w, data, trials=5, min_trial_ms=10.0))
            if label not in errs:
                errs[label] = _rel_err_subset(w, pt, data)
    base = np.median(us["4 warps"])
    cells = [f"{np.median(us[v]):7.2f} ({np.median(us[v]) / base - 1:+5.1%})" for v in VARIANTS]
    print(f"{name:>10} {plan.strategy + '/' + str(plan.num_splits):>16} "
          + " ".join(f"{c:>18}" for c in cells)
          + "  " + " ".join(f"{errs[v]:.1e}" for v in VARIANTS), flush=True)
    del data
