"""A first look at fp8 KV speed (not the bench of record): for a few standard cases, the bf16
wrapper's planned time and an fp8 wrapper running the same plan over uint8 codes, timed like the
bench (graph over layers of >= 1 GiB of KV). The fp8 read floor is half the bf16 one.

    PYTHONPATH=$PWD python3 benchmarks/fp8_first_look.py [--cases b1_n32k,b32_n8k]
"""
import argparse

import cupy
import numpy as np

from splitkv.bench.cases import select
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import LayeredKV, make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="b1_n32k,b8_n32k,b32_n8k,b128_n2k,ragged_b32")
parser.add_argument("--kv-dtype", default="float8_e4m3fn")
args = parser.parse_args()
print(f"{'case':>12} {'bf16 us':>9} {'fp8 us':>9} {'fp8/bf16':>8}  plan")
for case in select(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    shape = (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, "bfloat16")
    w16 = BatchDecodeWrapper(*shape)
    plan = w16.plan(pt)
    data = make_layers(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim, "bfloat16",
                       min_total_bytes=1 << 30, seed=0)
    us16 = time_wrapper_us(w16, data)
    layers = 2 * data.num_layers           # half the bytes per layer: twice the layers
    gen = cupy.random.default_rng(1)
    pool = (data.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    codes = lambda: gen.integers(0, 0x70, pool, dtype=cupy.uint8)   # finite codes
    del data
    fp8_data = LayeredKV(cupy.asarray(make_layers(pt, case.num_qo_heads, case.num_kv_heads,
                                                  case.head_dim, "bfloat16",
                                                  min_total_bytes=1, seed=0).q),
                         [codes() for _ in range(layers)], [codes() for _ in range(layers)],
                         None, pool[0])
    fp8_data.out = cupy.empty((len(case.kv_lens), case.num_qo_heads, case.head_dim), cupy.uint16)
    w8 = BatchDecodeWrapper(*shape, kv_dtype=args.kv_dtype)
    w8.plan(pt, plan=plan)
    us8 = time_wrapper_us(w8, fp8_data)
    print(f"{case.name:>12} {us16:9.2f} {us8:9.2f} {us8 / us16:8.2f}  {plan.strategy}/{plan.num_splits}",
          flush=True)
    del fp8_data
    cupy.get_default_memory_pool().free_all_blocks()
