"""A/B: q's MMA fragments in shared memory (``DecodeExperiments(q_in_smem=True)``) against
registers, the same plan, in one process, timed like the bench (a graph over layers of >= 1
GiB of KV). At head_dim 256 the register build spills (204 bytes a thread for 16 rows; 0 with
the fragments in shared memory, NVRTC on sm_90); at 128 it does not, so those rows say what the
extra shared-memory reads cost where nothing is gained. (It also takes 4 x head_dim x 32 bytes
more shared memory: fp8 d64 CTAs fit 3 an SM instead of 4; bf16 d128 still 2.)

    PYTHONPATH=$PWD python3 benchmarks/ab_q_smem.py [--kv-dtype fp8_e4m3]
"""
from splitkv.bench.cases import _eq, select
from splitkv.bench.experiments_ab import ab_arguments, time_experiments
from splitkv.runtime.experiments import DecodeExperiments

args, fmt = ab_arguments(__doc__.splitlines()[0], "d256_b8_n8k,b32_n8k,b1_n32k")
cases = select(args.cases) + [_eq("d256_b1_n32k", 1, 32768, None, None, hq=16, hk=8, d=256),
                              _eq("d256_b32_n4k", 32, 4096, None, None, hq=16, hk=8, d=256)]
print(f"{'case':>14} {'registers us':>12} {'shared us':>10} {'ratio':>6}  plan", flush=True)
for case in cases:
    plan, us = time_experiments(case, {"regs": DecodeExperiments(q_in_smem=False),
                                       "smem": DecodeExperiments(q_in_smem=True)},
                                kv_dtype=fmt, rounds=args.rounds)
    r, s = us["regs"], us["smem"]
    print(f"{case.name:>14} {r:12.2f} {s:10.2f} {s / r:6.3f}  {plan.strategy}/{plan.num_splits}",
          flush=True)
