"""``splitkv plan``: the plan the planner chooses for a batch, its predicted time, and the
runners-up. Runs anywhere (no GPU): it plans for the profile it finds, the reference H200's by
default.

    splitkv plan --batch 8 --kv-len 8192 --heads 32/8 --head-dim 128 --page-size 16
    splitkv plan --lens 100,2000,30000 --profile my-gpu.yaml --top 8
    splitkv plan --kv-len 131072 --window-left 4095        # a sliding window: its tokens only
    splitkv plan --kv-len 131072 --attention-chunk-size 8192   # chunked attention: the last chunk
    splitkv plan --batch 8 --q-len 4 --kv-dtype fp8_e4m3   # 4 query rows a request, fp8 K/V
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

from .._log import caught_notices
from ..core import validation as V
from ..core.geometry import TILE_TOKENS
from ..core.variants import MAX_Q_LEN, covering_window_left, read_begin
from . import args as A


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=A.batch_size, default=1,
                        help=f"requests (default 1, at most {A.MAX_BATCH:,})")
    parser.add_argument("--kv-len", type=A.tokens, default=8192,
                        help="tokens of KV per request (default 8192)")
    parser.add_argument("--lens", type=A.lengths, metavar="N,N,...",
                        help="one length per request (a ragged batch); overrides --batch/--kv-len")
    parser.add_argument("--heads", type=A.heads, default=(32, 8), metavar="QO/KV",
                        help="query heads / kv heads (default 32/8)")
    parser.add_argument("--head-dim", type=A.head_dim, default=128,
                        help=f"one of {', '.join(map(str, V.SUPPORTED_HEAD_DIMS))} (default 128)")
    parser.add_argument("--page-size", type=A.positive_int, default=16, help="default 16")
    parser.add_argument("--window-left", type=A.int_range(-1, V.MAX_KV_LEN), default=-1,
                        metavar="N", help="sliding window: each query sees its last N + 1 tokens "
                                          "and the plan covers only those (default -1: none)")
    parser.add_argument("--attention-chunk-size", type=A.int_range(0, V.MAX_KV_LEN), default=0,
                        metavar="N", help="chunked local attention: each query sees the keys of "
                                          "its own chunk of N tokens and the plan covers only "
                                          "those (default 0: none; one query row a request)")
    parser.add_argument("--q-len", type=A.int_range(1, MAX_Q_LEN), default=1, metavar="N",
                        help=f"query rows a request (multi-token decode, 1 to {MAX_Q_LEN}; "
                             "default 1): the kernel computes N x the query heads a kv head")
    parser.add_argument("--kv-dtype", type=A.fp8_kv_dtype, default=None, metavar="FP8",
                        help="plan for fp8 K/V (float8_e4m3fn, float8_e5m2, fp8_e4m3, fp8_e5m2) "
                             "with the profile's fp8 fit, where it has one; not at head_dim 96")
    parser.add_argument("--profile", type=A.existing_file, metavar="PATH",
                        help="a profile YAML (default: looked up)")
    parser.add_argument("--device-name", type=A.name, metavar="NAME",
                        help="plan for this GPU (e.g. 'NVIDIA H100 80GB HBM3'): its profile is "
                             "looked up, or the one given checked against it; default: the "
                             "given profile's GPU, else the H200")
    parser.add_argument("--num-sms", type=A.positive_int, metavar="N", help="its SM count")
    parser.add_argument("--num-splits", type=A.int_range(1, MAX_CHUNKS), metavar="N",
                        help="force this split count (a request shorter than N tiles of "
                             f"{TILE_TOKENS} tokens gets one chunk per tile)")
    parser.add_argument("--strategy", choices=V.STRATEGIES, help="force this strategy")
    parser.add_argument("--top", type=A.positive_int, default=5,
                        help="candidates to list (default 5)")


MAX_CHUNKS = 2**22   # chunks a forced split count may make from the command line (host arrays)


def _forced_chunks(lens: np.ndarray, num_splits: int) -> int:
    """Chunks ``--num-splits`` makes: plan_from_chunk_counts' rule, at most one per tile."""
    return int(np.minimum(num_splits, np.maximum(1, -(-lens // TILE_TOKENS))).sum())


def _splits_used(plan, asked: int) -> str | None:
    """What a forced split count became, where the planner cut some request into fewer chunks
    (a chunk holds at least one tile); None where every request got ``asked``."""
    counts = plan.chunks_per_request
    if not counts.size or counts.min() == asked:
        return None
    low, high = int(counts.min()), int(counts.max())
    used = f"{high}" if low == high else f"{low}..{high} (by request)"
    return (f"{asked} asked, {used} used: a request is cut into at most one chunk per "
            f"{TILE_TOKENS}-token tile")


def run(args) -> int:
    from ..planner import ProfileError, load_profile, rank_candidates
    from ..planner.first_use import first_use_mode
    from ..planner.kin import kin_by_name, known_gpu
    from ..planner.profile_lookup import PRIOR_NOTICE
    from ..planner.planner import NUM_SPLITS
    from ..core.problem import DecodeProblem

    lens = np.asarray(args.lens if args.lens is not None else [args.kv_len] * args.batch,
                      dtype=np.int64)
    # several query rows: the kernel's rows are q_len x the heads, and the plan covers every
    # row's window (as BatchDecodeWrapper.plan plans them)
    window = (covering_window_left(args.window_left, args.q_len) if args.q_len > 1
              else args.window_left)
    begin = read_begin(lens, window, args.attention_chunk_size)
    read = lens if begin is None else lens - begin
    chunks = _forced_chunks(read, args.num_splits) if args.num_splits else 0
    if chunks > MAX_CHUNKS:
        return A.refuse("plan", f"--num-splits {args.num_splits}: the plan would have "
                                f"{chunks:,} chunks; the command line plans at most {MAX_CHUNKS:,}")
    try:
        V.check_head_dim_for_kv(args.head_dim, args.kv_dtype)
        if args.attention_chunk_size and args.q_len > 1:
            raise ValueError(f"--attention-chunk-size {args.attention_chunk_size} with --q-len "
                             f"{args.q_len}: chunked attention takes one query row a request")
        if args.heads[0] * args.q_len > V.MAX_HEADS:
            raise ValueError(f"--q-len {args.q_len}: {args.q_len} x {args.heads[0]} query heads "
                             f"= {args.heads[0] * args.q_len:,} exceed MAX_HEADS={V.MAX_HEADS:,}")
        if args.q_len > 1 and (lens < args.q_len).any():
            raise ValueError(f"--q-len {args.q_len}: a request has fewer tokens "
                             f"({int(lens.min())}) than query rows; its new tokens are the last "
                             "q_len of its KV")
        problem = DecodeProblem(lens, args.heads[0] * args.q_len, args.heads[1],
                                args.head_dim, args.page_size, window_left=window,
                                attention_chunk_size=args.attention_chunk_size)
        with caught_notices() as caught:
            # a GPU splitkv knows (core.architectures.GPU_SMS) has its own SM count
            known = known_gpu(args.device_name) if args.device_name else None
            num_sms = args.num_sms or (known[1] if known else None)
            profile = load_profile(args.profile, device_name=args.device_name,
                                   num_sms=num_sms)
        # what that GPU's first plan would take ($SPLITKV_FIRST_USE=off: the prior)
        if profile.is_prior and args.device_name and first_use_mode() != "off":
            kin = kin_by_name(args.device_name, num_sms)
            if kin is not None:              # the prior's notice no longer applies; the rest do
                profile = kin
                caught = [r for r in caught if not r.getMessage().startswith(PRIOR_NOTICE)]
        model = profile.cost_model(args.kv_dtype)
        if args.q_len > 1:                       # the builds' tiles of multi-token plans
            model = model.for_multi_token()
        ranked = rank_candidates(problem, model, args.num_splits, args.strategy)
        plan = ranked[0].build(problem, clusters=model.clusters)
    except (TypeError, ValueError, ProfileError) as exc:
        text = str(exc)          # the planner names its arguments; say the options given
        for name, option in (("strategy:", "--strategy:"), ("num_splits:", "--num-splits:"),
                             ("kv_dtype:", "--kv-dtype:")):
            if text.startswith(name):
                text = option + text[len(name):]
        return A.refuse("plan", text)
    for record in caught:
        print(f"note: {A.one_line(record.getMessage())}", file=sys.stderr)

    print(f"problem:   {problem!r}")
    if args.q_len > 1:
        covers = (f"; the window it covers is every row's, window_left={window}"
                  if args.window_left >= 0 else "")
        print(f"rows:      {args.q_len} query rows a request: the kernel computes "
              f"{args.q_len} x {args.heads[0]} query heads (the problem's heads){covers}")
    if args.kv_dtype:
        fit = ("the profile's fp8 fit" if profile.kv_fp8 is not None
               else "the profile's 16-bit fit: it has no fp8 fit (splitkv calibrate --kv-dtype)")
        print(f"kv dtype:  {args.kv_dtype} (one byte a value; planned with {fit})")
    print(f"profile:   {profile.device_name}, {profile.num_sms} SMs "
          f"({profile.source or 'unknown'}; {profile.origin})")
    print(f"plan:      {plan!r}")
    kv_bytes = problem.kv_bytes // 2 if args.kv_dtype else problem.kv_bytes   # fp8: a byte
    kv_mib = kv_bytes / 2**20
    rate = kv_bytes / plan.predicted_us / 1e3 if plan.predicted_us else 0.0
    print(f"predicted: {plan.predicted_us:.2f} us for {kv_mib:,.1f} MiB of K and V "
          f"({rate:,.0f} GB/s)")
    print(f"merge:     {plan.execution.describe()}")
    splits = _splits_used(plan, args.num_splits) if args.num_splits else None
    if splits:
        print(f"splits:    {splits}")
    print(f"top {min(args.top, len(ranked))} of {len(ranked)} candidates:")
    for c in ranked[: args.top]:
        if splits and c.kind == NUM_SPLITS:   # say what it cuts into, as the plan line does
            c = replace(c, value=plan.num_splits)
        print(f"  {c}")
    return 0
