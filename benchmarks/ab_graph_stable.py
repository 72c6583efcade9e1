"""A/B: graph-stable wrappers (``use_cuda_graph=True``) against the per-shape plan, with the
capacity's grid sized and launched a few ways, interleaved in one process and timed like the
bench (a graph of one call per layer over >= 1 GiB of KV).

Variants: ``shape`` (the ordinary wrapper), ``stable`` (the default capacity: two waves),
``stable_1wave`` (max_chunks for one wave of two CTAs per SM), ``stable_nopdl``,
``stable_spread`` / ``stable_1wave_spread`` (one CTA per SM forced under PDL).

    PYTHONPATH=$PWD python3 benchmarks/ab_graph_stable.py [--cases b1_n8k,b8_n8k]
"""

import argparse

import numpy as np

from splitkv.bench.cases import select
from splitkv.runtime import device_info
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="b1_n1k,b1_n8k,b1_n32k,b8_n8k,g8_b1_n32k,b32_n2k")
parser.add_argument("--rounds", type=int, default=2)
args = parser.parse_args()

sms = device_info()["num_sms"]


def variants(case, pages: int) -> dict:
    one_wave = max(len(case.kv_lens), -(-2 * sms // case.num_kv_heads))
    stable = dict(use_cuda_graph=True, max_batch_size=len(case.kv_lens), max_num_pages=pages)
    spread = DecodeExperiments(pdl_spread=True)
    return {"shape": {}, "stable": stable, "stable_1wave": dict(stable, max_chunks=one_wave),
            "stable_nopdl": dict(stable, pdl=False),
            "stable_spread": dict(stable, experiments=spread),
            "stable_1wave_spread": dict(stable, max_chunks=one_wave, experiments=spread)}


print(f"{'case':>12} " + " ".join(f"{name:>20}" for name in variants(select('b1_n1k')[0], 1)))
for case in select(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    data = make_layers(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim, "bfloat16",
                       min_total_bytes=1 << 30, seed=0)
    results = {}
    for _ in range(args.rounds):
        for name, options in variants(case, pt.kv_indices.size).items():
            w = BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim,
                                   case.page_size, "bfloat16", **options)
            plan = w.plan(pt)
            us = time_wrapper_us(w, data)
            results.setdefault(name, []).append((us, f"{plan.strategy}/{plan.num_splits}"))
    base = np.median([u for u, _ in results["shape"]])
    cells = []
    for name, runs in results.items():
        us = float(np.median([u for u, _ in runs]))
        cells.append(f"{us:7.2f} {runs[0][1]:>10} {us / base:4.2f}"[:20].rjust(20))
    print(f"{case.name:>12} " + " ".join(cells), flush=True)
    del data
