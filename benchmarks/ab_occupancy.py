"""A/B: more CTAs an SM where many short or narrow CTAs run (issue 18: hundreds of short
requests 7% behind SDPA, head_dim 64 at batch 64 13% behind). Each case's planned plan, timed
with the default build and with builds that hold more (or fewer) CTAs an SM, in one process
(``time_experiments``: a graph over >= 1 GiB of layers).

Residency of the default builds (NVRTC, sm_90): head_dim 128, 3 stages: 216 registers, 96 KiB,
so 2 CTAs an SM; head_dim 64, 4 stages: 133 registers, 64 KiB, so 3. The settings:
- d128 "3 an SM": 2 stages (64 KiB) and a 168-register cap (3 x 128 x 168 <= 64 K registers).
  Session 3 measured it 1-2% worse on the best plans of the standard cases but far better on
  many-split plans (b32_n8k in 256-token chunks 1,070 -> 908 us): short CTAs.
- d128 "2 stages": the same shared memory without the cap (still 2 an SM: the control).
- d64 "4 an SM": 3 stages (48 KiB) and a 128-register cap, the default since session 13
  (``features.default_occupancy``; session 13 measured 2-10% faster); "3 an SM": 4 stages at
  the compiler's registers, the earlier default; "2 an SM": 5 stages (80 KiB),
  which session 12 measured 5% faster on d64_b64_n4k (a wave count, or fewer CTAs contending?).

    PYTHONPATH=$PWD python3 benchmarks/ab_occupancy.py [--cases ...] [--rounds 2]
"""
from splitkv.bench.cases import _eq, select
from splitkv.bench.experiments_ab import ab_arguments, run_ab
from splitkv.runtime.experiments import DecodeExperiments

args, _ = ab_arguments(__doc__.splitlines()[0], "short_b256_n384,d64_b64_n4k,b32_n2k,b128_n2k",
                       kv_dtype=False)

EXTRA = [_eq("short_b512_n200", 512, 200, None, None),
         _eq("short_b128_n768", 128, 768, None, None),
         _eq("d64_b64_n2600", 64, 2600, None, None, d=64),
         _eq("d64_b8_n7790", 8, 7790, None, None, d=64),
         _eq("d64_b256_n1k", 256, 1024, None, None, d=64)]
cases = select(args.cases) + EXTRA

SETTINGS = {
    128: {"3 an SM": DecodeExperiments(stages=2, max_registers=168),
          "2 stages": DecodeExperiments(stages=2)},
    64: {"4 an SM": DecodeExperiments(stages=3, max_registers=128),
         "3 an SM": DecodeExperiments(stages=4, max_registers=0),
         "2 an SM": DecodeExperiments(stages=5)},
}



def chunking(case, plan) -> str:
    return (f" ({plan.num_work_items} items, {sum(case.kv_lens) / plan.num_chunks:.0f} tokens "
            "a chunk)")


run_ab(cases, lambda case: {"default": None, **SETTINGS.get(case.head_dim, {})},
       rounds=args.rounds, note=chunking)
