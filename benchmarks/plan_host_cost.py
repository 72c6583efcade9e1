"""Host time of one decode step's planning on the GPU machine, and where it goes: building the
page table from a block table, ``choose_plan`` alone, the whole ``BatchDecodeWrapper.plan()``
from a prebuilt ``PageTable`` (choose, build the chunk records, copy them and the page table to
the GPU, bind the launches), and ``plan()`` as an engine calls it: host lengths and the block
table left on the device (nothing of the table built or copied). Median microseconds over many
calls, after a warm-up; the device is idle before each call (untimed synchronize), as in a
decode loop where the previous step's copy finished long ago. ``--profile`` adds the top
functions of cProfile's view of the engine call.

``--cpu-only`` needs no GPU or CuPy: ``plan()``'s host work before its upload, as a per-shape
wrapper on an H200 does it with the shipped H200 profile (the problem, ``choose_plan``, the
plan's build, its grid order and chunk records), beside the block table and ``choose_plan``
alone; ``--profile`` then profiles that host work.

    PYTHONPATH=$PWD python3 benchmarks/plan_host_cost.py [--repeats 500] [--profile]
    PYTHONPATH=$PWD python3 benchmarks/plan_host_cost.py --cpu-only [--cases standard]
"""

import argparse
import cProfile
import pstats
from pathlib import Path

import numpy as np

from splitkv.bench.cases import RAGGED_B32, Case, ragged_b256_lengths, select
from splitkv.core.problem import DecodeProblem, PageTable
from splitkv.measure.timing import median_host_us
from splitkv.planner import choose_plan
from splitkv.testing import block_table_of, scattered_page_table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=500)
parser.add_argument("--back-to-back", action="store_true",
                    help="no synchronize between calls (plan() then waits for the last copy)")
parser.add_argument("--profile", action="store_true", help="cProfile the engine call")
parser.add_argument("--cpu-only", action="store_true",
                    help="no GPU: plan()'s host work before the upload, with the H200 profile")
parser.add_argument("--cases", default="",
                    help="standard case names or groups (bench --cases), besides ragged_b256; "
                         "default: ragged_b32 and ragged_b256")
args = parser.parse_args()
idle = not args.back_to_back and not args.cpu_only
PAGE = 16
warmup = max(args.repeats // 10, 20)


def cases() -> list[Case]:
    chosen = select(args.cases) if args.cases else [Case("ragged_b32", tuple(RAGGED_B32))]
    return [*chosen, Case("ragged_b256", tuple(int(n) for n in ragged_b256_lengths()))]


def time(fn) -> float:
    return median_host_us(fn, args.repeats, warmup=warmup, idle_device=idle)


def cpu_only() -> None:
    """plan()'s host steps of a per-shape wrapper before its upload (runtime.per_shape), on an
    H200 as the shipped profile and ``core.builds.H200`` describe it."""
    from splitkv.core.builds import H200, PlanGrid, plan_build, row_tiles_for, shape_build
    from splitkv.core.execution import grid_order
    from splitkv.core.geometry import MAX_HEADS_PER_CTA, ctas_per_kv_head
    from splitkv.planner.profiles import read_profile
    from splitkv.runtime.compiled_builds import mean_chunk_tokens
    from splitkv.runtime.records import chunk_records, pages_fit_record, record_pages_needed

    import splitkv.planner

    model = read_profile(Path(splitkv.planner.__file__).parent / "profiles" /
                         "nvidia-h200.yaml").cost_model()
    print(f"{'case':>12} {'block table':>12} {'choose_plan':>12} {'host plan()':>12} chunks  "
          f"(us, median of {args.repeats}; no GPU)")
    for case in cases():
        hq, hk, d, page = case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size
        group = hq // hk
        base = shape_build("bfloat16", d, group, page, None)
        pt, _ = scattered_page_table(np.array(case.kv_lens), page, np.random.default_rng(0), 0)
        table, seq_lens = block_table_of(pt), np.asarray(case.kv_lens, np.int32)
        problem = DecodeProblem.from_page_table(pt, hq, hk, d)

        def host_plan():
            chosen = choose_plan(DecodeProblem.from_page_table(pt, hq, hk, d), model)
            build = plan_build(base, PlanGrid(chosen.num_work_items * ctas_per_kv_head(group),
                                              mean_chunk_tokens(chosen), chosen.cluster_size,
                                              row_tiles_for(min(group, MAX_HEADS_PER_CTA))),
                               page_size=page, device=H200)
            fits = pages_fit_record(chosen, page, build.stages, build.tile_tokens)
            pages = record_pages_needed(page, build.stages, build.tile_tokens) if fits else 0
            chunk_records(chosen, pt, grid_order(chosen), pages)
            return chosen

        build = time(lambda: PageTable.from_block_table(table, seq_lens, page))
        choose = time(lambda: choose_plan(problem, model))
        whole = time(host_plan)
        print(f"{case.name:>12} {build:12.1f} {choose:12.1f} {whole:12.1f} "
              f"{host_plan().num_chunks:6d}", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            host_plan()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def on_gpu() -> None:
    import cupy

    from splitkv.runtime.wrapper import BatchDecodeWrapper

    print(f"{'case':>12} {'block table':>12} {'choose_plan':>12} {'plan(table)':>12} "
          f"{'plan(device)':>13} chunks  (us, median of {args.repeats})")
    for case in cases():
        hq, hk, d, page = case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size
        pt, _ = scattered_page_table(np.array(case.kv_lens), page, np.random.default_rng(0), 0)
        table = block_table_of(pt)
        device_table = cupy.asarray(table)
        seq_lens = np.asarray(case.kv_lens, np.int32)
        w = BatchDecodeWrapper(hq, hk, d, page, "bfloat16")
        w.plan(pt)
        problem = DecodeProblem.from_page_table(pt, hq, hk, d)
        model = w.profile.cost_model()

        build = time(lambda: PageTable.from_block_table(table, seq_lens, page))
        choose = time(lambda: choose_plan(problem, model))
        whole = time(lambda: w.plan(pt))

        def engine_call():
            w.plan(seq_lens=seq_lens, block_table=device_table)

        engine = time(engine_call)
        print(f"{case.name:>12} {build:12.1f} {choose:12.1f} {whole:12.1f} {engine:13.1f} "
              f"{w.current_plan.num_chunks:6d}", flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(200):
                engine_call()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if args.cpu_only:
    cpu_only()
else:
    on_gpu()
