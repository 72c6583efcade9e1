"""A/B: large GQA groups in more CTAs a kv head (``DecodeExperiments(rows_per_cta=16 or 32)``)
against the default (up to 64 rows a CTA), the same plan, in one process, timed like the bench
(a graph over layers of >= 1 GiB of KV). A group of 32 now runs as one CTA of two row tiles a
kv head (two warps split each tile's tokens); capped at 16 it runs two CTAs of one row tile
(four warps split the tokens), each reading the kv head's K/V, the second mostly from L2.

    PYTHONPATH=$PWD python3 benchmarks/ab_rows_per_cta.py [--kv-dtype fp8_e4m3]
"""
from splitkv.bench.cases import _eq, select
from splitkv.bench.experiments_ab import ab_arguments, time_experiments
from splitkv.runtime.experiments import DecodeExperiments

args, fmt = ab_arguments(__doc__.splitlines()[0], "g32_b32_n8k,g16_b8_n8k")
cases = select(args.cases) + [_eq("g32_b1_n32k", 1, 32768, None, None, hq=64, hk=2),
                              _eq("g32_b8_n8k", 8, 8192, None, None, hq=32, hk=1)]
caps = (None, 32, 16)
print(f"{'case':>12} " + " ".join(f"{'rows ' + str(c or 64):>14}" for c in caps) + "  plan",
      flush=True)
for case in cases:
    plan, us = time_experiments(case, {c: DecodeExperiments(rows_per_cta=c) for c in caps},
                                kv_dtype=fmt, rounds=args.rounds)
    print(f"{case.name:>12} " + " ".join(f"{us[c]:8.2f} {us[c] / us[None]:5.3f}" for c in caps)
          + f"  {plan.strategy}/{plan.num_splits}", flush=True)
