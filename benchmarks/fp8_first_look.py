"""fp8 KV speed beside bf16 (not the bench of record): for a few standard cases, the bf16
wrapper's planned time, then fp8 wrappers (formats x pipeline stages) running the same plan,
timed like the bench (graph over layers of >= 1 GiB of KV). The fp8 read floor is half the
bf16 one.

    PYTHONPATH=$PWD python3 benchmarks/fp8_first_look.py [--cases b1_n32k,b32_n8k] \
        [--kv-dtypes float8_e4m3fn,float8_e5m2] [--stages 0,3] [--max-registers 0,168] [--warps 4,8]
"""
import argparse

import cupy
import numpy as np

from splitkv.bench.cases import select
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="b1_n32k,b8_n32k,b32_n8k,b128_n2k,ragged_b32")
parser.add_argument("--kv-dtypes", default="float8_e4m3fn")
parser.add_argument("--stages", default="0", help="fp8 pipeline stages to try; 0 = the default")
parser.add_argument("--max-registers", default="0", help="register caps to try; 0 = none")
parser.add_argument("--warps", default="4", help="warps per CTA to try (4, 8)")
args = parser.parse_args()
kinds = [(f, int(s), int(r), int(w)) for f in args.kv_dtypes.split(",")
         for s in args.stages.split(",") for r in args.max_registers.split(",")
         for w in args.warps.split(",")]
names = [f"{f.split('_')[1][:4]}/s{s or 'd'}" + (f"/r{r}" if r else "") + (f"/w{w}" if w != 4 else "")
         for f, s, r, w in kinds]
print(f"{'case':>12} {'bf16 us':>9} " + " ".join(f"{n:>13}" for n in names) + "  plan")
for case in select(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    shape = (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, "bfloat16")
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim, "bfloat16")
    w16 = BatchDecodeWrapper(*shape)
    plan = w16.plan(pt)
    data = make_layers(pt, *heads, min_total_bytes=1 << 30, seed=0)
    us16 = time_wrapper_us(w16, data)
    del data
    cells = []
    for fmt, stages, regs, warps in kinds:
        data = make_layers(pt, *heads, min_total_bytes=1 << 30, seed=0, kv_dtype=fmt)
        w8 = BatchDecodeWrapper(*shape, kv_dtype=fmt,
                                experiments=DecodeExperiments(stages=stages or None,
                                                              max_registers=regs or None,
                                                              warps=warps))
        w8.plan(pt, plan=plan)
        us8 = time_wrapper_us(w8, data)
        cells.append(f"{us8:7.2f} {us8 / us16:4.2f}")
        del data
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"{case.name:>12} {us16:9.2f} " + " ".join(f"{c:>13}" for c in cells)
          + f"  {plan.strategy}/{plan.num_splits}", flush=True)
