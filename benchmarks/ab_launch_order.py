"""A/B: the same plans with the grid in each launch order (plan order, longest requests first,
longest chunks first), interleaved in one process (benchmarks/NOTES.md, session 5). Ragged batches only: a uniform plan's order does not
change.

    PYTHONPATH=$PWD python3 benchmarks/ab_launch_order.py
"""

import numpy as np

from splitkv.bench.cases import RAGGED_B32, ragged_b256_lengths
from splitkv.calibration.sweep import ragged_lengths
from splitkv.core.plan import plan_chunk_tokens
from splitkv.planner import choose_plan, load_profile
from splitkv.core.problem import DecodeProblem
from splitkv.runtime import device_info
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

info = device_info()
profile = load_profile(device_name=info["name"], num_sms=info["num_sms"])
rng = np.random.default_rng(5)
batches = {"ragged_b32": np.array(RAGGED_B32), "ragged_b256": ragged_b256_lengths(),
           "lognormal_b16_m4k": ragged_lengths(16, 4096, rng),
           "lognormal_b64_m2k": ragged_lengths(64, 2048, rng),
           "lognormal_b128_m1k": ragged_lengths(128, 1024, rng)}
ORDERS = ("plan", "longest_requests", "longest_chunks")
print(f"{'batch':>20} {'plan':>24} " + " ".join(f"{o:>16}" for o in ORDERS))
for name, lens in batches.items():
    pt, _ = scattered_page_table(lens, 16, np.random.default_rng(0), 0)
    problem = DecodeProblem.from_page_table(pt, 32, 8, 128)
    data = make_layers(pt, 32, 8, 128, "bfloat16")
    chosen = choose_plan(problem, profile)
    plans = {f"planner {chosen.strategy}/{chosen.num_splits}": chosen,
             "single": plan_chunk_tokens(problem, 1 << 30, "single"),
             "fused, 1024-token chunks": plan_chunk_tokens(problem, 1024, "fused", align=64)}
    for label, plan in plans.items():
        us = {order: [] for order in ORDERS}
        for _ in range(3):                              # interleaved rounds
            for order in ORDERS:
                w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", profile=profile,
                                       launch_order=order)
                w.plan(pt, plan=plan)
                us[order].append(time_wrapper_us(w, data, trials=5, min_trial_ms=10.0))
        base = np.median(us["plan"])
        cells = [f"{np.median(us[o]):8.2f} ({np.median(us[o]) / base - 1:+5.1%})" for o in ORDERS]
        print(f"{name:>20} {label:>24} " + " ".join(f"{c:>16}" for c in cells), flush=True)
    del data
