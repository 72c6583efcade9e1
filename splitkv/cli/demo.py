"""``splitkv demo``: plan and run a few realistic decode batches, check them against the reference.

The cases and the check are ``splitkv.demo``'s; this prints them as a table.
"""

from __future__ import annotations

import argparse
import sys

from ..demo import CASE_NAMES, TOLERANCE, check_cases, detect_gpu, make_cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--cases", default=",".join(CASE_NAMES),
                        help=f"comma-separated cases to run (default: all of {','.join(CASE_NAMES)})")
    parser.add_argument("--cpu", action="store_true",
                        help="use the CPU plan executor even when a GPU is usable")


def run(args: argparse.Namespace) -> int:
    wanted = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(CASE_NAMES))
    if unknown or not wanted:
        print(f"splitkv demo: unknown case(s) {', '.join(unknown) or '(none given)'}; "
              f"expected some of {', '.join(CASE_NAMES)}", file=sys.stderr)
        return 2
    cases = [case for case in make_cases(args.seed) if case.name in wanted]
    on_gpu, reason = (False, "--cpu was given") if args.cpu else detect_gpu()
    out_tol, lse_tol = TOLERANCE["gpu" if on_gpu else "cpu"]
    print("plans from " + ("BatchDecodeWrapper.plan(page_table)" if on_gpu
                           else "splitkv.planner.choose_plan (the shipped H200 profile)"))

    header = ("case", "B", "heads", "tokens", "strategy", "splits", "work items", "max rel err",
              "lse err", "")
    results = check_cases(cases, args.seed, on_gpu)
    rows = [(r.case.name, str(r.page_table.batch_size),
             f"{r.case.num_qo_heads}/{r.case.num_kv_heads}", str(int(r.page_table.kv_lens.sum())),
             r.plan.strategy, str(r.plan.num_splits), str(r.plan.num_work_items),
             f"{r.rel_err:.2e}", f"{r.lse_err:.2e}", "ok" if r.ok else "FAIL")
            for r in results]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) if i in (0, 4) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    failed = sum(not r.ok for r in results)
    print(f"tolerance: rel err <= {out_tol:g}, lse err <= {lse_tol:g}; "
          f"{len(rows) - failed} of {len(rows)} cases within it")
    print(f"ran on the GPU: {reason}" if on_gpu else f"ran on the CPU fallback: {reason}")
    return 1 if failed else 0
