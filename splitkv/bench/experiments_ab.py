"""Timing one case's plan under several ``DecodeExperiments``, for the benchmarks' A/B scripts
(benchmarks/ab_*.py): one plan (the first setting's wrapper plans it), every setting running
that plan, rounds interleaved in one process, each timed like the bench (a graph over layers of
>= 1 GiB of KV)."""

from __future__ import annotations


def time_experiments(case, settings: dict, *, kv_dtype=None, rounds: int = 2,
                     dtype: str = "bfloat16", on_error=None, plan=None):
    """Returns (plan, {name: median us}) for ``settings`` ({name: DecodeExperiments or None}).
    ``plan``: the plan every setting runs (of the case's lengths); default: the one the first
    setting's wrapper chooses. A setting that does not build or launch for this shape is
    dropped, and ``on_error(name, exc)`` told, when given; else the error propagates."""
    import numpy as np

    from ..runtime.cupy_arrays import free_cached_blocks
    from ..runtime.testing import scattered_page_table
    from ..runtime.timing import make_layers, time_wrapper_us
    from ..runtime.wrapper import BatchDecodeWrapper

    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, *heads, dtype, min_total_bytes=1 << 30, seed=0, kv_dtype=kv_dtype)

    def guarded(name, fn):
        if on_error is None:
            return fn()
        try:
            return fn()
        except Exception as exc:          # a setting that does not fit this shape
            on_error(name, exc)
            return None

    wrappers = {}
    for name, experiments in settings.items():
        def make(experiments=experiments):
            w = BatchDecodeWrapper(*heads, case.page_size, dtype, kv_dtype=kv_dtype,
                                   experiments=experiments)
            w.plan(pt) if plan is None else w.plan(pt, plan=plan)
            return w
        w = guarded(name, make)
        if w is not None:
            wrappers[name] = w
            if plan is None:
                plan = w.current_plan
    times = {name: [] for name in wrappers}
    for _ in range(rounds):
        for name in list(wrappers):
            us = guarded(name, lambda: time_wrapper_us(wrappers[name], data))
            if us is None:
                del wrappers[name], times[name]
            else:
                times[name].append(us)
    data = wrappers = None                # their device memory back before the next case
    free_cached_blocks()
    return plan, {name: float(np.median(t)) for name, t in times.items()}


def ab_arguments(description: str, cases: str, kv_dtype: bool = True, **more):
    """The A/B scripts' command line: --cases (default ``cases``), --rounds, and --kv-dtype
    where the script takes fp8 K/V; ``more``: further options by name -> add_argument kwargs.
    Returns (args, the fp8 format or None)."""
    import argparse

    from ..core import fp8

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", default=cases)
    if kv_dtype:
        parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    for name, kwargs in more.items():
        parser.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    args = parser.parse_args()
    return args, (fp8.fp8_format("--kv-dtype", args.kv_dtype) if kv_dtype else None)


def run_ab(cases, settings_for, *, kv_dtype=None, rounds: int = 2, note=None) -> list:
    """Each case timed under ``settings_for(case)`` (a dict whose first entry is the baseline,
    named "default"), a line each: the plan (``note(case, plan)`` after it, if given), then
    every setting's us and its ratio to the default; a setting that does not build or launch
    for the case says so and is left out. Returns [(case, plan, {name: us})]."""
    rows = []
    for case in cases:
        def skipped(name, exc, case=case):
            print(f"  {case.name}: {name}: n/a ({type(exc).__name__}: {str(exc)[:80]})")

        plan, us = time_experiments(case, settings_for(case), kv_dtype=kv_dtype, rounds=rounds,
                                    on_error=skipped)
        cells = "  ".join(f"{name} {u:.2f} ({u / us['default']:.3f})" for name, u in us.items())
        extra = note(case, plan) if note else ""
        print(f"{case.name:>16}  {plan.strategy}/{plan.num_splits}{extra}  {cells}", flush=True)
        rows.append((case, plan, us))
    return rows
