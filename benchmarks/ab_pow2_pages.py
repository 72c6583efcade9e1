"""A/B: the page walk by shift and mask (``DecodeExperiments(pow2_pages=True)``) against
division, the same plan, in one process, timed like the bench (a graph over layers of >= 1 GiB
of KV). Pages smaller than a thread's row step (page size 1; 2 at head_dim 64) look up each
16-byte copy's page by an integer division (about 20 instructions, 8 a thread a tile at
head_dim 128); with 2**k pages a shift does it. Page 16 rows show the cost where the walk
steps within a page and nothing is gained.

    PYTHONPATH=$PWD python3 benchmarks/ab_pow2_pages.py [--kv-dtype fp8_e4m3]
"""
from splitkv.bench.cases import _eq, select
from splitkv.bench.experiments_ab import ab_arguments, time_experiments
from splitkv.runtime.experiments import DecodeExperiments

args, fmt = ab_arguments(__doc__.splitlines()[0], "p1_b8_n8k,b32_n8k")
cases = select(args.cases) + [_eq("p1_b1_n32k", 1, 32768, None, None, page=1),
                              _eq("p1_d64_b32_n4k", 32, 4096, None, None, d=64, page=1),
                              _eq("p2_d64_b32_n4k", 32, 4096, None, None, d=64, page=2)]
print(f"{'case':>15} {'divide us':>10} {'shift us':>9} {'ratio':>6}  plan", flush=True)
for case in cases:
    plan, us = time_experiments(case, {"divide": DecodeExperiments(pow2_pages=False),
                                       "shift": DecodeExperiments(pow2_pages=True)},
                                kv_dtype=fmt, rounds=args.rounds)
    a, b = us["divide"], us["shift"]
    print(f"{case.name:>15} {a:10.2f} {b:9.2f} {b / a:6.3f}  {plan.strategy}/{plan.num_splits}",
          flush=True)
