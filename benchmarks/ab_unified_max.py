"""A/B: the unified max (``plan(unified_max=phi)``) against the running max, the same plan, in
one process, timed like the bench (a graph over layers of >= 1 GiB of KV). phi comes from the
row maxima of layer 0's data (``core.unified_max.choose_unified_max``); the fallback rate is the
CTAs that fell back over the CTAs run, once per layer. A third column runs phi 60 units below
the scores (every CTA falls back): what a phi that does not fit the model costs.

    PYTHONPATH=$PWD python3 benchmarks/ab_unified_max.py [--cases b1_n32k,b32_n8k] \
        [--kv-dtype fp8_e4m3] [--json out.json]
"""
import argparse
import json

import numpy as np

from splitkv.bench.cases import select
from splitkv.core import fp8
from splitkv.core import unified_max as UM
from splitkv.core.geometry import ctas_per_kv_head
from splitkv.core.reference import to_float64
from splitkv.runtime.cupy_arrays import free_cached_blocks
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="b1_n1k,b1_n8k,b1_n32k,b8_n8k,b8_n32k,b32_n2k,b32_n8k,"
                                       "b128_n2k,mha_b1_n32k,g8_b1_n32k,ragged_b32")
parser.add_argument("--kv-dtype", default=None)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--json", default=None)
args = parser.parse_args()
fmt = fp8.fp8_format("--kv-dtype", args.kv_dtype)
dtype = "bfloat16"
rows = []
print(f"{'case':>12} {'running us':>10} {'unified us':>10} {'ratio':>6} {'fallback':>9} "
      f"{'phi off us':>10} {'ratio':>6}  plan  phi", flush=True)
for case in select(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, *heads, dtype, min_total_bytes=1 << 30, seed=0, kv_dtype=fmt)
    w = BatchDecodeWrapper(*heads, case.page_size, dtype, kv_dtype=fmt)
    plan = w.plan(pt)
    # phi from layer 0's row maxima over the plan's chunks (at most 8 requests of them)
    q_host = to_float64(data.q.get())
    k_host = data.k_layers[0].get()
    maxima = UM.row_maxima(plan, q_host, k_host, pt, kv_dtype=fmt)
    phi = UM.choose_unified_max(maxima, dtype, fmt)
    del k_host
    times = {"running": [], "unified": [], "phi_off": []}
    for _ in range(args.rounds):
        for name, value in (("running", None), ("unified", phi), ("phi_off", phi - 60)):
            w.plan(pt, plan=plan, unified_max=value)
            times[name].append(time_wrapper_us(w, data))
    # the fallback rate: one run a layer, counted
    w.plan(pt, plan=plan, unified_max=phi)
    for layer in range(data.num_layers):
        w.run(data.q, data.k_layers[layer], data.v_layers[layer], out=data.out)
    # CTAs a run: work items (chunks x kv heads) x CTAs a kv head
    ctas = plan.num_work_items * ctas_per_kv_head(plan.problem.group_size)
    rate = w.unified_max_fallbacks() / (ctas * data.num_layers)
    us = {name: float(np.median(t)) for name, t in times.items()}
    rows.append(dict(case=case.name, kv_dtype=fmt or dtype, phi=phi, fallback_rate=rate,
                     plan=f"{plan.strategy}/{plan.num_splits}", **{f"{k}_us": v for k, v in us.items()}))
    print(f"{case.name:>12} {us['running']:10.2f} {us['unified']:10.2f} "
          f"{us['unified'] / us['running']:6.3f} {rate:9.4f} {us['phi_off']:10.2f} "
          f"{us['phi_off'] / us['running']:6.3f}  {plan.strategy}/{plan.num_splits}  {phi:.2f}",
          flush=True)
    del data
    free_cached_blocks()
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
