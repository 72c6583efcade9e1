"""Host time of ``choose_plan``, in microseconds: the median over many calls after a warm-up.

The bar: planning a ragged batch of 256 requests takes well under 100 us of CPU time (the
planner runs on every decode step). Cases: the standard ragged_b32, the 256 ragged
requests of tests/planner/test_planner.py (uniform 1..32767, seed 0), and 256 log-normal lengths
(16..32k: many short requests, a few long ones). 32 query / 8 kv heads, head_dim 128, page
size 16, the shipped H200 profile.

Shared or virtual machines drift by 1.5-2x for seconds at a time, so the calls run in rounds
and the lowest round median is printed next to the overall median; compare two versions of
the code in one process, interleaved, rather than across runs.

    PYTHONPATH=. python3 benchmarks/plan_cost.py [--repeats 2000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from splitkv import DecodeProblem
from splitkv.bench.cases import RAGGED_B32, ragged_b256_lengths
from splitkv.planner import choose_plan, load_profile

PROFILE = Path(__file__).resolve().parents[1] / "splitkv/planner/profiles/nvidia-h200.yaml"


def cases() -> dict[str, np.ndarray]:
    return {
        "ragged_b32": np.array(RAGGED_B32),
        "ragged_b256 (uniform)": np.random.default_rng(0).integers(1, 32768, 256),
        "ragged_b256 (lognormal)": ragged_b256_lengths(),
    }


def time_us(problem: DecodeProblem, profile, repeats: int, rounds: int) -> tuple[float, float]:
    """(median, lowest round median) of ``repeats`` calls in ``rounds`` rounds."""
    for _ in range(max(repeats // 10, 50)):              # warm-up: caches, lru_caches
        choose_plan(problem, profile)
    samples = np.empty((rounds, max(repeats // rounds, 1)))
    for row in samples:
        for i in range(row.size):
            t0 = time.perf_counter_ns()
            choose_plan(problem, profile)
            row[i] = time.perf_counter_ns() - t0
    return float(np.median(samples)) / 1e3, float(np.median(samples, axis=1).min()) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    profile = load_profile(PROFILE)
    for name, lens in cases().items():
        problem = DecodeProblem(lens, 32, 8, 128, 16)
        plan = choose_plan(problem, profile)
        median, best = time_us(problem, profile, args.repeats, args.rounds)
        print(f"{name:<24} median {median:6.1f} us (best round {best:6.1f} us)   "
              f"{plan.strategy}, {plan.num_chunks} chunks, predicted {plan.predicted_us:.1f} us")


if __name__ == "__main__":
    main()
