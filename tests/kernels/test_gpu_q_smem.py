"""The Q_SMEM experiment (``DecodeExperiments(q_in_smem=True)``: q's MMA fragments in shared
memory, read back every tile) gives the register build's bits, plan for plan: head_dim 64 to
256, bf16 / fp16 q, fp8 K/V, every strategy and the cluster merge, multi-token rows and the
unified max's second pass; and both match the reference."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import (assert_matches_reference, plan_and_run_both,
                                     random_device_array, random_kv_caches,
                                     scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

LENS = [2000, 9, 0, 700]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4), ("fused", 2)]


@pytest.mark.parametrize("dtype,d,hq,hk,kv_dtype", [
    ("bfloat16", 256, 16, 8, None), ("float16", 256, 32, 4, None),
    ("bfloat16", 256, 16, 8, "float8_e4m3fn"), ("bfloat16", 128, 32, 8, None),
    ("bfloat16", 64, 64, 2, "float8_e5m2")])
def test_q_in_shared_memory_gives_the_register_builds_bits(dtype, d, hq, hk, kv_dtype):
    rng = np.random.default_rng(d + hq)
    pt, pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), hq, d), dtype, rng)
    k, v = random_kv_caches((pages, 16, hk, d), dtype, rng, kv_dtype)
    plain = BatchDecodeWrapper(hq, hk, d, 16, dtype, kv_dtype=kv_dtype,
                               experiments=DecodeExperiments(q_in_smem=False))
    smem = BatchDecodeWrapper(hq, hk, d, 16, dtype, kv_dtype=kv_dtype,
                              experiments=DecodeExperiments(q_in_smem=True))
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)
    for strategy, n in PLANS:
        o2, l2 = plan_and_run_both(plain, smem, pt, q, k, v, f"{strategy}/{n}",
                                   strategy=strategy, num_splits=n)
        assert smem.kernel_variant.q_in_smem == 1 and plain.kernel_variant.q_in_smem == 0
        assert_matches_reference(to_float64(o2), l2, ref_o, ref_lse, 1e-2, f"{strategy}/{n}")
    # multi-token rows, and the unified max with phi far below the scores (every CTA streams
    # again: its second pass reads the fragments back once more), take the same fragments
    qo_indptr = np.array([0, 3, 4, 5, 7])
    qm = random_device_array((7, hq, d), dtype, rng)
    for extra in ({"qo_indptr": qo_indptr}, {"unified_max": -60.0}):
        plan_and_run_both(plain, smem, pt, qm if "qo_indptr" in extra else q, k, v, str(extra),
                          **extra)
        assert smem.kernel_variant.q_in_smem == 1
    assert smem.unified_max_fallbacks() > 0


def test_q_in_shared_memory_under_the_cluster_merge():
    """The cluster build's epilogue reuses shared memory over the q region (once q is dead):
    equal-length requests so that fused plans of 2 and 4 chunks merge in clusters."""
    from splitkv import DecodeProblem, plan_from_chunk_counts
    from splitkv.runtime import device_info

    if int(device_info()["cc"]) < 90:
        pytest.skip("thread-block clusters need compute capability 9.0")
    rng = np.random.default_rng(3)
    hq, hk, d = 16, 8, 256
    pt, pages = scattered_page_table([900, 900], 16, rng)
    q = random_device_array((2, hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng)
    plain = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16",
                               experiments=DecodeExperiments(q_in_smem=False))
    smem = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16",
                              experiments=DecodeExperiments(q_in_smem=True))
    problem = DecodeProblem.from_page_table(pt, hq, hk, d)
    for n in (2, 4):
        plan = plan_from_chunk_counts(problem, [n, n], "fused")
        plan_and_run_both(plain, smem, pt, q, k, v, f"cluster {n}", plan=plan)
        assert smem.cluster_size == n and smem.kernel_variant.q_in_smem == 1
