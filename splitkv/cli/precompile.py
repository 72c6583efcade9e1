"""``splitkv precompile``: compile ahead of time, with NVRTC and no GPU, every kernel a wrapper
of one configuration compiles in ``warmup()`` on the named architectures, into splitkv's cubin
cache (``$SPLITKV_CACHE_DIR/kernels``), where a later process loads them instead of compiling:
run it in a container image's build, and serving compiles nothing.

    splitkv precompile --arch sm_90 --heads 32/8 --head-dim 128 --page-size 16 --soft-cap
    splitkv precompile --arch sm_90,sm_100 --heads 64/8 --kv-dtype fp8_e4m3 --graph-stable
    splitkv precompile --heads 32/8 --dry-run --json       # this GPU's architecture, listed

A file already there (the same source, options, architecture and NVRTC) is kept; one that is
damaged is written again. ``--dry-run`` needs no NVRTC: without one it lists the modules by
label and architecture (a file's name hashes the NVRTC build that compiles it). A bad argument
is one line and exit status 2; a missing NVRTC, or a compile or write that fails, one line and
exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..core import validation as V
from ..core.variants import MAX_Q_LEN
from . import args as A
from . import cache as C


def arch_list(text: str) -> list[int]:
    """--arch: one architecture or a comma-separated list (sm_90, 90 or 9.0 each)."""
    from ..runtime.precompile_jobs import parse_arch

    parts = [p for p in text.split(",")]
    if not all(p.strip() for p in parts):
        raise argparse.ArgumentTypeError(f"expected architectures like sm_90 or sm_90,sm_100, "
                                         f"got {A.quote(text)}")
    try:
        return [parse_arch(p) for p in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--arch: ")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", type=arch_list, action="append", metavar="ARCH",
                        help="an architecture to compile for, like sm_90; repeat it or give a "
                             "comma-separated list (default: this machine's GPU's; required "
                             "without one)")
    parser.add_argument("--heads", type=A.heads, default=(32, 8), metavar="QO/KV",
                        help="query heads / kv heads (default 32/8)")
    parser.add_argument("--head-dim", type=A.head_dim, default=128,
                        help=f"one of {', '.join(map(str, V.SUPPORTED_HEAD_DIMS))} (default 128)")
    parser.add_argument("--page-size", type=A.positive_int, default=16, help="default 16")
    parser.add_argument("--dtype", choices=V.SUPPORTED_DTYPES, default="bfloat16",
                        help="q and output dtype (default bfloat16)")
    parser.add_argument("--kv-dtype", type=A.fp8_kv_dtype, default=None, metavar="FP8",
                        help="fp8 K/V (float8_e4m3fn, float8_e5m2, fp8_e4m3, fp8_e5m2); not at "
                             "head_dim 96")
    parser.add_argument("--soft-cap", action="store_true",
                        help="plans may take logits_soft_cap: compile the builds with and "
                             "without it (warmup(logits_soft_cap=True))")
    parser.add_argument("--max-q-len", type=A.int_range(1, MAX_Q_LEN), default=1, metavar="N",
                        help=f"query rows a request, 1 to {MAX_Q_LEN} (multi-token decode: "
                             "warmup(max_q_len=N), or a graph-stable wrapper's max_q_len)")
    parser.add_argument("--unified-max", action="store_true",
                        help="plans may take unified_max (per-shape wrappers)")
    parser.add_argument("--alibi", action="store_true",
                        help="plans may take alibi_slopes")
    parser.add_argument("--graph-stable", action="store_true",
                        help="a graph-stable wrapper (use_cuda_graph=True): its fixed grid's "
                             "builds and the planning kernel")
    parser.add_argument("--no-clusters", action="store_true",
                        help="a wrapper made with use_clusters=False")
    parser.add_argument("--jobs", type=A.int_range(1, 256), default=1, metavar="N",
                        help="compiles at once (default 1)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the files, compile and write nothing (without NVRTC: "
                             "the modules)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from ..runtime import nvrtc_available
    from ..runtime.cubin_cache import cubin_dir, nvrtc_build
    from ..runtime.precompile_jobs import (Configuration, arch_properties, known_arches,
                                           modules_for, precompile, unnamed)

    try:
        config = Configuration(*args.heads, args.head_dim, args.page_size, args.dtype,
                               args.kv_dtype, soft_cap=args.soft_cap, max_q_len=args.max_q_len,
                               unified_max=args.unified_max, graph_stable=args.graph_stable,
                               clusters=False if args.no_clusters else None, alibi=args.alibi)
    except (TypeError, ValueError) as exc:
        return A.refuse("precompile", f"--{_option(exc)}: {_after_name(exc)}")
    current, why = _current_gpu()
    arches = list(dict.fromkeys(cc for group in args.arch or () for cc in group))
    if not arches:
        if current is None:
            return A.refuse("precompile", f"--arch: expected the architectures to compile for "
                                          f"(like --arch sm_90; {known_arches()}): no GPU here "
                                          f"to take one from ({why})")
        arches = [current.cc]
    ok, nvrtc = nvrtc_available()
    if not ok and not args.dry_run:
        return A.unavailable("precompile", f"needs NVRTC, which does not load: {nvrtc}")
    from ..runtime.kernel_source import nvrtc_archs

    # a dry run without NVRTC lists the modules and touches NVRTC no further
    supported = nvrtc_archs() if ok else ()
    jobs, devices = [], {}
    for cc in arches:
        try:                      # splitkv's architectures first: NVRTC compiles for more
            devices[cc] = arch_properties(cc, current)
        except ValueError as exc:
            return A.refuse("precompile", exc)
        if supported and cc not in supported:
            return A.refuse("precompile", f"--arch: {nvrtc} compiles for "
                                          f"{', '.join(f'sm_{a}' for a in supported)}; got "
                                          f"sm_{cc}")
        jobs += [(*module, f"sm_{cc}") for module in modules_for(config, devices[cc])]
    folder = cubin_dir()
    if not ok:
        return _list_without_nvrtc(args, config, arches, folder, nvrtc, unnamed(jobs))
    t0 = time.perf_counter()
    try:
        records = precompile(jobs, folder, dry_run=args.dry_run, workers=args.jobs)
    except (RuntimeError, OSError) as exc:       # NVRTC's failure, or a folder not writable
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = (f" (splitkv's kernel cache {folder}, {C.cache_dir_source()})"
                 if isinstance(exc, OSError) else "")
        print(f"splitkv precompile: {A.one_line(first)}{where}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"cache": str(folder), "from": C.cache_dir_source(),
                          "nvrtc": nvrtc_build(), "configuration": config.to_dict(),
                          "arches": [f"sm_{cc}" for cc in arches], "dry_run": args.dry_run,
                          "modules": records, "seconds": round(seconds, 3)}, indent=2))
        return 0
    print(f"splitkv's kernel cache: {folder} ({C.cache_dir_source()}); {nvrtc}")
    print(f"{config.describe()}; {', '.join(f'sm_{cc}' for cc in arches)}")
    verbs = {"written": "wrote", "present": "already there:", "would write": "would write"}
    for r in records:
        size = f" ({r['bytes']:,} bytes, {r['seconds']:.1f} s)" if r["status"] == "written" else ""
        print(f"{verbs[r['status']]} {os.path.basename(r['path'])}{size}")
    counts = {status: sum(r["status"] == status for r in records) for status in verbs}
    if args.dry_run:
        print(f"would write {counts['would write']} of {len(records)} modules "
              f"({counts['present']} already there; --dry-run: nothing written)")
    else:
        print(f"wrote {counts['written']} of {len(records)} modules ({counts['present']} "
              f"already there) in {seconds:.1f} s")
    return 0


def _list_without_nvrtc(args, config, arches, folder, why: str, records: list[dict]) -> int:
    """A dry run where NVRTC does not load: the modules a run would compile, by label and
    architecture. A file's name hashes the NVRTC build that compiles it, so neither the name
    nor whether it is there can be told without one."""
    if args.json:
        print(json.dumps({"cache": str(folder), "from": C.cache_dir_source(), "nvrtc": None,
                          "nvrtc_error": why, "configuration": config.to_dict(),
                          "arches": [f"sm_{cc}" for cc in arches], "dry_run": True,
                          "modules": records, "seconds": 0.0}, indent=2))
        return 0
    print(f"splitkv's kernel cache: {folder} ({C.cache_dir_source()}); NVRTC does not load "
          f"here: {why}")
    print(f"{config.describe()}; {', '.join(f'sm_{cc}' for cc in arches)}")
    for r in records:
        print(f"would compile {r['label']} for {r['arch']}")
    print(f"would compile {len(records)} modules (--dry-run without NVRTC: the files are named "
          "by the NVRTC that compiles them, so which are already there is not known; nothing "
          "written)")
    return 0


def _option(exc: Exception) -> str:
    """The command-line option of a ``Configuration`` argument an error names."""
    name = str(exc).split(":", 1)[0]
    return {"num_qo_heads": "heads", "num_kv_heads": "heads", "unified_max": "unified-max",
            "kv_dtype": "kv-dtype"}.get(name, name.replace("_", "-"))


def _after_name(exc: Exception) -> str:
    text = str(exc)
    return text.split(":", 1)[1].strip() if ":" in text else text


def _current_gpu():
    """(this machine's GPU's ``DeviceProperties``, None), or (None, why there is none)."""
    try:
        from ..runtime import gpu_available

        ok, why = gpu_available()
        if not ok:
            return None, why
        from ..runtime.device_features import device_properties

        return device_properties(), ""
    except Exception as exc:         # a broken install: no GPU to take an architecture from
        return None, f"{type(exc).__name__}: {exc}"

