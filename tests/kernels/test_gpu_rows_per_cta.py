"""The rows_per_cta experiment (``DecodeExperiments(rows_per_cta=16 or 32)``): GQA groups past
the cap run in more CTAs a kv head, each its own rows; on every strategy and the cluster
merge, bf16 and fp8 K/V, multi-token rows, the result matches the reference (the warps split
the tokens otherwise, so the bits may differ from the default's)."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import (assert_matches_reference, plan_and_run,
                                     random_device_array, random_kv_caches,
                                     scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

LENS = [1800, 33, 0, 900]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4), ("fused", 2)]


@pytest.mark.parametrize("hq,hk,rows,kv_dtype", [(64, 2, 16, None), (64, 2, 32, None),
                                                 (128, 8, 16, "float8_e4m3fn"),
                                                 (32, 1, 16, None)])
def test_groups_split_over_more_ctas_match_the_reference(hq, hk, rows, kv_dtype):
    rng = np.random.default_rng(hq + rows)
    d = 128
    pt, pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng, kv_dtype)
    w = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", kv_dtype=kv_dtype,
                           experiments=DecodeExperiments(rows_per_cta=rows))
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)
    for strategy, n in PLANS:
        out, lse = plan_and_run(w, pt, q, k, v, strategy=strategy, num_splits=n)
        assert w.kernel_variant.rows == rows
        assert_matches_reference(to_float64(out), lse, ref_o, ref_lse, 1e-2, f"{strategy}/{n}")
    # multi-token rows: q_len x the group past the cap too
    qo_indptr = np.array([0, 2, 3, 4, 6])
    qm = random_device_array((6, hq, d), "bfloat16", rng)
    out, lse = plan_and_run(w, pt, qm, k, v, qo_indptr=qo_indptr, strategy="fused",
                            num_splits=3)
    ref_o, ref_lse = reference_decode(qm.get(), k, v, pt, kv_dtype=kv_dtype, qo_indptr=qo_indptr)
    assert_matches_reference(to_float64(out), lse, ref_o, ref_lse, 1e-2, "rows")
