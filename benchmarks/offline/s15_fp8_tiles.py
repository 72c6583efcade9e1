"""Session 15: do fp8's 128-token tiles explain its planner misses? The cost model counts
64-token tiles (crit_tiles, crit_tile_rows), but the default fp8 builds stream 128-token tiles
at head_dim 128 (4 warps x 32 tokens) and in every lone grid (8 warps x 16), and so do the
16-bit lone grids with 8 warps. Splitting a 100-token request then saves no tile, only adds a
merge: the fp8 eval's misses on 100-130-token shapes all chose a split over single.

Variant 'long': crit_tiles / crit_tile_rows count the tiles the default build runs (a
128-token tile as 2 of 64), everything else as the library computes it. Both are fitted on the
fp8 sweep (fit / held-out as fit_profile splits it) and scored on the fp8 eval's measured
candidates (argmin predicted among them).

    PYTHONPATH=$PWD python3 benchmarks/offline/s15_fp8_tiles.py [--kv 16]

It fits the library's columns as they are now: NOTES.md's table (59 -> 62 of 68) predates
merge_grid (057a373); with it the two variants score 60 and 63.
"""
import sys

import s13_common as C
from splitkv.core.geometry import ctas_per_kv_head, fp8_tile_tokens
from splitkv.planner.cost_model import FEATURE_NAMES
from splitkv.runtime.features import LONE_CTA_WARPS, LONG_CHUNK_TOKENS, row_step
from splitkv.runtime.kernel_source import row_tiles_for

NUM_SMS = 132
I_TILES, I_ROWS = FEATURE_NAMES.index("crit_tiles"), FEATURE_NAMES.index("crit_tile_rows")


def build_tile_tokens(plan, fp8):
    """Tokens of one tile of the build the wrapper would run the plan with (features.py's
    plan_warps and default_tile_per_warp, per-shape plans, one token a row)."""
    p = plan.problem
    group = p.num_qo_heads // p.num_kv_heads
    ctas = plan.num_work_items * ctas_per_kv_head(group)
    rt = row_tiles_for(group)
    lone = ctas <= NUM_SMS
    if fp8:
        return fp8_tile_tokens(p.head_dim, -(-group // ctas_per_kv_head(group)), lone)
    sizes = plan.chunk_end - plan.chunk_start
    issue_bound = rt >= 2 or p.page_size < row_step(p.head_dim, rt, 2)
    if lone and p.head_dim <= 128 and issue_bound and sizes.mean() >= LONG_CHUNK_TOKENS:
        return 16 * LONE_CTA_WARPS
    return 64


def crit_tiles(plan, tile):
    """max(largest chunk's tiles, SM waves x mean tiles), in 64-token tiles."""
    p = plan.problem
    ipc = plan.num_work_items // max(plan.num_chunks, 1) * ctas_per_kv_head(
        p.num_qo_heads // p.num_kv_heads)
    sizes = plan.chunk_end - plan.chunk_start
    tiles = -(-sizes // tile) * (tile // 64)
    items = plan.num_chunks * ipc
    sm_waves = -(-items // NUM_SMS)
    return max(tiles.max(), sm_waves * tiles.sum() * ipc / items)


def featfn(variant, fp8):
    def f(plan):
        x = C.lib_features(plan).copy()
        if variant == "long" and x[I_TILES] > 0:
            base = crit_tiles(plan, 64)
            long = crit_tiles(plan, build_tile_tokens(plan, fp8))
            x[I_TILES] *= long / base
            x[I_ROWS] *= long / base
        return x
    return f


def main():
    fp8 = "--kv" not in sys.argv
    csv = C.RESULTS / "calibration" / ("nvidia-h200.fp8.csv" if fp8 else "nvidia-h200.csv")
    js = C.RESULTS / ("h200-planner-fp8.json" if fp8 else "h200-planner.json")
    prof = C.RESULTS / "calibration" / "nvidia-h200-fp8-s15.yaml"
    shapes, _ = C.load_eval_json(js, prof)
    for variant in ("lib", "long"):
        rep, _ = C.report_variant(f"{variant:5s}", featfn(variant, fp8), shapes, csv=csv)
        print("      coef", {n: round(float(c), 3) for n, c in zip(FEATURE_NAMES, rep["coef"])
                             if c > 0})


if __name__ == "__main__":
    main()
