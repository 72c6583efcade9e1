"""What the attention variants cost beside the plain decode (the variants' bench rows).

Each planned by the wrapper, timed like the bench (a graph over layers of >= 1 GiB of KV), in
one run:

- soft cap (``plan(logits_soft_cap=30)``), sinks (``run(sinks=)``), both, and ALiBi
  (``plan(alibi_slopes=)``, the paper's slopes): on memory-bound standard cases, as a ratio to
  the plain call (target <= 1.03);
- a sliding window (``plan(window_left=4095)``: 4,096 tokens seen) over a 128k context, beside a
  plain 4k context (target <= 1.1x);
- multi-token decode (``plan(qo_indptr=)``), q_len 2, 4, 8, 16 beside q_len 1 (targets: q_len 4
  <= 1.15x, 8 <= 1.3x on the memory-bound cases); ``--warps 4,8`` A/Bs the CTA's warps there.

    PYTHONPATH=$PWD python3 benchmarks/bench_variants.py [--kv-dtype float8_e4m3fn] [--json F]
"""
import argparse
import dataclasses
import json

import cupy
import numpy as np

from splitkv.bench.cases import select
from splitkv.core.variants import alibi_slopes
from splitkv.measure.timing import make_layers, time_wrapper_us
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.wrapper import BatchDecodeWrapper
from splitkv.testing import scattered_page_table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default="b1_n32k,b8_n32k,b32_n8k,b128_n2k,ragged_b32")
parser.add_argument("--kv-dtype", default=None)
parser.add_argument("--json", default=None)
parser.add_argument("--q-lens", default="2,4,8,16")
parser.add_argument("--skip", default="", help="sections to skip: variants,windows,multi")
parser.add_argument("--warps", default="", help="multi-token A/B: warps per CTA to force (4,8); "
                    "default: the wrapper's choice")
args = parser.parse_args()
kv = args.kv_dtype
rows = []


def timed(pt, hq, hk, d, page, *, run_args=None, q_rows=None, warps=None, **plan_args):
    w = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype=kv,
                           experiments=DecodeExperiments(warps=warps))
    plan = w.plan(pt, **plan_args)
    data = make_layers(pt, hq, hk, d, "bfloat16", min_total_bytes=1 << 30, seed=0, kv_dtype=kv)
    if q_rows is not None:     # multi-token decode: q and out have every query row
        rows = cupy.zeros((q_rows, hq, d), data.q.dtype)
        rows[:] = data.q[:1]
        data = dataclasses.replace(data, q=rows, out=cupy.empty_like(rows))
    us = time_wrapper_us(w, data, **(run_args or {}))
    del data
    cupy.get_default_memory_pool().free_all_blocks()
    return us, f"{plan.strategy}/{plan.num_splits}"


print(f"K/V: {kv or 'bfloat16'}")
skip = set(args.skip.split(","))
print(f"{'case':>12} {'plain us':>9} {'soft cap':>13} {'sinks':>13} {'cap+sinks':>13} "
      f"{'alibi':>13}  plans")
for case in ([] if "variants" in skip else select(args.cases)):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    shape = (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size)
    sinks = cupy.asarray(np.random.default_rng(1).standard_normal(case.num_qo_heads),
                         cupy.float32)
    plain, p0 = timed(pt, *shape)
    cap, p1 = timed(pt, *shape, logits_soft_cap=30.0)
    sink, p2 = timed(pt, *shape, run_args={"sinks": sinks})
    both, p3 = timed(pt, *shape, logits_soft_cap=30.0, run_args={"sinks": sinks})
    alibi, p4 = timed(pt, *shape, alibi_slopes=alibi_slopes(case.num_qo_heads))
    rows.append({"case": case.name, "plain_us": plain, "soft_cap_us": cap, "sinks_us": sink,
                 "soft_cap_sinks_us": both, "alibi_us": alibi, "plans": [p0, p1, p2, p3, p4]})
    print(f"{case.name:>12} {plain:9.2f} " + " ".join(
        f"{t:7.2f} {t / plain:5.3f}" for t in (cap, sink, both, alibi))
        + f"  {p0} {p1} {p2} {p3} {p4}", flush=True)

print(f"\n{'window case':>22} {'us':>8} {'plain 4k us':>12} {'x':>6}  plans")
windows = []
for batch in (() if "windows" in skip else (1, 8)):
    pt4, _ = scattered_page_table([4096] * batch, 16, np.random.default_rng(0), extra_pages=0)
    pt128, _ = scattered_page_table([131072] * batch, 16, np.random.default_rng(0),
                                    extra_pages=0)
    plain4, pa = timed(pt4, 32, 8, 128, 16)
    win, pb = timed(pt128, 32, 8, 128, 16, window_left=4095)
    windows.append({"batch": batch, "window_4k_over_128k_us": win, "plain_4k_us": plain4,
                    "plans": [pb, pa]})
    print(f"{f'b{batch} w4k over 128k':>22} {win:8.2f} {plain4:12.2f} {win / plain4:6.3f}  {pb} {pa}",
          flush=True)

q_lens = [int(x) for x in args.q_lens.split(",")]


def multi_token_rows(warps):
    """q_len rows a request beside q_len 1, per case; ``warps``: forced (None: the default)."""
    print(f"\n{'case':>12} {'q_len 1 us':>10} " + " ".join(f"{f'q_len {n}':>14}" for n in q_lens)
          + f"  plans (warps: {warps or 'the default'})")
    rows = []
    for case in ([] if "multi" in skip else select(args.cases)):
        pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                     extra_pages=0)
        shape = (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size)
        one, p1 = timed(pt, *shape, warps=warps)
        cells, plans, row = [], [p1], {"case": case.name, "warps": warps, "q_len_1_us": one}
        for n in q_lens:
            if min(case.kv_lens) < n:
                continue
            indptr = np.arange(len(case.kv_lens) + 1) * n
            us, pn = timed(pt, *shape, qo_indptr=indptr, q_rows=int(indptr[-1]), warps=warps)
            row[f"q_len_{n}_us"] = us
            cells.append(f"{us:8.2f} {us / one:5.2f}")
            plans.append(pn)
        row["plans"] = plans
        rows.append(row)
        print(f"{case.name:>12} {one:10.2f} " + " ".join(f"{c:>14}" for c in cells)
              + "  " + " ".join(plans), flush=True)
    return rows


multi = [row for warps in ([int(w) for w in args.warps.split(",")] if args.warps else [None])
         for row in multi_token_rows(warps)]

if args.json:
    with open(args.json, "w") as f:
        json.dump({"kv_dtype": kv or "bfloat16", "variants": rows, "windows": windows,
                   "multi_token": multi}, f,
                  indent=1)
