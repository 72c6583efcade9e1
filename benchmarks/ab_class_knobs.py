"""A/B over the experiment knobs, for issue 18's classes: each class case's planned plan, timed
with the default build and with each knob that applies to its shape (``DecodeExperiments``),
the same plan, in one process, timed like the bench (a graph over layers of >= 1 GiB of KV).
One call tells which knob moves which class, so that the next change is aimed.

Knobs: stages -1 / +1 / +2 of the default; 4 and 8 warps; q in shared memory or registers
(head_dim 256); the page walk by division where the default shifts (2**k pages smaller than a
thread's row step); rows_per_cta 16 and 32 (groups past them). A knob that does
not build or launch for a shape (shared memory past the SM's) prints as "n/a".

    PYTHONPATH=$PWD python3 benchmarks/ab_class_knobs.py [--cases classes] [--kv-dtype fp8_e4m3]
        [--json out.json]
"""
import json

from splitkv.bench.cases import select
from splitkv.bench.experiments_ab import ab_arguments, run_ab
from splitkv.runtime import features
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.kernel_source import DEFAULT_FP8_STAGES, DEFAULT_STAGES, row_tiles_for

args, fmt = ab_arguments(__doc__.splitlines()[0], "classes", json={"default": None})


def knobs(case) -> dict:
    """The knobs that apply to this case's shape, by name."""
    # Forced stages give up the shape's defaults (features.default_occupancy's 3 stages under
    # a 128-register cap at 16-bit head_dim 64, default_tile_per_warp's 128-token fp8 tiles):
    # these knobs are stages of 16 tokens a warp at the compiler's registers, around the
    # depth those builds had before session 13, so "default" may differ from all of them.
    default = (DEFAULT_FP8_STAGES if fmt else DEFAULT_STAGES)[case.head_dim]
    out = {f"stages {s}": DecodeExperiments(stages=s)
           for s in (default - 1, default + 1, default + 2) if s >= 2}
    out["4 warps"] = DecodeExperiments(warps=4)
    out["8 warps"] = DecodeExperiments(warps=8)
    if case.head_dim == 256:
        out["q in smem"] = DecodeExperiments(q_in_smem=True)
        out["q in regs"] = DecodeExperiments(q_in_smem=False)
    group = case.num_qo_heads // case.num_kv_heads
    if features.default_pow2_pages(case.page_size, case.head_dim, row_tiles_for(group),
                                   1 if fmt else 2):
        out["divide"] = DecodeExperiments(pow2_pages=False)      # the default shifts here
    for rows in (16, 32):
        if group > rows:
            out[f"rows {rows}"] = DecodeExperiments(rows_per_cta=rows)
    return out


timed = run_ab(select(args.cases), lambda case: {"default": None, **knobs(case)},
               kv_dtype=fmt, rounds=args.rounds)
rows = [dict(case=case.name, plan=f"{plan.strategy}/{plan.num_splits}",
             kv_dtype=fmt or "bfloat16", us=us) for case, plan, us in timed]
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
