"""Timing one case's plan under several settings, for the A/B runner (benchmarks/ab.py): one plan
(the first setting's wrapper plans it, unless given; or each setting its own), every setting
running it, rounds interleaved in one process, each timed like the bench (a graph over layers
of >= 1 GiB of KV). A setting is a ``DecodeExperiments`` (the kernel's knobs), or a ``Setting``:
those knobs, options of ``BatchDecodeWrapper`` and arguments of its ``plan()``."""

from __future__ import annotations

from dataclasses import dataclass, field

# What a setting may give the wrapper and its plan() beside the knobs: the case fixes the
# shapes and the command line the K/V dtype; the rest needs inputs the runner does not make
# (multi-token query rows, HND pages, windows).
WRAPPER_OPTIONS = ("use_clusters", "launch_order", "pdl", "profile", "use_cuda_graph",
                   "max_batch_size", "max_num_pages", "max_chunks")
PLAN_OPTIONS = ("unified_max", "logits_soft_cap")


@dataclass
class Setting:
    """One side of an A/B. ``experiments``: the kernel's knobs (None: the shipped kernel);
    ``wrapper``: ``BatchDecodeWrapper`` options (``WRAPPER_OPTIONS``); ``plan``: ``plan()``
    arguments (``PLAN_OPTIONS``), for every plan of this setting's wrapper."""

    experiments: object = None
    wrapper: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)


def wrapper_options(setting, batch_size: int, num_pages: int) -> dict:
    """``BatchDecodeWrapper`` keyword arguments for ``setting`` (a ``Setting``, a
    ``DecodeExperiments`` or None): a graph-stable wrapper's capacity defaults to the case's
    requests and pages."""
    if not isinstance(setting, Setting):
        setting = Setting(experiments=setting)
    options = dict(setting.wrapper, experiments=setting.experiments)
    if options.get("use_cuda_graph"):
        options.setdefault("max_batch_size", batch_size)
        options.setdefault("max_num_pages", num_pages)
    return options


def time_experiments(case, settings: dict, *, kv_dtype=None, rounds: int = 2,
                     dtype: str = "bfloat16", on_error=None, plan=None, plan_args=None,
                     own_plans: bool = False, plans: dict | None = None):
    """Returns (plan, {name: median us}) for ``settings`` ({name: Setting, DecodeExperiments
    or None}). ``plan``: the plan every setting runs (of the case's lengths); default: the one
    the first setting's wrapper chooses, with ``plan_args`` (``plan()``'s num_splits,
    strategy) where given. ``own_plans``: each setting's wrapper runs its own choice instead
    (the plan returned is the first's). ``plans``: a dict filled with each setting's plan as it
    ran. A graph-stable setting whose capacity holds more requests than the case runs q and out
    of its capacity's rows (the batch's first). A setting that does not build or launch for
    this shape is dropped, and ``on_error(name, exc)`` told, when given; else the error
    propagates."""
    from dataclasses import replace

    import numpy as np

    from ..measure.timing import make_layers, time_wrapper_us
    from ..runtime.cupy_arrays import empty, free_cached_blocks, zero_padded_rows
    from ..runtime.wrapper import BatchDecodeWrapper
    from ..testing import scattered_page_table

    pt, _ = scattered_page_table(case.kv_lens, case.page_size, np.random.default_rng(0),
                                 extra_pages=0)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    data = make_layers(pt, *heads, dtype, min_total_bytes=1 << 30, seed=0, kv_dtype=kv_dtype)
    batch = len(case.kv_lens)

    def guarded(name, fn):
        if on_error is None:
            return fn()
        try:
            return fn()
        except Exception as exc:          # a setting that does not fit this shape
            on_error(name, exc)
            return None

    wrappers, inputs = {}, {}
    for name, setting in settings.items():
        def make(setting=setting):
            options = wrapper_options(setting, batch, pt.kv_indices.size)
            w = BatchDecodeWrapper(*heads, case.page_size, dtype, kv_dtype=kv_dtype, **options)
            more = setting.plan if isinstance(setting, Setting) else {}
            if own_plans or plan is None:
                w.plan(pt, **(plan_args or {}), **more)
            else:
                w.plan(pt, plan=plan, **more)
            rows = options.get("max_batch_size") or batch
            if rows <= batch:
                return w, data
            q = zero_padded_rows(data.q, rows)
            return w, replace(data, q=q, out=empty(q.shape, q.dtype))
        made = guarded(name, make)
        if made is not None:
            wrappers[name], inputs[name] = made
            if plan is None:
                plan = wrappers[name].current_plan
            if plans is not None:
                plans[name] = wrappers[name].current_plan
    times = {name: [] for name in wrappers}
    for _ in range(rounds):
        for name in list(wrappers):
            us = guarded(name, lambda: time_wrapper_us(wrappers[name], inputs[name]))
            if us is None:
                del wrappers[name], times[name]
                if plans is not None:
                    plans.pop(name, None)
            else:
                times[name].append(us)
    data = inputs = wrappers = None       # their device memory back before the next case
    free_cached_blocks()
    return plan, {name: float(np.median(t)) for name, t in times.items()}


def _label(plan) -> str:
    return f"{plan.strategy}/{plan.num_splits}"


def run_ab(cases, settings_for, *, kv_dtype=None, rounds: int = 2, note=None, **timing) -> list:
    """Each case timed under ``settings_for(case)`` (a dict whose first entry is the baseline),
    a line each: the plan (``note(case, plan)`` after it, if given), then every setting's us and
    its ratio to the baseline, and with ``own_plans`` its plan where it differs from the
    baseline's; a setting that does not build or launch for the case says so and is left out.
    ``timing``: ``time_experiments``' plan, plan_args, own_plans. Returns
    [(case, plan, {name: us}, {name: plan as it ran, with own_plans})]."""
    rows = []
    for case in cases:
        def skipped(name, exc, case=case):
            print(f"  {case.name}: {name}: n/a ({type(exc).__name__}: {str(exc)[:80]})")

        settings = settings_for(case)
        ran = {}
        more = dict(timing, plans=ran) if timing.get("own_plans") else timing
        plan, us = time_experiments(case, settings, kv_dtype=kv_dtype, rounds=rounds,
                                    on_error=skipped, **more)
        if plan is None:                  # no setting built for this case
            print(f"{case.name:>16}  no setting ran", flush=True)
            continue
        base = us.get(next(iter(settings or us), None))
        cells = []
        for name, u in us.items():
            cell = f"{name} {u:.2f}" + (f" ({u / base:.3f})" if base else "")
            if name in ran and _label(ran[name]) != _label(plan):
                cell += f" [{_label(ran[name])}]"
            cells.append(cell)
        extra = note(case, plan) if note else ""
        print(f"{case.name:>16}  {_label(plan)}{extra}  {'  '.join(cells)}", flush=True)
        rows.append((case, plan, us, ran))
    return rows
