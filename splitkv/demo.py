"""``splitkv demo``: plan and run a few realistic decode batches, check them against the reference.

Each case is a decode step of a common model shape (page_size 16, head_dim 128, float16) with
its pages scattered through a pool, as a serving engine leaves them. The batch is planned, run
on the GPU through ``BatchDecodeWrapper`` when one is usable (otherwise by the CPU plan
executor, which does the same chunked work in float64), and compared with the float64
reference. The sizes are small enough for the CPU fallback to finish in seconds.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from .cpu_executor import execute_plan_cpu
from .planner import choose_plan
from .problem import DecodeProblem, PageTable
from .reference import reference_decode
from .testing import scattered_page_table

PAGE_SIZE = 16
HEAD_DIM = 128
DTYPE = "float16"
# Largest accepted (relative L2 error of the output, absolute error of the LSE). The CPU path
# computes in float64 on the same float16 inputs, so it must agree to rounding; the GPU
# accumulates in float32 and writes float16.
TOLERANCE = {"cpu": (1e-9, 1e-9), "gpu": (5e-3, 1e-3)}


@dataclass(frozen=True)
class Case:
    name: str
    about: str
    kv_lens: tuple[int, ...]
    num_qo_heads: int
    num_kv_heads: int


def make_cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    ragged = np.exp(rng.uniform(np.log(1), np.log(4096), size=16)).astype(int).clip(1)
    ragged[0] = 1                                       # a request on its first decode step
    return [
        Case("b1-long", "one long context, Llama-3-8B heads", (16384,), 32, 8),
        Case("b8-medium", "8 requests of 2k tokens", (2048,) * 8, 32, 8),
        Case("b16-ragged", "16 requests, lengths 1..4k", tuple(int(n) for n in ragged), 32, 8),
        Case("mha", "multi-head attention, Llama-2-7B heads", (1024,) * 4, 32, 32),
        Case("gqa5", "GQA group 5, Qwen2.5-14B heads", (3000, 2900, 3100, 2000), 40, 8),
    ]


CASE_NAMES = ("b1-long", "b8-medium", "b16-ragged", "mha", "gqa5")   # make_cases' names


def make_inputs(case: Case, rng: np.random.Generator):
    """float16 q, k_cache, v_cache (NHD) and a page table whose pages are scattered in a pool
    with 10% unused pages."""
    lens = np.array(case.kv_lens, dtype=np.int64)
    spare = int((-(-lens // PAGE_SIZE)).sum() // 10) + 1
    page_table, num_pages = scattered_page_table(lens, PAGE_SIZE, rng, spare)
    shape = (num_pages, PAGE_SIZE, case.num_kv_heads, HEAD_DIM)
    q = rng.standard_normal((lens.size, case.num_qo_heads, HEAD_DIM), dtype=np.float32)
    k_cache = rng.standard_normal(shape, dtype=np.float32)
    v_cache = rng.standard_normal(shape, dtype=np.float32)
    return q.astype(np.float16), k_cache.astype(np.float16), v_cache.astype(np.float16), page_table


def detect_gpu() -> tuple[bool, str]:
    """(True, device name) or (False, why not), from ``splitkv.runtime.gpu_available()``."""
    try:
        from .runtime import gpu_available
    except ImportError as exc:
        return False, f"the GPU runtime could not be imported ({exc})"
    return gpu_available()


def run_cpu(case: Case, q, k_cache, v_cache, page_table: PageTable):
    problem = DecodeProblem.from_page_table(page_table, case.num_qo_heads, case.num_kv_heads,
                                            HEAD_DIM, DTYPE)
    plan = choose_plan(problem)
    out, lse = execute_plan_cpu(plan, q, k_cache, v_cache, page_table)
    return plan, out, lse


def run_gpu(case: Case, q, k_cache, v_cache, page_table: PageTable):
    from .runtime.cupy_arrays import to_device, to_host
    from .runtime.wrapper import BatchDecodeWrapper

    wrapper = BatchDecodeWrapper(case.num_qo_heads, case.num_kv_heads, HEAD_DIM, PAGE_SIZE, DTYPE)
    plan = wrapper.plan(page_table, num_splits=None, strategy=None)
    out, lse = wrapper.run(to_device(q), to_device(k_cache), to_device(v_cache), return_lse=True)
    return plan, to_host(out), to_host(lse)


def errors(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    """(max over requests of ||out - ref|| / ||ref||, max |lse - ref_lse|), both over all heads.
    A request with no tokens must give exactly zeros and -inf."""
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    rel = 0.0
    for b in range(ref_out.shape[0]):
        diff = np.linalg.norm(out[b] - ref_out[b])
        norm = np.linalg.norm(ref_out[b])
        rel = max(rel, diff / norm if norm > 0 else diff)
    finite = np.isfinite(ref_lse)
    if np.any(lse[~finite] != ref_lse[~finite]) or not np.all(np.isfinite(lse[finite])):
        return rel, float("inf")
    lse_err = float(np.abs(lse[finite] - ref_lse[finite]).max()) if finite.any() else 0.0
    return float(rel), lse_err


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
    backend = "gpu" if on_gpu else "cpu"
    run_case = run_gpu if on_gpu else run_cpu
    out_tol, lse_tol = TOLERANCE[backend]
    print("plans from " + ("BatchDecodeWrapper.plan(page_table)" if on_gpu
                           else "splitkv.planner.choose_plan (the shipped H200 profile)"))

    header = ("case", "B", "heads", "tokens", "strategy", "splits", "work items", "max rel err",
              "lse err", "")
    rows, failed = [], 0
    rng = np.random.default_rng(args.seed)
    for case in cases:
        q, k_cache, v_cache, page_table = make_inputs(case, rng)
        plan, out, lse = run_case(case, q, k_cache, v_cache, page_table)
        ref_out, ref_lse = reference_decode(q, k_cache, v_cache, page_table)
        rel, lse_err = errors(out, lse, ref_out, ref_lse)
        ok = rel <= out_tol and lse_err <= lse_tol
        failed += not ok
        rows.append((case.name, str(page_table.batch_size),
                     f"{case.num_qo_heads}/{case.num_kv_heads}", str(int(page_table.kv_lens.sum())),
                     plan.strategy, str(plan.num_splits), str(plan.num_work_items), f"{rel:.2e}",
                     f"{lse_err:.2e}", "ok" if ok else "FAIL"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) if i in (0, 4) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    print(f"tolerance: rel err <= {out_tol:g}, lse err <= {lse_tol:g}; "
          f"{len(rows) - failed} of {len(rows)} cases within it")
    print(f"ran on the GPU: {reason}" if on_gpu else f"ran on the CPU fallback: {reason}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="splitkv demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
