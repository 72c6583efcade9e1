"""A/B: large GQA groups in more CTAs a kv head (``DecodeExperiments(rows_per_cta=16 or 32)``)
against the default (up to 64 rows a CTA), the same plan, in one process, timed like the bench
(a graph over layers of >= 1 GiB of KV). A group of 32 now runs as one CTA of two row tiles a
kv head (two warps split each tile's tokens); capped at 16 it runs two CTAs of one row tile
(four warps split the tokens), each reading the kv head's K/V, the second mostly from L2.

    PYTHONPATH=$PWD python3 benchmarks/ab_rows_per_cta.py [--kv-dtype fp8_e4m3]
"""
import argparse

import cupy
import numpy as np

from splitkv.bench.cases import _eq, select
from splitkv.core import fp8
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="g32_b32_n8k,g16_b8_n8k")
parser.add_argument("--kv-dtype", default=None)
parser.add_argument("--rounds", type=int, default=2)
args = parser.parse_args()
fmt = fp8.fp8_format("--kv-dtype", args.kv_dtype)
cases = select(args.cases) + [_eq("g32_b1_n32k", 1, 32768, None, None, hq=64, hk=2),
                              _eq("g32_b8_n8k", 8, 8192, None, None, hq=32, hk=1)]
caps = (None, 32, 16)
print(f"{'case':>12} " + " ".join(f"{'rows ' + str(c or 64):>14}" for c in caps) + "  plan",
      flush=True)
for case in cases:
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, *heads, "bfloat16", min_total_bytes=1 << 30, seed=0, kv_dtype=fmt)
    wrappers = [BatchDecodeWrapper(*heads, case.page_size, "bfloat16", kv_dtype=fmt,
                                   experiments=DecodeExperiments(rows_per_cta=c)) for c in caps]
    plan = wrappers[0].plan(pt)
    for w in wrappers[1:]:
        w.plan(pt, plan=plan)
    times = [[] for _ in caps]
    for _ in range(args.rounds):
        for i, w in enumerate(wrappers):
            times[i].append(time_wrapper_us(w, data))
    us = [float(np.median(t)) for t in times]
    print(f"{case.name:>12} " + " ".join(f"{u:8.2f} {u / us[0]:5.3f}" for u in us)
          + f"  {plan.strategy}/{plan.num_splits}", flush=True)
    del data
    cupy.get_default_memory_pool().free_all_blocks()
