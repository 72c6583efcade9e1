"""KV cache layouts on the GPU: ``run()`` with a (k, v) pair, FlashInfer's combined
[pages, 2, page_size, heads, dim] or vLLM's [2, pages, ...] array (read in place through strided
views), an HND wrapper's [pages, heads, page_size, dim] caches and NHD views with padded heads
give the bits of two contiguous NHD arrays."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv.measure.test_data import random_device_array, scattered_page_table
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


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 4)])
def test_hnd_and_padded_heads_give_the_bits_of_nhd(kv_dtype, strategy, splits):
    rng = np.random.default_rng(4)
    lens = [500, 17, 3000, 0]
    pt, pages = scattered_page_table(lens, 16, rng)
    q = random_device_array((len(lens), 32, 128), "bfloat16", rng)
    if kv_dtype:
        k = cupy.asarray(rng.integers(0, 0x70, (pages, 16, 8, 128), dtype=np.uint8))
        v = cupy.asarray(rng.integers(0, 0x70, (pages, 16, 8, 128), dtype=np.uint8))
    else:
        k, v = (random_device_array((pages, 16, 8, 128), "bfloat16", rng) for _ in range(2))
    nhd = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype)
    nhd.plan(pt, num_splits=splits, strategy=strategy)
    want = nhd.run(q, k, v).view(cupy.uint16).get()
    hnd_k, hnd_v = (cupy.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (k, v))
    hnd = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype, kv_layout="HND")
    hnd.plan(pt, num_splits=splits, strategy=strategy)
    np.testing.assert_array_equal(hnd.run(q, hnd_k, hnd_v).view(cupy.uint16).get(), want)
    combined = cupy.ascontiguousarray(cupy.stack([hnd_k, hnd_v], axis=1))  # FlashInfer HND
    np.testing.assert_array_equal(hnd.run(q, combined).view(cupy.uint16).get(), want)
    pad = 16 if kv_dtype else 8                    # 16 more bytes per head row
    padded = [cupy.zeros((pages, 16, 8, 128 + pad), a.dtype) for a in (k, v)]
    for dst, src in zip(padded, (k, v)):
        dst[..., :128] = src
    views = [a[..., :128] for a in padded]         # head stride 128 + pad, not contiguous
    np.testing.assert_array_equal(nhd.run(q, *views).view(cupy.uint16).get(), want)

