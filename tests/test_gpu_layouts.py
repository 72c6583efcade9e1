"""KV cache layouts on the GPU: ``run()`` with a (k, v) pair, FlashInfer's combined
[pages, 2, page_size, heads, dim] or vLLM's [2, pages, ...] array (read in place through strided
views) gives the bits of two NHD arrays."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv.runtime.testing import random_device_array, scattered_page_table
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 4)])
def test_combined_layouts_give_the_bits_of_two_arrays(strategy, splits):
    rng = np.random.default_rng(3)
    lens = [500, 17, 3000, 0]
    pt, pages = scattered_page_table(lens, 16, rng)
    q = random_device_array((len(lens), 32, 128), "bfloat16", rng)
    kv = random_device_array((pages, 2, 16, 8, 128), "bfloat16", rng)      # FlashInfer's
    k, v = cupy.ascontiguousarray(kv[:, 0]), cupy.ascontiguousarray(kv[:, 1])
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    w.plan(pt, num_splits=splits, strategy=strategy)
    want = w.run(q, k, v).view(cupy.uint16).get()
    vllm = cupy.ascontiguousarray(kv.transpose(1, 0, 2, 3, 4))
    for name, args in (("flashinfer", (kv,)), ("vllm", (vllm,)), ("pair", ((k, v),))):
        got = w.run(q, *args).view(cupy.uint16).get()
        np.testing.assert_array_equal(got, want, err_msg=name)
