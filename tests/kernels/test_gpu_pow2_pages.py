"""The POW2_PAGES experiment (``DecodeExperiments(pow2_pages=True)``: the page walk shifts and
masks instead of dividing) gives the dividing build's bits, plan for plan, for the page sizes
that walk by division (1, and 2 at head_dim 64) and for one that steps within a page (16),
bf16 and fp8 K/V, every strategy (a page size that is not a power of two is refused by name:
tests/core/test_validation.py)."""

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

LENS = [1500, 7, 0, 333]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4)]


@pytest.mark.parametrize("page,d,kv_dtype", [(1, 128, None), (1, 64, None), (2, 64, None),
                                             (16, 128, None), (1, 128, "float8_e4m3fn")])
def test_shifting_page_walk_gives_the_dividing_builds_bits(page, d, kv_dtype):
    rng = np.random.default_rng(page * d)
    hq, hk = 32, 8
    pt, pages = scattered_page_table(LENS, page, rng)
    q = random_device_array((len(LENS), hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, page, hk, d), "bfloat16", rng, kv_dtype)
    divide = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype=kv_dtype,
                                experiments=DecodeExperiments(pow2_pages=False))
    shift = BatchDecodeWrapper(hq, hk, d, page, "bfloat16", kv_dtype=kv_dtype,
                               experiments=DecodeExperiments(pow2_pages=True))
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)
    for strategy, n in PLANS:
        o2, l2 = plan_and_run_both(divide, shift, pt, q, k, v, f"{strategy}/{n}",
                                   strategy=strategy, num_splits=n)
        assert shift.kernel_variant.pow2_pages == 1 and divide.kernel_variant.pow2_pages == 0
        assert_matches_reference(to_float64(o2), l2, ref_o, ref_lse, 1e-2, f"{strategy}/{n}")

