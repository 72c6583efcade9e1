"""Host time of one decode step's planning on the GPU machine, and where it goes: building the
page table from a block table, ``choose_plan`` alone, the whole ``BatchDecodeWrapper.plan()``
from a prebuilt ``PageTable`` (choose, build the chunk records, copy them and the page table to
the GPU, bind the launches), and ``plan()`` as an engine calls it: host lengths and the block
table left on the device (nothing of the table built or copied). Median microseconds over many
calls, after a warm-up; the device is idle before each call (untimed synchronize), as in a
decode loop where the previous step's copy finished long ago. ``--profile`` adds the top
functions of cProfile's view of the engine call.

    PYTHONPATH=$PWD python3 benchmarks/plan_host_cost.py [--repeats 500] [--profile]
"""

import argparse
import cProfile
import pstats

import cupy
import numpy as np

from splitkv.bench.cases import RAGGED_B32, ragged_b256_lengths
from splitkv.core.problem import DecodeProblem, PageTable
from splitkv.planner import choose_plan
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import median_host_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=500)
parser.add_argument("--back-to-back", action="store_true",
                    help="no synchronize between calls (plan() then waits for the last copy)")
parser.add_argument("--profile", action="store_true", help="cProfile the engine call")
args = parser.parse_args()
idle = not args.back_to_back
PAGE = 16
print(f"{'case':>12} {'block table':>12} {'choose_plan':>12} {'plan(table)':>12} "
      f"{'plan(device)':>13} chunks  (us, median of {args.repeats})")
for name, lens in (("ragged_b32", np.array(RAGGED_B32)), ("ragged_b256", ragged_b256_lengths())):
    pt, _ = scattered_page_table(lens, PAGE, np.random.default_rng(0), 0)
    width = int(np.diff(pt.kv_indptr).max())
    table = np.full((pt.batch_size, width), -1, np.int32)
    for b in range(pt.batch_size):
        row = pt.kv_indices[pt.kv_indptr[b]:pt.kv_indptr[b + 1]]
        table[b, :row.size] = row
    device_table = cupy.asarray(table)
    seq_lens = np.asarray(lens, np.int32)
    w = BatchDecodeWrapper(32, 8, 128, PAGE, "bfloat16")
    w.plan(pt)
    problem = DecodeProblem.from_page_table(pt, 32, 8, 128)
    model = w.profile.cost_model()
    warmup = max(args.repeats // 10, 20)

    def time(fn):
        return median_host_us(fn, args.repeats, warmup=warmup, idle_device=idle)

    build = time(lambda: PageTable.from_block_table(table, seq_lens, PAGE))
    choose = time(lambda: choose_plan(problem, model))
    whole = time(lambda: w.plan(pt))

    def engine_call():
        w.plan(seq_lens=seq_lens, block_table=device_table)

    engine = time(engine_call)
    print(f"{name:>12} {build:12.1f} {choose:12.1f} {whole:12.1f} {engine:13.1f} "
          f"{w.current_plan.num_chunks:6d}", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            engine_call()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
