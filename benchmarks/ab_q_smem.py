"""A/B: q's MMA fragments in shared memory (``DecodeExperiments(q_in_smem=True)``) against
registers, the same plan, in one process, timed like the bench (a graph over layers of >= 1
GiB of KV). At head_dim 256 the register build spills (204 bytes a thread for 16 rows; 0 with
the fragments in shared memory, NVRTC on sm_90); at 128 it does not, so those rows say what the
extra shared-memory reads cost where nothing is gained. (It also takes 4 x head_dim x 32 bytes
more shared memory: fp8 d64 CTAs fit 3 an SM instead of 4; bf16 d128 still 2.)

    PYTHONPATH=$PWD python3 benchmarks/ab_q_smem.py [--kv-dtype fp8_e4m3]
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
parser.add_argument("--cases", default="d256_b8_n8k,b32_n8k,b1_n32k")
parser.add_argument("--kv-dtype", default=None)
parser.add_argument("--rounds", type=int, default=2)
args = parser.parse_args()
fmt = fp8.fp8_format("--kv-dtype", args.kv_dtype)
cases = select(args.cases) + [_eq("d256_b1_n32k", 1, 32768, None, None, hq=16, hk=8, d=256),
                              _eq("d256_b32_n4k", 32, 4096, None, None, hq=16, hk=8, d=256)]
print(f"{'case':>14} {'registers us':>12} {'shared us':>10} {'ratio':>6}  plan", flush=True)
for case in cases:
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, *heads, "bfloat16", min_total_bytes=1 << 30, seed=0, kv_dtype=fmt)
    regs = BatchDecodeWrapper(*heads, case.page_size, "bfloat16", kv_dtype=fmt)
    smem = BatchDecodeWrapper(*heads, case.page_size, "bfloat16", kv_dtype=fmt,
                              experiments=DecodeExperiments(q_in_smem=True))
    plan = regs.plan(pt)
    smem.plan(pt, plan=plan)
    times = {"regs": [], "smem": []}
    for _ in range(args.rounds):
        times["regs"].append(time_wrapper_us(regs, data))
        times["smem"].append(time_wrapper_us(smem, data))
    r, s = (float(np.median(times[k])) for k in ("regs", "smem"))
    print(f"{case.name:>14} {r:12.2f} {s:10.2f} {s / r:6.3f}  {plan.strategy}/{plan.num_splits}",
          flush=True)
    del data
    cupy.get_default_memory_pool().free_all_blocks()
