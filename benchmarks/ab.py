"""A/B runner: the same plan of each case timed under several settings of the kernel's knobs
(``DecodeExperiments``), the wrapper's options and plan()'s arguments, rounds interleaved in one
process, each timed like the bench (a CUDA graph over layers of >= 1 GiB of KV).

    PYTHONPATH=$PWD python3 benchmarks/ab.py --cases b32_n8k,d256_b8_n8k \\
        --set default= --set smem=q_in_smem=True --set regs=q_in_smem=False \\
        [--kv-dtype fp8_e4m3] [--rounds 2] [--plans planner] [--json FILE]

--set NAME=KEY=VALUE[,KEY=VALUE...] gives one setting (NAME= alone: every default); the first
is the baseline. VALUE is a Python literal (True, False, None, 3, 'early'), else the bare
string. KEY is a ``DecodeExperiments`` field (stages, max_registers, warps, pdl_trigger,
pdl_spread, q_in_smem, pow2_pages, rows_per_cta, tile_per_warp, compact_merge, dim_split),
``wrapper.OPTION`` (a ``BatchDecodeWrapper`` option: use_clusters, launch_order, pdl, profile,
use_cuda_graph, max_batch_size, max_num_pages, max_chunks; a graph-stable wrapper's capacity
defaults to the case's requests and pages) or ``plan.ARG`` (a ``plan()`` argument:
unified_max, logits_soft_cap).

--cases: case names and groups of splitkv/bench/cases.py ('standard', the default; 'classes'),
ragged_b256 (256 log-normal lengths), or [dD_][pP_][gG_][hkK_]bB_nN: B requests of N tokens
(N8k = 8192), head_dim D (128), page size P (16), K kv heads (8) and G query heads each (4);
rB_nN: B ragged lengths around N (``calibration.sweep.ragged_lengths``, seed 0).

--plans (comma-separated; a line each per case): planner (the plan the baseline's wrapper
chooses, run by every setting), own (each setting's wrapper runs its own choice, shown where
it differs), single, STRATEGY/N (the planner forced to N splits a request), STRATEGY:T
(chunks of T tokens, ``plan_chunk_tokens``); STRATEGY: split_merge or fused.

A line a case and plan: the plan, then each setting's median us and its ratio to the baseline;
a setting that does not build or launch for a case says so and is left out. --json FILE
writes the rows after a header: device, date, git commit, command line. What the knobs
measured, kept and rejected: docs/design/kernel.md, docs/design/rejected.md.

Examples (prefix each with PYTHONPATH=$PWD python3 benchmarks/ab.py):

  q's fragments in shared memory against registers (head_dim 256 spills without it):
    --cases d256_b8_n8k,b32_n8k,b1_n32k,d256_g2_b1_n32k,d256_g2_b32_n4k \\
      --set regs=q_in_smem=False --set smem=q_in_smem=True [--kv-dtype fp8_e4m3]
  the page walk by shift and mask against division, small pages:
    --cases p1_b8_n8k,b32_n8k,p1_b1_n32k,d64_p1_b32_n4k,d64_p2_b32_n4k \\
      --set divide=pow2_pages=False --set shift=pow2_pages=True
  128-token tiles at 4 warps for rows of 128 bytes (16-bit head_dim 64; fp8 head_dim 128 with
  --kv-dtype fp8_e4m3 --cases b1_n32k,b8_n8k,b8_n32k,b32_n2k,b32_n8k,b128_n2k,ragged_b32):
    --cases d64_b64_n4k,d64_b64_n2600,d64_b8_n7790,d64_b256_n1k,d64_b1_n32k --set default= \\
      --set t128=tile_per_warp=32 --set t128_r168=tile_per_warp=32,max_registers=168 \\
      --set t64=tile_per_warp=16
  warps a CTA:
    --cases classes --set default= --set w4=warps=4 --set w8=warps=8 [--kv-dtype fp8_e4m3]
  occupancy (CTAs an SM) through stages and the register cap, head_dim 128 and 64:
    --cases short_b256_n384,b32_n2k,b128_n2k,b512_n200,b128_n768 --set default= \\
      --set 3_an_sm=stages=2,max_registers=168 --set 2_stages=stages=2
    --cases d64_b64_n4k,d64_b64_n2600,d64_b8_n7790,d64_b256_n1k --set default= \\
      --set 4_an_sm=stages=3,max_registers=128 --set 3_an_sm=stages=4,max_registers=0 \\
      --set 2_an_sm=stages=5
  programmatic dependent launch off and on, each trigger, spread or not:
    --cases b1_n1k,b1_n8k,b1_n32k,g8_b1_n32k --rounds 3 --set plain=wrapper.pdl=False \\
      --set early=wrapper.pdl=True,pdl_trigger=early --set late=wrapper.pdl=True,pdl_trigger=late \\
      --set early_spread=wrapper.pdl=True,pdl_trigger=early,pdl_spread=True \\
      --set late_spread=wrapper.pdl=True,pdl_trigger=late,pdl_spread=True
  launch order of a ragged grid, on the planner's plan, no split and 1024-token chunks:
    --cases ragged_b32,ragged_b256,r16_n4k,r64_n2k,r128_n1k --plans planner,single,fused:1024 \\
      --rounds 3 --set plan=wrapper.launch_order=plan \\
      --set longest_requests=wrapper.launch_order=longest_requests \\
      --set longest_chunks=wrapper.launch_order=longest_chunks
  large GQA groups over more CTAs a kv head:
    --cases g32_b32_n8k,g16_b8_n8k,g32_hk2_b1_n32k,g32_hk1_b8_n8k \\
      --set rows64= --set rows32=rows_per_cta=32 --set rows16=rows_per_cta=16
  head_dim 256 with O's dims split between warp pairs:
    --cases d256_b8_n8k,b32_n8k,d256_g2_b1_n32k,d256_g2_b32_n4k,d256_g4_b8_n8k --set default= \\
      --set dim_split=dim_split=2 --set dim_split_regs=dim_split=2,q_in_smem=False
  the merge kernel over the split requests only (fused on the same chunks beside):
    --cases ragged_b32,b1_n32k,r400_n142 --plans split_merge:2048,fused:2048 \\
      --set whole= --set compact=compact_merge=True
  graph-stable wrappers against per-shape plans, each planning its own:
    --cases b1_n1k,b1_n8k,b1_n32k,b8_n8k,g8_b1_n32k,b32_n2k --plans own --set shape= \\
      --set stable=wrapper.use_cuda_graph=True \\
      --set stable_nopdl=wrapper.use_cuda_graph=True,wrapper.pdl=False \\
      --set stable_spread=wrapper.use_cuda_graph=True,pdl_spread=True
    (with --kv-dtype fp8_e4m3, and pdl_spread=False beside: the spread rule for fp8; a
    capacity of more requests: wrapper.max_batch_size=256)
  the unified max against the running max (phi in natural-log units of the scaled scores;
  about 19 fits the bench's random 16-bit data, phi - 60 makes every CTA fall back):
    --cases b1_n32k,b32_n8k --set running= --set unified=plan.unified_max=19.0 \\
      --set phi_off=plan.unified_max=-41.0
  thread-block clusters against the atomic ticket for fused merges:
    --cases b1_n8k,b1_n32k,g8_b1_n32k --set clusters= --set ticket=wrapper.use_clusters=False
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np

from splitkv.bench.cases import CASE_GROUPS, CLASS_CASES, STANDARD_CASES, Case, \
    ragged_b256_lengths, select
from splitkv.bench.experiments_ab import PLAN_OPTIONS, WRAPPER_OPTIONS, Setting, \
    run_ab, wrapper_options
from splitkv.runtime.experiments import DecodeExperiments

ROOT = Path(__file__).resolve().parents[1]
KNOBS = tuple(f.name for f in fields(DecodeExperiments))
STRATEGIES = ("split_merge", "fused")
_SHAPE = re.compile(r"(?P<kind>[br])(?P<batch>[1-9]\d*)_n(?P<tokens>[1-9]\d*)(?P<k>k?)")
_DIM = re.compile(r"(d|p|g|hk)([1-9]\d*)")


def generic_case(name: str) -> Case | None:
    """The case [dD_][pP_][gG_][hkK_](b|r)B_nN[k] names (the prefixes in any order), or None."""
    from splitkv.calibration.sweep import ragged_lengths

    parts = name.split("_")
    shape = _SHAPE.fullmatch("_".join(parts[-2:]))
    if len(parts) < 2 or not shape:
        return None
    dims = {"d": 128, "p": 16, "g": 4, "hk": 8}
    given = set()
    for part in parts[:-2]:
        m = _DIM.fullmatch(part)
        if not m or m[1] in given:
            return None
        given.add(m[1])
        dims[m[1]] = int(m[2])
    batch, tokens = int(shape["batch"]), int(shape["tokens"]) * (1024 if shape["k"] else 1)
    lens = (ragged_lengths(batch, tokens, np.random.default_rng(0)) if shape["kind"] == "r"
            else np.full(batch, tokens))
    return Case(name, tuple(int(n) for n in lens), dims["g"] * dims["hk"], dims["hk"],
                dims["d"], dims["p"])


def select_cases(text: str) -> list[Case]:
    """--cases: named cases and groups, ragged_b256, generic names; ValueError if unknown."""
    from splitkv.core.problem import DecodeProblem
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    named = {c.name for c in STANDARD_CASES + CLASS_CASES} | set(CASE_GROUPS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no case in {text!r}")
    out = []
    for name in names:
        if name in named:
            found = select(name)
        elif name == "ragged_b256":
            found = [Case(name, tuple(int(n) for n in ragged_b256_lengths()))]
        else:
            case = generic_case(name)
            if case is None:
                raise ValueError(
                    f"unknown case {name!r}; known: groups {sorted(CASE_GROUPS)}, cases "
                    f"{sorted(named - set(CASE_GROUPS))}, ragged_b256, or "
                    "[dD_][pP_][gG_][hkK_](b|r)B_nN[k]")
            try:        # the shape's checks, before any GPU work
                DecodeProblem(np.asarray(case.kv_lens), case.num_qo_heads, case.num_kv_heads,
                              case.head_dim, case.page_size)
                BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim,
                                   case.page_size)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}: {exc}") from None
            found = [case]
        out += [c for c in found if c not in out]
    return out


def literal(text: str):
    """A setting's value: a Python literal, else the bare string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_setting(text: str) -> tuple[str, Setting]:
    """--set NAME=KEY=VALUE[,KEY=VALUE...] (or NAME=) -> (NAME, Setting); ValueError if
    malformed or a key unknown."""
    name, sep, body = text.partition("=")
    if not sep or not name.strip():
        raise ValueError("expected NAME=KEY=VALUE[,KEY=VALUE...] or NAME= (every default)")
    knobs, wrapper, plan = {}, {}, {}
    prefixed = {"wrapper": (wrapper, WRAPPER_OPTIONS), "plan": (plan, PLAN_OPTIONS)}
    for item in (i.strip() for i in body.split(",")):
        if not item:
            continue
        key, sep, raw = (s.strip() for s in item.partition("="))
        if not sep or not raw:
            raise ValueError(f"{item!r}: expected KEY=VALUE")
        group, _, option = key.partition(".")
        if option and group in prefixed:
            target, allowed = prefixed[group]
        else:
            target, allowed, option = knobs, KNOBS, key
        if option not in allowed:
            raise ValueError(f"unknown key {key!r}; expected one of {list(KNOBS)}, "
                             f"wrapper.{{{','.join(WRAPPER_OPTIONS)}}} or "
                             f"plan.{{{','.join(PLAN_OPTIONS)}}}")
        if option in target:
            raise ValueError(f"{key!r} given twice")
        target[option] = literal(raw)
    for option, value in plan.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"plan.{option}: expected a number or None, got {value!r}")
    if "profile" in wrapper and not Path(str(wrapper["profile"])).is_file():
        raise ValueError(f"wrapper.profile: no file {wrapper['profile']!r}")
    try:
        experiments = DecodeExperiments(**knobs) if knobs else None
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    return name.strip(), Setting(experiments, wrapper, plan)


