"""Which plans and kernel builds the fp8 cases want (not the bench of record): for each case,
the planner's plan (chosen with the bf16 profile rows) and fixed splits, over fp8 K/V, for the
default fp8 build and others (stages / register cap), timed like the bench. Tells whether a
case's gap to its peer is the plan or the kernel.

    PYTHONPATH=$PWD python3 benchmarks/fp8_explore.py [--cases b32_n2k,b128_n2k] \
        [--plans single/1,split_merge/2,fused/2] [--builds 0:0,4:168]
"""
import argparse

import cupy
import numpy as np

from splitkv.bench.cases import FP8_BEST_PEER_US, select
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="b1_n1k,b8_n8k,b32_n2k,b32_n8k,b128_n2k")
parser.add_argument("--plans", default="planner,single/1,split_merge/2,fused/2,split_merge/4")
parser.add_argument("--builds", default="0:0,4:168", help="stages:max_registers, 0 = default")
parser.add_argument("--kv-dtype", default="float8_e4m3fn")
args = parser.parse_args()
builds = [tuple(int(x) for x in b.split(":")) for b in args.builds.split(",")]
plans = args.plans.split(",")
print(f"{'case':>10} {'build':>7} " + " ".join(f"{p:>14}" for p in plans) + "  peer")
for case in select(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, *heads, "bfloat16", min_total_bytes=1 << 30, seed=0,
                       kv_dtype=args.kv_dtype)
    for stages, regs in builds:
        w = BatchDecodeWrapper(*heads, case.page_size, "bfloat16", kv_dtype=args.kv_dtype,
                               experiments=DecodeExperiments(stages=stages or None,
                                                             max_registers=regs or None))
        cells = []
        for p in plans:
            if p == "planner":
                plan = w.plan(pt)
                label = f"{plan.strategy[:5]}/{plan.num_splits}"
            else:
                strategy, n = p.split("/")
                plan = w.plan(pt, num_splits=int(n), strategy=strategy)
                label = ""
            us = time_wrapper_us(w, data)
            cells.append(f"{us:7.2f} {label}".rstrip())
        print(f"{case.name:>10} {f's{stages}r{regs}':>7} " + " ".join(f"{c:>14}" for c in cells)
              + f"  {FP8_BEST_PEER_US.get(case.name)}", flush=True)
    del data
    cupy.get_default_memory_pool().free_all_blocks()
