"""Digests of the GPU's outputs for a fixed set of plans, so that a refactor can show it changed
no bit: ``tests/helpers/data/h200_output_digests.json`` holds the digests the code gave before, and
``test_gpu_digests.py`` compares. Inputs come from NumPy's seeded generator (the same bits on
every machine); each case names its shape, its plan and the wrapper's options, so a mismatch
says which plan changed.

    python3 tests/helpers/output_digests.py --write digests.json      # on a GPU machine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

DIGESTS = Path(__file__).with_name("data") / "h200_output_digests.json"

# name: (kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
SHAPES = {
    "ragged_g4_d128_p16_bf16": ([3000, 17, 700, 0, 9000, 64, 1500], 32, 8, 128, 16, "bfloat16"),
    "ragged_g5_d64_p1_fp16": ([1, 15, 16, 17, 1000, 0, 77], 10, 2, 64, 1, "float16"),
    "equal_g8_d256_p64_fp16": ([1000] * 3, 16, 2, 256, 64, "float16"),
    "mqa_g96_d128_p16_bf16": ([500, 3000], 96, 1, 128, 16, "bfloat16"),
    "mha_g1_d128_p16_bf16": ([4096, 2048], 8, 8, 128, 16, "bfloat16"),
    "b1_n1k_g4_d128_p16_bf16": ([1024], 32, 8, 128, 16, "bfloat16"),
    "b4_n2k_g32_d128_p16_bf16": ([2048] * 4, 64, 2, 128, 16, "bfloat16"),
}

# (shape, how the plan is made, wrapper options). How: ("splits", strategy, n) forces the
# planner's hand; ("chunk_tokens", strategy, tokens) is a hand-built plan; ("planner",) lets
# the shipped profile choose.
CASES = [
    *[(shape, how, {}) for shape in ("ragged_g4_d128_p16_bf16", "ragged_g5_d64_p1_fp16",
                                     "equal_g8_d256_p64_fp16", "mqa_g96_d128_p16_bf16")
      for how in (("splits", "single", 1), ("splits", "split_merge", 3),
                  ("splits", "split_merge", 33), ("splits", "fused", 3),
                  ("splits", "fused", 16), ("planner",))],
    *[("b1_n1k_g4_d128_p16_bf16", ("splits", "fused", n), opts)
      for n in (2, 4, 8) for opts in ({}, {"use_clusters": False}, {"pdl": False})],
    ("b4_n2k_g32_d128_p16_bf16", ("splits", "fused", 2), {}),
    ("b4_n2k_g32_d128_p16_bf16", ("splits", "split_merge", 64), {}),
    ("mha_g1_d128_p16_bf16", ("splits", "fused", 8), {}),
    ("mha_g1_d128_p16_bf16", ("planner",), {"pdl": False}),
    *[("ragged_g4_d128_p16_bf16", ("chunk_tokens", strategy, 512), {"launch_order": order})
      for strategy in ("split_merge", "fused")
      for order in ("plan", "longest_requests", "longest_chunks")],
]


def case_name(shape: str, how: tuple, opts: dict) -> str:
    extra = "".join(f",{k}={v}" for k, v in sorted(opts.items()))
    return f"{shape}:{'/'.join(map(str, how))}{extra}"


def _inputs(shape: str):
    from splitkv.measure.test_data import random_device_array, scattered_page_table

    lens, hq, hk, d, page, dtype = SHAPES[shape]
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(shape.encode()).digest()[:4], "little"))
    pt, num_pages = scattered_page_table(lens, page, rng)
    q = random_device_array((len(lens), hq, d), dtype, rng)
    k = random_device_array((num_pages, page, hk, d), dtype, rng)
    v = random_device_array((num_pages, page, hk, d), dtype, rng)
    return pt, q, k, v


def compute_digests() -> dict[str, dict]:
    """{case name: {"digest": sha256 of out and lse bytes (16 hex digits), "plan": str}}."""
    import cupy

    from splitkv import DecodeProblem
    from splitkv.core.plan import plan_chunk_tokens
    from splitkv.runtime.wrapper import BatchDecodeWrapper

    inputs = {shape: _inputs(shape) for shape in SHAPES}
    results = {}
    for shape, how, opts in CASES:
        lens, hq, hk, d, page, dtype = SHAPES[shape]
        pt, q, k, v = inputs[shape]
        w = BatchDecodeWrapper(hq, hk, d, page, dtype, **opts)
        if how[0] == "splits":
            plan = w.plan(pt, num_splits=how[2], strategy=how[1])
        elif how[0] == "chunk_tokens":
            problem = DecodeProblem.from_page_table(pt, hq, hk, d, dtype)
            plan = w.plan(pt, plan=plan_chunk_tokens(problem, how[2], how[1], align=64))
        else:
            plan = w.plan(pt)
        out = cupy.empty(q.shape, dtype=q.dtype)
        out.view(cupy.uint16).fill(0xFFFF)                      # NaN in both 16-bit types
        lse = cupy.full(q.shape[:2], np.nan, dtype=cupy.float32)
        w.run(q, k, v, out=out, lse=lse)
        cupy.cuda.runtime.deviceSynchronize()
        digest = hashlib.sha256(out.get().tobytes() + lse.get().tobytes()).hexdigest()[:16]
        results[case_name(shape, how, opts)] = {
            "digest": digest,
            "plan": f"{plan.strategy}/{plan.num_splits} chunks={plan.num_chunks}",
            "cluster": w.cluster_size}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    digests = compute_digests()
    args.write.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    for name, entry in digests.items():
        print(f"{entry['digest']}  {entry['plan']:<28} c{entry['cluster']}  {name}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
