"""A/B for graph-stable fp8 wrappers: the grid spread one CTA per SM (the rule for the capacity,
or forced) or not, each planning its own plan, timed like the bench. fp8 CTAs stream far
below an SM's share alone (NOTES.md, issue 15), so the 16-bit rule may not suit them.

    PYTHONPATH=$PWD python3 benchmarks/ab_spread_fp8.py [--cases b1_n32k,b8_n32k]
"""
import argparse

import numpy as np

from splitkv.bench.cases import select
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="b1_n8k,b1_n32k,b1_n128k,b8_n8k,b8_n32k,mha_b1_n32k,"
                                       "g8_b1_n32k,b32_n8k")
parser.add_argument("--kv-dtype", default="float8_e4m3fn")
args = parser.parse_args()
print(f"{'case':>12} {'per-shape':>10} " + " ".join(f"{k:>22}" for k in ("rule", "spread", "no spread")))
for case in select(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    shape = (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, "bfloat16")
    data = make_layers(pt, *shape[:3], "bfloat16", min_total_bytes=1 << 30, seed=0,
                       kv_dtype=args.kv_dtype)
    w = BatchDecodeWrapper(*shape, kv_dtype=args.kv_dtype)
    w.plan(pt)
    cells = [f"{time_wrapper_us(w, data):10.2f}"]
    for spread in (None, True, False):
        g = BatchDecodeWrapper(*shape, kv_dtype=args.kv_dtype, use_cuda_graph=True,
                               max_batch_size=len(case.kv_lens), max_num_pages=pt.kv_indices.size,
                               experiments=DecodeExperiments(pdl_spread=spread))
        plan = g.plan(pt)
        cells.append(f"{time_wrapper_us(g, data):8.2f} {plan.strategy[:5]}/{plan.num_splits}"
                     f" c{g.max_chunks}")
    print(f"{case.name:>12} " + " ".join(f"{c:>22}" for c in cells), flush=True)
