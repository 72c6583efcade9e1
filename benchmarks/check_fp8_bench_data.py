"""Where did the NaN in the fp8 class bench come from? (session 12: d64_b64_n4k with fp8 K/V
gave rel err "nan", the output and the float64 reference non-finite on the same requests, though
``random_fp8_codes`` draws only finite codes.) This rebuilds that case's data as the bench does
and checks q and every K/V layer for non-finite values after each step the bench takes before
its error check: the data alone, a plan and one run, the timed runs, the graph-stable wrapper's
timed runs. The first step after which something is non-finite is the one that wrote it.

    PYTHONPATH=$PWD python3 benchmarks/check_fp8_bench_data.py [--cases d64_b64_n4k,d256_b8_n8k]
"""
import argparse

import cupy
import numpy as np

from splitkv.bench.cases import select
from splitkv.core import fp8
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="d64_b64_n4k,d256_b8_n8k,b8_n8k")
parser.add_argument("--kv-dtype", default="fp8_e4m3")
args = parser.parse_args()
fmt = fp8.fp8_format("--kv-dtype", args.kv_dtype)


for case in select(args.cases):
    rng = np.random.default_rng(0)
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, rng, extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    w = BatchDecodeWrapper(*heads, case.page_size, "bfloat16", kv_dtype=fmt)
    plan = w.plan(pt)
    data = make_layers(pt, *heads, "bfloat16", min_total_bytes=1 << 30, seed=0, kv_dtype=fmt)
    steps = [("the data alone", lambda: None),
             ("one run", lambda: w.run(data.q, data.k_layers[0], data.v_layers[0], out=data.out)),
             ("the timed runs", lambda: time_wrapper_us(w, data))]

    def graph_stable():
        g = BatchDecodeWrapper(*heads, case.page_size, "bfloat16", kv_dtype=fmt,
                               use_cuda_graph=True, max_batch_size=len(case.kv_lens),
                               max_num_pages=pt.kv_indices.size)
        g.plan(pt)
        time_wrapper_us(g, data)
    steps.append(("the graph-stable timed runs", graph_stable))
    for name, step in steps:
        step()
        cupy.cuda.Device().synchronize()
        found = data.non_finite(fmt)
        print(f"{case.name} ({plan.strategy}/{plan.num_splits}, {w.kernel_variant.name}): "
              f"after {name}: {found or 'all finite'}", flush=True)
        if found:
            break
    data = None                 # its device memory back before the next case
