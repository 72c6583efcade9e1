"""A/B: 128-token tiles at 4 warps (``DecodeExperiments(tile_per_warp=32)``) against the
default 64, for rows of 128 bytes: 16-bit head_dim 64 (13% behind SDPA at d64_b64_n4k) and fp8
head_dim 128 (issue-bound: b128_n2k 13% behind the fp8 peer table). Each case's planned plan,
timed with each setting in one process (``time_experiments``).

A tile's fixed costs (its barrier, the page lookups one tile ahead, the softmax's cross-lane
max and rescale vote) do not scale with its bytes; a 64-token tile of 128-byte rows holds half
the bytes of head_dim 128's, so it pays them twice as often a byte. Residency (NVRTC, sm_90):
d64 at 128-token tiles, 2 stages: 176 registers, 64 KiB, 2 CTAs an SM (3 with the 168 cap);
fp8 d128, 3 stages: 230 registers, 96 KiB, 2 an SM (as the default).

    PYTHONPATH=$PWD python3 benchmarks/ab_tile_tokens.py [--kv-dtype fp8_e4m3] [--cases ...]
"""
from splitkv.bench.cases import _eq, select
from splitkv.bench.experiments_ab import ab_arguments, run_ab
from splitkv.runtime.experiments import DecodeExperiments

# --cases default None: head_dim 64 cases (16-bit) or the standard cases (fp8)
args, fmt = ab_arguments(__doc__.splitlines()[0], None)
if args.cases:
    cases = select(args.cases)
elif fmt:
    cases = select("b1_n32k,b8_n8k,b8_n32k,b32_n2k,b32_n8k,b128_n2k,ragged_b32")
else:
    cases = select("d64_b64_n4k") + [_eq("d64_b64_n2600", 64, 2600, None, None, d=64),
                                     _eq("d64_b8_n7790", 8, 7790, None, None, d=64),
                                     _eq("d64_b256_n1k", 256, 1024, None, None, d=64),
                                     _eq("d64_b1_n32k", 1, 32768, None, None, d=64)]
# "default" is the shipped build: since session 13 fp8 head_dim 128 plans of 4 warps run
# 128-token tiles (features.default_tile_per_warp) and 16-bit head_dim 64 4 CTAs an SM
# (features.default_occupancy); "t64" forces 16 tokens a warp (the earlier default for fp8).
settings = {"default": None, "t128": DecodeExperiments(tile_per_warp=32),
            "t128 r168": DecodeExperiments(tile_per_warp=32, max_registers=168),
            "t64": DecodeExperiments(tile_per_warp=16)}
run_ab(cases, lambda case: settings, kv_dtype=fmt, rounds=args.rounds)
