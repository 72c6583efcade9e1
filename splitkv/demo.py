"""The demo's cases and their check (``splitkv demo`` runs them and prints the table): plan and
run a few realistic decode batches, check them against the reference.

Each case is a decode step of a common model shape (page_size 16, head_dim 128, float16) with
its pages scattered through a pool, as a serving engine leaves them. The batch is planned, run
on the GPU through ``BatchDecodeWrapper`` when one is usable (otherwise by the CPU plan
executor, which does the same chunked work in float64), and compared with the float64
reference. The sizes are small enough for the CPU fallback to finish in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .core.cpu_executor import execute_plan_cpu
from .core.plan import Plan
from .planner import choose_plan
from .core.problem import DecodeProblem, PageTable
from .core.reference import reference_decode
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


@dataclass(frozen=True)
class CaseResult:
    """One case run and checked: the plan it ran, its errors against the reference, and whether
    they are within ``TOLERANCE``."""

    case: Case
    page_table: PageTable
    plan: Plan
    rel_err: float
    lse_err: float
    ok: bool


def check_cases(cases: list[Case], seed: int, on_gpu: bool) -> list[CaseResult]:
    """Run each case (on the GPU, or by the CPU plan executor) on random inputs drawn in turn
    from one generator seeded with ``seed``, and compare it with the float64 reference."""
    run_case = run_gpu if on_gpu else run_cpu
    out_tol, lse_tol = TOLERANCE["gpu" if on_gpu else "cpu"]
    rng = np.random.default_rng(seed)
    results = []
    for case in cases:
        q, k_cache, v_cache, page_table = make_inputs(case, rng)
        plan, out, lse = run_case(case, q, k_cache, v_cache, page_table)
        ref_out, ref_lse = reference_decode(q, k_cache, v_cache, page_table)
        rel, lse_err = errors(out, lse, ref_out, ref_lse)
        results.append(CaseResult(case, page_table, plan, rel, lse_err,
                                  rel <= out_tol and lse_err <= lse_tol))
    return results
