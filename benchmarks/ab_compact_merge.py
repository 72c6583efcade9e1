"""A/B: the merge kernel over the split requests only (``DecodeExperiments(compact_merge=
True)``) against the whole batch, on split_merge plans where a few requests of a large batch
split (benchmarks/NOTES.md, session 12: 3-7 us over fused there) and where all do. Each shape
runs one split_merge plan of a chunk size, timed with both settings in one process
(``time_experiments``), beside the fused plan of the same chunks. Then what a graph-stable
wrapper's capacity costs a small batch (capacity of the batch's size against 256 requests):
the case for a compact merge in graph-stable grids too.

    PYTHONPATH=$PWD python3 benchmarks/ab_compact_merge.py [--rounds 2]
"""
import argparse
from dataclasses import replace

import numpy as np

from splitkv import DecodeProblem, plan_chunk_tokens
from splitkv.bench.cases import Case, select
from splitkv.bench.experiments_ab import time_experiments
from splitkv.calibration.sweep import ragged_lengths
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=2)
args = parser.parse_args()
rng = np.random.default_rng(0)
# (case, chunk tokens): the eval's shapes where split_merge lost to fused, then standard ones
SHAPES = [(Case("short_r400_n142", tuple(int(x) for x in ragged_lengths(400, 142, rng))), 1024),
          (Case("r256_n907_g5_hk2", tuple(int(x) for x in ragged_lengths(256, 907, rng)),
                num_qo_heads=10, num_kv_heads=2), 2048),
          (Case("r192_n322_g2_hk2", tuple(int(x) for x in ragged_lengths(192, 322, rng)),
                num_qo_heads=4, num_kv_heads=2), 1024),
          (select("ragged_b32")[0], 2048), (select("b1_n32k")[0], 2048),
          (select("b128_n2k")[0], 1024)]
settings = {"whole batch": None, "compact": DecodeExperiments(compact_merge=True)}
print(f"{'case':>18} {'plan':>16} {'whole us':>9} {'compact us':>10} {'ratio':>6} {'fused us':>9}",
      flush=True)
for case, chunk in SHAPES:
    problem = DecodeProblem(np.array(case.kv_lens), case.num_qo_heads, case.num_kv_heads,
                            case.head_dim, case.page_size)
    plan = plan_chunk_tokens(problem, chunk, "split_merge", align=64)
    if plan.merge != "merge_kernel":
        print(f"{case.name:>18}: chunks of {chunk} split no request; skipped", flush=True)
        continue
    _, us = time_experiments(case, settings, rounds=args.rounds, plan=plan)
    _, fused = time_experiments(case, {"fused": None}, rounds=args.rounds,
                                plan=plan_chunk_tokens(problem, chunk, "fused", align=64))
    split = int((np.diff(plan.merge_indptr) > 1).sum())
    print(f"{case.name:>18} {f'split_merge/{plan.num_splits}':>16} {us['whole batch']:9.2f} "
          f"{us['compact']:10.2f} {us['compact'] / us['whole batch']:6.3f} {fused['fused']:9.2f}"
          f"   ({split} of {len(case.kv_lens)} requests split)", flush=True)

# What a graph-stable wrapper's capacity costs a small batch: its grid of max_chunks x kv heads
# CTAs (idle ones exit after their record) and its merge kernel over the whole capacity's rows,
# every call. The same batch under capacities of its own size and of 256 requests.

import cupy  # noqa: E402  (a GPU script; imported where the device arrays start)

print(f"\n{'case':>18} {'capacity':>8} {'plan':>16} {'us':>8}", flush=True)
for case in select("b8_n8k,b32_n2k,b1_n32k"):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, *heads, "bfloat16", min_total_bytes=1 << 30, seed=0)
    for capacity in (len(case.kv_lens), 256):
        # a graph-stable run takes q and out of the capacity's rows (the batch's first)
        rows = cupy.zeros((capacity, *data.q.shape[1:]), data.q.dtype)
        rows[:len(case.kv_lens)] = data.q
        sized = replace(data, q=rows, out=cupy.empty_like(rows))
        g = BatchDecodeWrapper(*heads, case.page_size, "bfloat16", use_cuda_graph=True,
                               max_batch_size=capacity, max_num_pages=pt.kv_indices.size)
        plan = g.plan(pt)
        us = min(time_wrapper_us(g, sized) for _ in range(args.rounds))
        print(f"{case.name:>18} {capacity:8d} {f'{plan.strategy}/{plan.num_splits}':>16} "
              f"{us:8.2f}", flush=True)
    data = None
