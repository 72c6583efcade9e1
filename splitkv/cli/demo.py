"""``splitkv demo``: plan and run a few realistic decode batches, check them against the reference.

The cases and the check are ``splitkv.demo``'s; this prints them as a table.
"""

from __future__ import annotations

import argparse
import sys

from ..demo import CASE_NAMES, TOLERANCE, check_cases, detect_gpu, make_cases
from . import args as A


def _cases(text: str) -> list[str]:
    """Some of ``CASE_NAMES``, comma-separated."""
    wanted = [name.strip() for name in text.split(",")]
    if "" in wanted and any(wanted):
        raise argparse.ArgumentTypeError(f"entry {wanted.index('')} of {A.quote(text)} is "
                                         f"empty; expected some of {', '.join(CASE_NAMES)}")
    wanted = [name for name in wanted if name]
    unknown = sorted(set(wanted) - set(CASE_NAMES))
    if unknown or not wanted:
        shown = ", ".join(map(A.quote, unknown[:5])) + (" ..." if len(unknown) > 5 else "")
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {shown or '(none given)'}; expected some of {', '.join(CASE_NAMES)}")
    return wanted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=A.non_negative_int, default=0,
                        help="seed of the random inputs (default 0)")
    parser.add_argument("--cases", type=_cases, default=list(CASE_NAMES),
                        help=f"comma-separated cases to run (default: all of {','.join(CASE_NAMES)})")
    parser.add_argument("--cpu", action="store_true",
                        help="use the CPU plan executor even when a GPU is usable")


def run(args: argparse.Namespace) -> int:
    cases = [case for case in make_cases(args.seed) if case.name in args.cases]
    on_gpu, reason = (False, "--cpu was given") if args.cpu else detect_gpu()
    out_tol, lse_tol = TOLERANCE["gpu" if on_gpu else "cpu"]
    if on_gpu:
        print("plans from BatchDecodeWrapper.plan(page_table) (the profile splitkv picks for "
              "this GPU)")
    else:          # choose_plan's default: the reference device's profile, as looked up
        from ..planner.profile_lookup import default_profile

        profile = default_profile()
        print(f"plans from splitkv.planner.choose_plan ({profile.device_name}'s profile: "
              f"{profile.origin})")

    header = ("case", "B", "heads", "tokens", "strategy", "splits", "work items", "max rel err",
              "lse err", "")
    if not on_gpu and getattr(sys.stderr, "isatty", lambda: False)():   # say why the wait
        print(f"note: running {len(cases)} case(s) on the CPU executor in float64 (seconds; "
              f"the table comes when all are done)", file=sys.stderr, flush=True)
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
