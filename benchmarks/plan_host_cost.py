"""Host time of one decode step's planning on the GPU machine: ``choose_plan`` alone, and the
whole ``BatchDecodeWrapper.plan()`` (choose, build the chunk records, copy them and the page
table to the GPU). Median microseconds over many calls, after a warm-up; the device is idle
before each call (untimed synchronize), as in a decode loop where the previous step's copy
finished long ago.

    PYTHONPATH=$PWD python3 benchmarks/plan_host_cost.py [--repeats 500]
"""

import argparse

import numpy as np

from splitkv.bench.cases import RAGGED_B32, ragged_b256_lengths
from splitkv.planner import choose_plan
from splitkv.core.problem import DecodeProblem
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import median_host_us
from splitkv.runtime.wrapper import BatchDecodeWrapper


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
    warmup = max(args.repeats // 10, 20)
    choose = median_host_us(lambda: choose_plan(problem, model), args.repeats, warmup=warmup,
                            idle_device=idle)
    whole = median_host_us(lambda: w.plan(pt), args.repeats, warmup=warmup, idle_device=idle)
    print(f"{name:>12}: choose_plan {choose:7.1f} us, wrapper.plan {whole:7.1f} us "
          f"({w.current_plan.num_chunks} chunks)", flush=True)
