"""A/B: the same plans launched plainly and with programmatic dependent launch (PDL, the next
kernel allowed to launch early or late: experiments.PDL_TRIGGERS), interleaved
in one process, timed like the bench (a graph of one call per layer over >= 1 GiB of KV). Also
checks that both give the same output bits.

    PYTHONPATH=$PWD python3 benchmarks/ab_pdl.py [--cases b1_n1k,g8_b1_n32k]
"""

import argparse
import re

import numpy as np

from splitkv.bench.cases import STANDARD_CASES, Case, select
from splitkv.planner import choose_plan, load_profile
from splitkv.core.problem import DecodeProblem
from splitkv.runtime import device_info
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import scattered_page_table
from splitkv.runtime.timing import make_layers, time_wrapper_us
from splitkv.runtime.wrapper import BatchDecodeWrapper

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cases", default=None,
                    help="standard case names, or bB_nN for B requests of N tokens (32/8 heads)")
parser.add_argument("--modes", default="early,late,early_spread,late_spread",
                    help="PDL modes after plain: early|late, optionally _spread or _nospread to "
                         "force one CTA per SM or not (else the wrapper's rule)")
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

info = device_info()
profile = load_profile(device_name=info["name"], num_sms=info["num_sms"])
MODES = (False, *args.modes.split(","))


def cases(names):
    if not names:
        return select(None)
    out = []
    for name in names.split(","):
        shape = re.fullmatch(r"b(\d+)_n(\d+)", name)
        if shape and name not in {c.name for c in STANDARD_CASES}:
            out.append(Case(name, (int(shape[2]),) * int(shape[1])))
        else:
            out += select(name)
    return out



print(f"{'case':>14} {'plan':>18} {'plain us':>9} " + " ".join(f"{m + ' us':>16}" for m in MODES[1:])
      + "  same bits")
for case in cases(args.cases):
    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0), 0)
    problem = DecodeProblem.from_page_table(pt, case.num_qo_heads, case.num_kv_heads,
                                            case.head_dim)
    data = make_layers(pt, case.num_qo_heads, case.num_kv_heads, case.head_dim, "bfloat16")
    chosen = choose_plan(problem, profile)
    plans = {f"{chosen.strategy}/{chosen.num_splits}": chosen}
    if chosen.strategy != "single":          # the other merge at the same split
        other = "fused" if chosen.strategy == "split_merge" else "split_merge"
        forced = choose_plan(problem, profile, num_splits=chosen.num_splits, strategy=other)
        plans[f"{other}/{forced.num_splits}"] = forced
    for label, plan in plans.items():
        us = {mode: [] for mode in MODES}
        outs = {}
        for _ in range(args.rounds):
            for mode in MODES:
                experiments = DecodeExperiments()
                if mode:
                    trigger, _, spread = mode.partition("_")
                    experiments = DecodeExperiments(
                        pdl_trigger=trigger, pdl_spread=None if not spread else spread == "spread")
                w = BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim,
                                       case.page_size, "bfloat16", profile=profile,
                                       pdl=bool(mode), experiments=experiments)
                w.plan(pt, plan=plan)
                us[mode].append(time_wrapper_us(w, data, trials=5, min_trial_ms=10.0))
                outs[mode] = w.run(data.q, data.k_layers[0], data.v_layers[0]).get().view(np.uint16)
        plain = np.median(us[False])
        cells = [f"{np.median(us[m]):7.2f} ({np.median(us[m]) / plain - 1:+5.1%})" for m in MODES[1:]]
        same = all(np.array_equal(outs[False], o) for o in outs.values())
        print(f"{case.name:>14} {label:>18} {plain:9.2f} " + " ".join(f"{c:>16}" for c in cells)
              + f"  {same}",
              flush=True)
    del data