def check_setting(setting: Setting, cases, kv_dtype) -> None:
    """ValueError if the setting's wrapper builds for none of ``cases`` (host checks only)."""
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    error = None
    for case in cases:
        pages = sum(-(-n // case.page_size) for n in case.kv_lens)
        try:
            BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, case.head_dim,
                               case.page_size, kv_dtype=kv_dtype,
                               **wrapper_options(setting, len(case.kv_lens), pages))
            return
        except (TypeError, ValueError) as exc:
            error = error or exc
    raise ValueError(f"builds for none of the cases: {error}")


def parse_plans(text: str) -> list[str]:
    """--plans: planner, own, single, STRATEGY/N, STRATEGY:T; ValueError if malformed."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    for spec in specs:
        m = re.fullmatch(r"(\w+)[/:]([1-9]\d*)", spec)
        if spec not in ("planner", "own", "single") and not (m and m[1] in STRATEGIES):
            raise ValueError(f"{spec!r}: expected planner, own, single, STRATEGY/N or "
                             f"STRATEGY:TOKENS with STRATEGY one of {STRATEGIES}")
    if not specs:
        raise ValueError(f"no plan in {text!r}")
    return specs


def timing_for(case: Case, spec: str) -> dict:
    """``run_ab``'s plan arguments for one --plans entry."""
    from splitkv.core.plan import plan_chunk_tokens
    from splitkv.core.problem import DecodeProblem

    if spec == "planner":
        return {}
    if spec == "own":
        return {"own_plans": True}
    if "/" in spec:
        strategy, n = spec.split("/")
        return {"plan_args": {"num_splits": int(n), "strategy": strategy}}
    problem = DecodeProblem(np.asarray(case.kv_lens), case.num_qo_heads, case.num_kv_heads,
                            case.head_dim, case.page_size)
    plan = None
    if spec != "single":
        strategy, tokens = spec.split(":")
        plan = plan_chunk_tokens(problem, int(tokens), strategy,
                                 align=64 if int(tokens) >= 64 else 16)
    if plan is None or plan.num_splits == 1:       # chunks that split no request: no split
        plan = plan_chunk_tokens(problem, 1 << 30, "single")
    return {"plan": plan}


def git_commit() -> str | None:
    """This tree's commit, "(modified)" after it where tracked files changed; None outside git."""
    if not (ROOT / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + (" (modified)" if status.stdout.strip() else "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="standard",
                        help="comma-separated case names or groups (default: %(default)s)")
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        metavar="NAME=KEY=VALUE[,KEY=VALUE...]",
                        help="a setting; two or more, the first the baseline")
    parser.add_argument("--plans", default="planner",
                        help="planner, own, single, STRATEGY/N, STRATEGY:T (default: %(default)s)")
    parser.add_argument("--kv-dtype", default=None, help="fp8 K/V: fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)

    from splitkv.core import fp8

    try:
        fmt = fp8.fp8_format("--kv-dtype", args.kv_dtype)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    try:
        cases = select_cases(args.cases)
    except ValueError as exc:
        parser.error(f"--cases: {exc}")
    try:
        plans = parse_plans(args.plans)
    except ValueError as exc:
        parser.error(f"--plans: {exc}")
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if len(args.settings) < 2:
        parser.error("--set: give two settings or more (the first is the baseline)")
    settings = {}
    for text in args.settings:
        try:
            name, setting = parse_setting(text)
            if name in settings:
                raise ValueError(f"the name {name!r} is given twice")
            check_setting(setting, cases, fmt)
        except ValueError as exc:
            parser.error(f"--set {text}: {exc}")
        settings[name] = setting

    from splitkv.runtime import device_info

    device = device_info()["name"]
    baseline = next(iter(settings))
    print(f"{device}, K/V {fmt or 'bfloat16'}, {args.rounds} rounds; baseline {baseline}; "
          + "; ".join(f"{name}: {text.partition('=')[2] or 'defaults'}"
                      for name, text in zip(settings, args.settings)), flush=True)
    rows = []
    header = {"device": device, "date": datetime.date.today().isoformat(), "commit": git_commit(),
              "command": shlex.join(["python3", *sys.argv]), "kv_dtype": fmt or "bfloat16",
              "rounds": args.rounds, "baseline": baseline,
              "settings": {name: text.partition("=")[2]
                           for name, text in zip(settings, args.settings)}}
    for case in cases:
        for spec in plans:
            for case_, plan, us, ran in run_ab([case], lambda c: settings, kv_dtype=fmt,
                                               rounds=args.rounds, **timing_for(case, spec)):
                base = us.get(baseline)
                row = {"case": case_.name, "batch": len(case_.kv_lens),
                       "tokens": int(sum(case_.kv_lens)), "num_qo_heads": case_.num_qo_heads,
                       "num_kv_heads": case_.num_kv_heads, "head_dim": case_.head_dim,
                       "page_size": case_.page_size, "plan_spec": spec,
                       "plan": f"{plan.strategy}/{plan.num_splits}",
                       "num_chunks": int(plan.num_chunks),
                       "us": {k: round(v, 3) for k, v in us.items()},
                       "ratio": {k: round(v / base, 4) if base else None for k, v in us.items()}}
                if ran:
                    row["own_plans"] = {k: f"{p.strategy}/{p.num_splits}" for k, p in ran.items()}
                rows.append(row)
        if args.json:           # after each case, so that a run cut off keeps what it timed
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
