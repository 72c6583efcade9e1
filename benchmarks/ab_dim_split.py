"""A/B: head_dim 256 with the head dim of O split between warp pairs
(``DecodeExperiments(dim_split=2)``: 8 warps a CTA, 64-token tiles, 128 KiB; q in shared memory
or in registers) against the default (4 warps, q in shared memory, 160 KiB): the d256 class is
2.8% behind FlashInfer's decode (benchmarks/NOTES.md, session 12). Each case's planned plan,
timed with each setting in one process (``time_experiments``).

NVRTC (sm_90): dim_split with q in registers 242 registers, 128 KiB; with q in shared memory
194 registers, 192 KiB; one 8-warp CTA an SM either way, where the default has one of 4 warps.

    PYTHONPATH=$PWD python3 benchmarks/ab_dim_split.py [--cases ...] [--rounds 2]
"""
from splitkv.bench.cases import _eq, select
from splitkv.bench.experiments_ab import ab_arguments, run_ab
from splitkv.runtime.experiments import DecodeExperiments

args, _ = ab_arguments(__doc__.splitlines()[0], "d256_b8_n8k,b32_n8k", kv_dtype=False)
cases = select(args.cases) + [_eq("d256_b1_n32k", 1, 32768, None, None, hq=16, hk=8, d=256),
                              _eq("d256_b32_n4k", 32, 4096, None, None, hq=16, hk=8, d=256),
                              _eq("d256_g4_b8_n8k", 8, 8192, None, None, hq=32, hk=8, d=256)]
settings = {"default": None, "dim split": DecodeExperiments(dim_split=2),
            "dim split, q in regs": DecodeExperiments(dim_split=2, q_in_smem=False)}
run_ab(cases, lambda case: settings, rounds=args.rounds)
