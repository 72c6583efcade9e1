"""Where does a short decode call spend its time? Times the same plans with parts of the
decode kernel cut out (builds with KernelBuild.dissect set: the kernel's DISSECT cuts, one
bit a stage, kernel_source.DISSECT_CUTS), so the differences price each part:

  base       the kernel as shipped
  no_merge   returns after writing the partials (no fence, ticket or fused merge)
  no_pages   reads page pidx of the pool instead of looking it up (no page-table loads)
  no_kv      the K/V copies read nothing (zero-fill): no K/V traffic at all
  bare       no K/V traffic and no merge: start-up, Q, page table, math, epilogue
  empty      returns at once: the launch itself, in a graph of one call per layer
  merge_empty  split_merge's second kernel returns at once (its launch stays): base minus this
             is what that kernel's merging costs
  cluster    as shipped, fused plans merging in thread-block clusters where eligible (the
             probes above all use the atomic-ticket merge)
  cluster_any     every fused plan with 2, 4, 8 or 16 chunks per request in clusters, however
                  long its chunks and large its grid (16 is a non-portable size the kernel
                  opts into)
  cluster_spread  the same, asking the driver to spread a cluster's CTAs over SMs
  cluster_1sm     cluster_any with shared memory padded so only one CTA fits on an SM

The cut kernels compute wrong answers on purpose; only their times mean anything.

    python3 benchmarks/dissect_latency.py [--cases b1_n1k,b1_n8k] [--json out.json]
    python3 benchmarks/dissect_latency.py --plan-set merge --probes base,no_merge,merge_empty

``--plan-set merge`` times the same cuts as split_merge and fused at large batches, short and
long chunks (docs/design/cost-model.md: the cost model's weakest call is between the two
there).
"""

import argparse
import contextlib
import json
from dataclasses import replace

import numpy as np

from splitkv import BatchDecodeWrapper
from splitkv.bench.cases import select
from splitkv.core.plan import plan_chunk_tokens
from splitkv.core.problem import DecodeProblem
from splitkv.core import execution
from splitkv.runtime import kernel_source
from splitkv.runtime.launch import KernelLaunch
from splitkv.runtime.modules import get_decode_kernels
from splitkv.runtime.kernel_source import KernelBuild
from splitkv.measure.timing import make_layers, time_wrapper_us
from splitkv.testing import scattered_page_table

# The probes that cut stages out of the kernel ("base": none), kernel_source.DISSECT_CUTS's.
PROBES = ("base", *kernel_source.DISSECT_CUTS)
# The plans to dissect per case: (strategy, chunk tokens).
PLANS = {
    "b1_n1k": [("fused", 64), ("fused", 128), ("split_merge", 128), ("fused", 256), ("fused", 512)],
    "b1_n8k": [("fused", 256), ("fused", 512), ("fused", 1024)],
    "b1_n32k": [("fused", 1024), ("fused", 2048), ("split_merge", 2048)],
    "g8_b1_n32k": [("fused", 2048), ("split_merge", 2048)],
    "mha_b1_n32k": [("fused", 4096), ("fused", 8192)],
    "b8_n8k": [("fused", 4096), ("fused", 2048), ("single", 1 << 30)],
    "b32_n2k": [("fused", 1024), ("single", 1 << 30)],
    "b1_n128k": [("fused", 4096)],
    "b32_n8k": [("single", 1 << 30)],
    "ragged_b32": [("fused", 2048)],
    "short_b256_n384": [("single", 1 << 30)],     # 2,048 CTAs of 384 tokens (short-calls.md)
}
# --plan-set merge: one cut each way, long chunks (where fused won by 1-11 us in the sweep) and
# short ones (where it lost by 5-23 us).
MERGE_PLANS = {
    "b128_n2k": [(s, c) for c in (1024, 512, 256) for s in ("split_merge", "fused")],
    "short_b256_n384": [(s, c) for c in (192, 128, 64) for s in ("split_merge", "fused")],
    "b32_n8k": [(s, c) for c in (4096, 1024) for s in ("split_merge", "fused")],
}
PLAN_SETS = {"default": PLANS, "merge": MERGE_PLANS}


CLUSTER_PROBES = ("cluster", "cluster_any", "cluster_spread", "cluster_1sm")
ONE_PER_SM_BYTES = 120 * 1024      # more than half an SM's shared memory: one CTA per SM
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, _CLUSTER_SCHEDULING_POLICY = 14, 15   # CUfunction_attribute
_POLICY_DEFAULT, _POLICY_SPREAD = 0, 1                                    # CUclusterSchedulingPolicy


