"""Session 15: does a term in the merge kernel's grid explain split_merge's misses? The merge
kernel runs a thread per (request, query head, 4 dims) of the whole batch, split or not
(merge_partials), so a batch of 256 x 32 heads launches 2,048 CTAs however few requests split;
the merge_cost probe measured 4-10 us of merge kernel at 128-256 requests. The model's merge
terms (launches, merge_chain) are per call. The column (now the library's merge_grid, which this
prototyped as CTAs over 16 an SM: the same fit up to its unit): split_merge plans that merge
only, the merge grid's CTAs per SM. Fitted on the 16-bit sweep without it and with it, scored
on the eval's measured candidates (the model's argmin among them).

    PYTHONPATH=$PWD python3 benchmarks/offline/s15_merge_grid.py
"""
import s13_common as C
from splitkv.planner.cost_model import FEATURE_NAMES

MERGE_GRID = FEATURE_NAMES.index("merge_grid")


def without_merge_grid(plan):
    x = C.lib_features(plan)
    return x[[i for i in range(x.size) if i != MERGE_GRID]]


def main():
    shapes = C.load_eval()
    for name, f in (("without", without_merge_grid), ("merge_grid", C.lib_features)):
        rep, _ = C.report_variant(f"{name:10s}", f, shapes)
        if name == "merge_grid":
            print(f"    merge_grid's coefficient: {rep['coef'][MERGE_GRID]:.3f} us")


if __name__ == "__main__":
    main()
