"""Inputs of the build decisions over a wide grid: shapes, K/V dtypes, page sizes, plans (grid
size, cluster, chunk lengths, multi-token rows, soft cap, unified max), experiments and
devices. Drawn by Python's ``random.Random`` (its sequences are stable across versions), so the
recorded decisions (``data/build_decisions.json``) stay matched to their cases."""

from __future__ import annotations

import random

# name -> (SMs, shared memory a block may opt in to, shared memory an SM, compute capability)
DEVICES = {"H200": (132, 232448, 233472, 90), "A100": (108, 166912, 167936, 80),
           "L40S": (142, 101376, 102400, 89)}
CASES_PER_DEVICE = 2500
GRAPH_CASES_PER_DEVICE = 600

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 4, 8, 16, 20, 32, 48, 64, 80, 128)
PAGE_SIZES = (1, 2, 4, 8, 16, 64, 5)
KV_DTYPES = ("", "", "float8_e4m3fn", "float8_e5m2")
EXPERIMENT_CHOICES = {"stages": (None, 2, 3, 5), "max_registers": (None, 0, 128),
                      "warps": (None, 4, 8), "q_in_smem": (None, True, False),
                      "pow2_pages": (None, True, False), "tile_per_warp": (None, 16, 32),
                      "dim_split": (None, 1, 2), "rows_per_cta": (None, 16, 32)}


def _experiments(r: random.Random, page_size: int) -> dict:
    """Half the cases the defaults; else one to three knobs forced."""
    if r.random() < 0.5:
        return {}
    names = sorted(EXPERIMENT_CHOICES)
    forced = {}
    for name in r.sample(names, r.randint(1, 3)):
        forced[name] = r.choice(EXPERIMENT_CHOICES[name])
    if forced.get("pow2_pages") and page_size & (page_size - 1):
        forced["pow2_pages"] = None          # the wrapper refuses it for such pages
    return {k: v for k, v in forced.items() if v is not None}


def _shape(r: random.Random) -> dict:
    page = r.choice(PAGE_SIZES)
    return {"dtype": r.choice(DTYPES), "head_dim": r.choice(HEAD_DIMS),
            "group_size": r.choice(GROUPS), "page_size": page, "kv_dtype": r.choice(KV_DTYPES),
            "experiments": _experiments(r, page)}


def plan_cases(device: str) -> list[dict]:
    """Per-shape plans: each a shape and the plan's grid as the runtime sees it."""
    r = random.Random(f"plan-{device}")
    num_sms = DEVICES[device][0]
    cases = []
    for _ in range(CASES_PER_DEVICE):
        case = _shape(r)
        q_len = r.choice((1, 1, 1, 2, 4))
        chunks = r.choice((1, 2, 7, 64, num_sms // 2, 400))
        mean = r.choice((16, 100, 256, 1000, 2047, 2048, 3000, 8192, 40000))
        ctas = r.choice((1, num_sms - 1, num_sms, num_sms + 1, 4 * num_sms, 3000))
        case.update(q_len=q_len, chunk_tokens=[mean] * chunks, ctas=ctas,
                    cluster_size=r.choice((0, 0, 2, 4, 8)),
                    soft_cap=r.random() < 0.2, unified_max=r.random() < 0.15)
        cases.append(case)
    return cases


def graph_cases(device: str) -> list[dict]:
    """Graph-stable grids: a shape, the soft cap and the most query rows a request has."""
    r = random.Random(f"graph-{device}")
    cases = []
    for _ in range(GRAPH_CASES_PER_DEVICE):
        case = _shape(r)
        case["experiments"].pop("rows_per_cta", None)     # per-shape wrappers only
        case.update(max_q_len=r.choice((1, 1, 2, 4)), soft_cap=r.random() < 0.2)
        cases.append(case)
    return cases