@contextlib.contextmanager
def cluster_rule(probe):
    """For the cluster_any/_spread probes: every uniform split of 2..16 chunks clusters."""
    if probe == "cluster":
        yield
        return
    saved = (execution.CLUSTER_SIZES, execution.CLUSTER_MAX_CHUNK_TOKENS,
             execution.CLUSTER_MAX_WIDE_CTAS, kernel_source.CLUSTER_SIZES)
    execution.CLUSTER_SIZES = kernel_source.CLUSTER_SIZES = (2, 4, 8, 16)
    execution.CLUSTER_MAX_CHUNK_TOKENS = execution.CLUSTER_MAX_WIDE_CTAS = 1 << 30
    try:
        yield
    finally:
        (execution.CLUSTER_SIZES, execution.CLUSTER_MAX_CHUNK_TOKENS,
         execution.CLUSTER_MAX_WIDE_CTAS, kernel_source.CLUSTER_SIZES) = saved


def opt_in(kernel, spread: bool) -> None:
    """Allow clusters of 16; ask for the spread or the default scheduling policy."""
    from cupy_backends.cuda.api import driver

    driver.funcSetAttribute(kernel.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    driver.funcSetAttribute(kernel.kernel.ptr, _CLUSTER_SCHEDULING_POLICY,
                            _POLICY_SPREAD if spread else _POLICY_DEFAULT)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan-set", choices=sorted(PLAN_SETS), default="default")
    parser.add_argument("--cases", default=None, help="default: every case of the plan set")
    parser.add_argument("--json", default=None)
    parser.add_argument("--probes", default=",".join([*PROBES, "cluster"]),
                        help="comma-separated subset of the probes")
    args = parser.parse_args()
    plans = PLAN_SETS[args.plan_set]
    rows = []
    for case in select(args.cases or ",".join(plans)):
        pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0), 0)
        prob = DecodeProblem.from_page_table(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim)
        data = make_layers(pt, prob.num_qo_heads, prob.num_kv_heads, prob.head_dim, prob.dtype)
        for strategy, chunk in plans[case.name]:
            plan = plan_chunk_tokens(prob, chunk, strategy, align=64)
            times, sizes = {}, {}
            chosen = args.probes.split(",")
            for probe, clusters in [(p, False) for p in PROBES if p in chosen] + \
                    [(p, None) for p in CLUSTER_PROBES if p in chosen]:
                w = BatchDecodeWrapper(prob.num_qo_heads, prob.num_kv_heads, prob.head_dim,
                                       prob.page_size, prob.dtype, use_clusters=clusters,
                                       pdl=False)   # the probes cut plain launches
                v = w.base_build
                cut = probe if clusters is False and probe != "base" else ""
                w.base_build = KernelBuild(v.dtype, v.head_dim, v.row_tiles, v.stages,
                                          v.max_registers, dissect=cut)
                with cluster_rule(probe):
                    w.plan(pt, plan=plan)
                kernel = get_decode_kernels(replace(w.base_build, cluster=w.cluster_size)).partial
                if w.cluster_size:      # the kernel object is shared: set both every time
                    opt_in(kernel, spread=probe == "cluster_spread")
                if probe == "cluster_1sm":    # (probes may change what the wrapper never does)
                    kernel.max_dynamic_shared_size_bytes = ONE_PER_SM_BYTES
                    launch = w._launch.partial
                    w._launch.partial = KernelLaunch(kernel, launch.grid, w.base_build.threads,
                                                     ONE_PER_SM_BYTES)
                times[probe] = time_wrapper_us(w, data, trials=5, min_trial_ms=10.0)
                sizes[probe] = w.cluster_size
            rows.append({"case": case.name, "strategy": plan.strategy, "chunk_tokens": chunk,
                         "num_splits": plan.num_splits, "ctas": plan.num_chunks * prob.num_kv_heads,
                         "layers": data.num_layers, **{k: round(t, 2) for k, t in times.items()},
                         "cluster_size": sizes})
            r = rows[-1]
            print(f"{case.name:12s} {plan.strategy:11s}/{plan.num_splits:<3d} ctas {r['ctas']:4d}  "
                  + "  ".join(f"{k} {r[k]:7.2f}" for k in times), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
