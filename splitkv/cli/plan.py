"""``splitkv plan``: the plan the planner chooses for a batch, its predicted time, and the
runners-up. Runs anywhere (no GPU): it plans for the profile it finds, the reference H200's by
default.

    splitkv plan --batch 8 --kv-len 8192 --heads 32/8 --head-dim 128 --page-size 16
    splitkv plan --lens 100,2000,30000 --profile my-gpu.yaml --top 8
"""

from __future__ import annotations

import argparse
import sys
import warnings

import numpy as np

from ..core import validation as V


def _heads(text: str) -> tuple[int, int]:
    try:
        hq, hk = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected QO/KV heads like 32/8, got {text!r}") from None
    return hq, hk


def _lens(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts like 100,2000,30000, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=1, help="requests (default 1)")
    parser.add_argument("--kv-len", type=int, default=8192,
                        help="tokens of KV per request (default 8192)")
    parser.add_argument("--lens", type=_lens, metavar="N,N,...",
                        help="one length per request (a ragged batch); overrides --batch/--kv-len")
    parser.add_argument("--heads", type=_heads, default=(32, 8), metavar="QO/KV",
                        help="query heads / kv heads (default 32/8)")
    parser.add_argument("--head-dim", type=int, default=128, help="default 128")
    parser.add_argument("--page-size", type=int, default=16, help="default 16")
    parser.add_argument("--profile", metavar="PATH", help="a profile YAML (default: looked up)")
    parser.add_argument("--device-name", metavar="NAME",
                        help="plan for this GPU (e.g. 'NVIDIA H100 80GB HBM3'); default the H200")
    parser.add_argument("--num-sms", type=int, metavar="N", help="its SM count")
    parser.add_argument("--num-splits", type=int, metavar="N", help="force this split count")
    parser.add_argument("--strategy", choices=V.STRATEGIES, help="force this strategy")
    parser.add_argument("--top", type=int, default=5, help="candidates to list (default 5)")


def run(args) -> int:
    from ..planner import ProfileError, load_profile, rank_candidates
    from ..core.problem import DecodeProblem

    lens = args.lens if args.lens is not None else [args.kv_len] * args.batch
    try:
        problem = DecodeProblem(np.asarray(lens, dtype=np.int64), args.heads[0], args.heads[1],
                                args.head_dim, args.page_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            profile = load_profile(args.profile, device_name=args.device_name,
                                   num_sms=args.num_sms)
        ranked = rank_candidates(problem, profile, args.num_splits, args.strategy)
    except (TypeError, ValueError, ProfileError) as exc:
        print(f"splitkv plan: {exc}", file=sys.stderr)
        return 2
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)

    plan = ranked[0].build(problem, clusters=profile.cost_model().clusters)
    print(f"problem:   {problem!r}")
    print(f"profile:   {profile.device_name}, {profile.num_sms} SMs "
          f"({profile.source or 'unknown'}; {profile.origin})")
    print(f"plan:      {plan!r}")
    kv_mib = problem.kv_bytes / 2**20
    rate = problem.kv_bytes / plan.predicted_us / 1e3 if plan.predicted_us else 0.0
    print(f"predicted: {plan.predicted_us:.2f} us for {kv_mib:,.1f} MiB of K and V "
          f"({rate:,.0f} GB/s)")
    print(f"merge:     {plan.execution.describe()}")
    print(f"top {min(args.top, len(ranked))} of {len(ranked)} candidates:")
    for c in ranked[: args.top]:
        print(f"  {c}")
    return 0
