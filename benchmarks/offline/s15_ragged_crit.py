"""Session 15: is the per-SM critical path too pessimistic for unequal chunks? crit_us and
crit_tiles are max(largest chunk, ceil(items / num_sms) x mean chunk): the ceiling is right
for equal chunks (whole waves), but CTAs of unequal chunks are dealt as they finish, so the
SM-wave count is closer to items / num_sms, and tail_us already carries the largest chunk's
excess. r256_n907_g5's fused/4 (546 CTAs = 4.14 SM-waves, counted 5) is predicted 20% slow.
Variant: where the chunks are unequal, items / num_sms without the ceiling. Fitted on the
16-bit sweep, scored on the eval's measured candidates (argmin among them); the same for fp8.

    PYTHONPATH=$PWD python3 benchmarks/offline/s15_ragged_crit.py
"""
import numpy as np

import s13_common as C
import s15_fp8_tiles as T
from splitkv.core.geometry import ctas_per_kv_head
from splitkv.planner.cost_model import FEATURE_NAMES

NUM_SMS = 132
I = {n: FEATURE_NAMES.index(n) for n in ("crit_us", "crit_tiles", "crit_tile_rows", "lone_cta_us")}


def crit(plan, exact_waves, tile_tokens=64):
    p = plan.problem
    ipc = p.num_kv_heads * ctas_per_kv_head(p.num_qo_heads // p.num_kv_heads)
    tok = (plan.chunk_end - plan.chunk_start).astype(float)
    tiles = np.ceil(tok / tile_tokens) * (tile_tokens // 64)
    items = plan.num_chunks * ipc
    waves = items / NUM_SMS if exact_waves else np.ceil(items / NUM_SMS)
    return (max(tok.max(), waves * tok.sum() * ipc / items),
            max(tiles.max(), waves * tiles.sum() * ipc / items), np.ceil(items / NUM_SMS))


def featfn(base, fp8):
    def f(plan):
        x = base(plan).copy()
        tok = plan.chunk_end - plan.chunk_start
        if tok.size == 0 or tok.min() == tok.max():
            return x
        tile = T.build_tile_tokens(plan, fp8) if fp8 else 64
        t0, l0, _ = crit(plan, False, tile)
        t1, l1, sm_waves = crit(plan, True, tile)
        if t0 > 0:
            x[I["crit_us"]] *= t1 / t0
            x[I["lone_cta_us"]] *= t1 / t0
        if l0 > 0:
            x[I["crit_tiles"]] *= l1 / l0
            x[I["crit_tile_rows"]] *= l1 / l0
        return x
    return f


def main():
    runs = [("16-bit", C.RESULTS / "calibration" / "nvidia-h200.csv", C.EVAL_JSON,
             C.EVAL_PROFILE, False),
            ("fp8", C.RESULTS / "calibration" / "nvidia-h200.fp8.csv",
             C.RESULTS / "h200-planner-fp8.json",
             C.RESULTS / "calibration" / "nvidia-h200-fp8-s15.yaml", True)]
    for name, csv, js, prof, fp8 in runs:
        shapes, kv = C.load_eval_json(js, prof)
        base = (lambda plan: C.plan_features(plan.problem, plan.chunk_end - plan.chunk_start,
                                             plan.chunks_per_request, plan.strategy,
                                             num_sms=NUM_SMS, ctas_per_sm=2,
                                             bandwidth_gbps=C.BW, merge=plan.merge,
                                             tile_rule="fp8" if fp8 else ""))
        for variant, f in (("ceil", base), ("exact", featfn(base, fp8))):
            C.report_variant(f"{name} {variant:5s}", f, shapes, csv=csv)


if __name__ == "__main__":
    main()
