"""`splitkv bench`: time the standard cases, compare with the read floor and the peers, and
write the results (JSON + a markdown table) with the date, the GPU and the command.

The harness is ``splitkv.bench.harness``; this parses, prints its progress and writes its result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..core.validation import STRATEGIES
from . import args as A


def _command_line() -> str:
    """How this run was started, with the profile override that decided its plans."""
    profile = os.environ.get("SPLITKV_PROFILE")
    return (f"SPLITKV_PROFILE={profile} " if profile else "") + "splitkv bench " + " ".join(sys.argv[1:])


def _cases(text: str) -> str:
    """Case names or groups, checked when parsed (not after the GPU starts)."""
    from ..bench.cases import select

    try:
        select(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--cases: ")) from None
    return text


def add_arguments(parser) -> None:
    parser.add_argument("--cases", type=_cases, default=None,
                        help="comma-separated case names, or groups: 'standard' (the 12 standard "
                             "decode cases, the default), 'classes' (head_dim 64/256, pages "
                             "1/64, groups 16/32, hundreds of short requests, a batch-1 request "
                             "of 3k tokens)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--kv-dtype", default=None, type=A.fp8_kv_dtype,
                        help="fp8 K/V: fp8_e4m3 (float8_e4m3fn) or fp8_e5m2 (float8_e5m2); "
                             "the floor then counts fp8 bytes")
    parser.add_argument("--min-total-mib", type=A.positive_int, default=1024,
                        help="KV bytes the layers hold together (sets the number of layers, 2..64)")
    parser.add_argument("--num-splits", type=A.positive_int, default=None,
                        help="force a split count")
    parser.add_argument("--strategy", default=None, choices=STRATEGIES)
    parser.add_argument("--no-peer", action="store_true", help="skip the PyTorch SDPA peer")
    parser.add_argument("--flashinfer", action="store_true",
                        help="also time FlashInfer's paged decode paths (XQA, tensor core, CUDA "
                             "core) on the same pages and K/V in this run; needs flashinfer "
                             "importable (on a machine without network, install its wheel beforehand)")
    parser.add_argument("--json", type=A.output_file, default=None,
                        help="write results to this JSON file")
    parser.add_argument("--markdown", type=A.output_file, default=None,
                        help="write a markdown table to this file")
    parser.add_argument("--seed", type=A.non_negative_int, default=0)
    parser.add_argument("--no-graph-stable", action="store_true",
                        help="skip timing each case through a graph-stable wrapper too")


def _log(line: str) -> None:
    print(line, flush=True)


def run(args) -> int:
    if args.strategy == "single" and (args.num_splits or 1) > 1:
        return A.refuse("bench", f"--strategy single cannot split a request; --num-splits "
                                 f"{args.num_splits} needs split_merge or fused")
    from ..runtime import gpu_available

    ok, why = gpu_available()
    if not ok:
        return A.unavailable("bench", f"needs a GPU ({why})")
    from ..bench.cases import select
    from ..bench.harness import markdown_table, run_cases

    if args.flashinfer:
        from ..bench.flashinfer_peer import flashinfer_available

        ok, why = flashinfer_available()
        if not ok:
            return A.unavailable("bench", f"--flashinfer: {why}")

    result = run_cases(select(args.cases), dtype=args.dtype, min_total_mib=args.min_total_mib,
                       num_splits=args.num_splits, strategy=args.strategy, peer=not args.no_peer,
                       seed=args.seed, command=_command_line(), log=_log,
                       graph_stable=not args.no_graph_stable, kv_dtype=args.kv_dtype,
                       flashinfer=args.flashinfer)
    table = markdown_table(result)
    print(table)
    for path in (args.json, args.markdown):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# splitkv bench on {result['device']}, {result['date']}\n\n"
                    f"Command: `{result['command']}`\n\n{table}\n")
    return 0
