"""KV cache layouts on the host paths (``core/layouts.py``): a (k, v) pair, FlashInfer's combined
[pages, 2, ...] and vLLM's [2, pages, ...] arrays, and HND pages give the bits of two NHD
arrays; what cannot be told apart is refused."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import execute_plan_cpu, plan_fixed_splits, reference_decode

from helpers.batches import build_batch


def layouts_of(k, v):
    """The same cache in every layout: (k_cache, v_cache, kv_layout) arguments."""
    hnd = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3))     # noqa: E731
    return {"two arrays": (k, v, "NHD"), "pair": ((k, v), None, "NHD"),
            "flashinfer combined": (np.stack([k, v], axis=1), None, "NHD"),
            "vllm combined": (np.stack([k, v], axis=0), None, "NHD"),
            "HND": (hnd(k), hnd(v), "HND"),
            "HND combined": (np.stack([hnd(k), hnd(v)], axis=1), None, "HND")}


def test_every_layout_gives_the_same_bits(rng):
    b = build_batch(rng, [37, 0, 300, 5], num_qo_heads=8, num_kv_heads=2, head_dim=64)
    want = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table)
    plan = plan_fixed_splits(b.problem, 3, "fused")
    want_cpu = execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table)
    for name, (k, v, layout) in layouts_of(b.k_cache, b.v_cache).items():
        got = reference_decode(b.q, k, v, b.page_table, kv_layout=layout)
        np.testing.assert_array_equal(got[0], want[0], err_msg=name)
        np.testing.assert_array_equal(got[1], want[1], err_msg=name)
        got = execute_plan_cpu(plan, b.q, k, v, b.page_table, kv_layout=layout)
        np.testing.assert_array_equal(got[0], want_cpu[0], err_msg=name)


def test_what_cannot_be_told_apart_is_refused(rng):
    b = build_batch(rng, [5], num_qo_heads=8, num_kv_heads=2, head_dim=64)
    both_two = np.zeros((2, 2, 16, 2, 64))
    with pytest.raises(ValueError, match="k_cache: shape .* could be FlashInfer's"):
        reference_decode(b.q, both_two, None, b.page_table)
    with pytest.raises(ValueError, match="k_cache: a combined K/V cache has K and V on axis 0"):
        reference_decode(b.q, np.zeros((3, 3, 16, 2, 64)), None, b.page_table)
    with pytest.raises(ValueError, match="k_cache: a combined K/V cache is 5-d"):
        reference_decode(b.q, b.k_cache, None, b.page_table)
    with pytest.raises(ValueError, match="k_cache: a \\(k_cache, v_cache\\) pair has 2 arrays"):
        reference_decode(b.q, (b.k_cache,), None, b.page_table)
    with pytest.raises(ValueError, match="kv_layout: expected one of"):
        reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, kv_layout="NDH")


class FakeDeviceArray:
    """A NumPy array seen through __cuda_array_interface__ (the descriptors need no GPU)."""

    def __init__(self, host: np.ndarray):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": host.shape, "typestr": host.dtype.str, "version": 3,
            "data": (host.__array_interface__["data"][0], False),
            "strides": host.strides}


@pytest.mark.parametrize("dtype", [np.float16, np.uint8])
def test_device_descriptors_of_combined_arrays_point_at_k_and_v(dtype):
    """``runtime.arrays.split_kv_arrays``: FlashInfer's and vLLM's combined arrays (and a
    page-strided slice of one) give K and V descriptors whose pointers and element strides are
    NumPy's own views'."""
    pytest.importorskip("cupy")
    from splitkv.runtime.arrays import split_kv_arrays

    item = np.dtype(dtype).itemsize
    fi = np.zeros((6, 2, 16, 2, 64), dtype)
    vl = np.zeros((2, 6, 16, 2, 64), dtype)
    for combined, (k_view, v_view) in ((fi, (fi[:, 0], fi[:, 1])), (vl, (vl[0], vl[1])),
                                       (fi[::2], (fi[::2, 0], fi[::2, 1]))):
        k, v = split_kv_arrays(FakeDeviceArray(combined), None)
        for desc, view in ((k, k_view), (v, v_view)):
            assert desc.ptr == view.__array_interface__["data"][0]
            assert desc.shape == view.shape
            assert desc.strides == tuple(s // item for s in view.strides)


def test_an_hnd_descriptor_reads_as_the_nhd_view_the_kernels_take():
    """``kv_layout='HND'`` on the GPU path: a [pages, heads, page, dim] descriptor becomes the NHD
    view of the same memory (axes 1 and 2 swapped, no copy), which the checks accept."""
    from splitkv.core import validation as V
    from splitkv.runtime.arrays import DeviceArray, nhd_view

    hnd = DeviceArray(4096, (5, 2, 16, 64), (2048, 1024, 64, 1), "bfloat16", 0, None)
    nhd = nhd_view("k_cache", hnd)
    assert nhd.shape == (5, 16, 2, 64) and nhd.strides == (2048, 64, 1024, 1)
    assert nhd.ptr == hnd.ptr and not nhd.is_contiguous
    q = DeviceArray(0, (2, 8, 64), (512, 64, 1), "bfloat16", 0, None)
    V.check_device_decode_arrays(q, nhd, nhd, batch_size=2, num_qo_heads=8, num_kv_heads=2,
                                 head_dim=64, page_size=16, dtype="bfloat16", max_page=4,
                                 device=0)
    with pytest.raises(ValueError, match="k_cache: an HND cache is \\[num_pages, num_kv_heads"):
        nhd_view("k_cache", DeviceArray(0, (5, 2, 16), (32, 16, 1), "bfloat16", 0, None))
