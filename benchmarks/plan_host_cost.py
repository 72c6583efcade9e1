"""Host time of one decode step's planning on the GPU machine: ``choose_plan`` alone, and the
whole ``BatchDecodeWrapper.plan()`` (choose, build the chunk records, copy them and the page
table to the GPU). Median microseconds over many calls, after a warm-up; the device is idle
before each call (untimed synchronize), as in a decode loop where the previous step's copy
finished long ago.

    PYTHONPATH=$PWD python3 benchmarks/plan_host_cost.py [--repeats 500]
"""

import argparse
import time

import numpy as np

from splitkv.bench.cases import RAGGED_B32, ragged_b256_lengths
from splitkv.planner import choose_plan
from splitkv.problem import DecodeProblem
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.wrapper import BatchDecodeWrapper


def median_us(fn, repeats: int, idle: bool = True) -> float:
    import cupy

    for _ in range(max(repeats // 10, 20)):
        fn()
    samples = []
    for _ in range(repeats):
        if idle:
            cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return float(np.median(samples)) / 1e3


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=500)
parser.add_argument("--back-to-back", action="store_true",
                    help="no synchronize between calls (plan() then waits for the last copy)")
args = parser.parse_args()
idle = not args.back_to_back
for name, lens in (("ragged_b32", np.array(RAGGED_B32)), ("ragged_b256", ragged_b256_lengths())):
    pt, _ = scattered_page_table(lens, 16, np.random.default_rng(0), 0)
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    w.plan(pt)
    problem = DecodeProblem.from_page_table(pt, 32, 8, 128)
    model = w.profile.cost_model()
    choose = median_us(lambda: choose_plan(problem, model), args.repeats, idle)
    whole = median_us(lambda: w.plan(pt), args.repeats, idle)
    print(f"{name:>12}: choose_plan {choose:7.1f} us, wrapper.plan {whole:7.1f} us "
          f"({w.current_plan.num_chunks} chunks)", flush=True)
