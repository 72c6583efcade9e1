"""Offline planner evaluation with the library's own choose_plan (no GPU): for each of the 68
shapes of results/h200-planner.json, the plan a profile's model chooses is matched to a measured
candidate of the same strategy and chunk boundaries; its measured time over the best measured
candidate is the ratio. A choice that no candidate measured is reported as such, not scored.

    PYTHONPATH=$PWD python3 benchmarks/offline/s13_choose_plan_eval.py PROFILE.yaml [...]
"""
import sys

from s13_common import load_eval
from s15_eval import evaluate


if __name__ == "__main__":
    shapes = load_eval()
    for path in sys.argv[1:]:
        evaluate(path, shapes, None)     # s15_eval's, for the 16-bit fit
