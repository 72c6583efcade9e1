"""What ``run()`` is given, checked and turned into ``RunArguments``: q, K/V, out and lse (CuPy,
torch or JAX arrays, zero-copy), the fp8 scales, the sinks, and the stream.

Torch-first: when q is a torch tensor, ``stream=None`` means torch's current stream on q's
device (not CuPy's), and the outputs ``run()`` allocates are torch tensors, so an engine gets
back what it passed in. torch is never imported here: a torch tensor brings its module along.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ..core import validation as V
from .arrays import (DeviceArray, as_cupy_stream, as_device_array, cupy_storage_dtype,
                     nhd_view, split_kv_arrays)
from .params import RunArguments, Scale


def torch_of(obj):
    """The torch module if ``obj`` is a torch tensor (torch already imported), else None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return torch
    return None


def run_stream(stream, *arrays):
    """The CuPy stream a run (or a plan) goes to: ``stream`` as given; None: torch's current
    stream (on the device of the first CUDA one) when any of ``arrays`` is a torch tensor, else
    CuPy's current stream."""
    if stream is None:
        for a in arrays:
            torch = torch_of(a)
            if torch is not None:
                device = a.device if a.is_cuda else None
                stream = torch.cuda.current_stream(device)
                if a.is_cuda:
                    break
    return as_cupy_stream(stream)


def new_output(like, shape: tuple[int, ...], dtype: str, stream):
    """An uninitialised output of ``shape``: a torch tensor on ``like``'s device when ``like``
    (run()'s q) is one, allocated for ``stream``; else a CuPy array allocated on ``stream``.
    ``dtype``: 'float32', or the wrapper's 16-bit dtype."""
    torch = torch_of(like)
    if torch is not None:
        torch_dtype = (torch.float32 if dtype == "float32" else
                       torch.float16 if dtype == "float16" else torch.bfloat16)
        if torch.cuda.current_stream(like.device).cuda_stream == stream.ptr:
            return torch.empty(shape, dtype=torch_dtype, device=like.device)
        # torch's allocator ties a block to the stream it was made for: the run's
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=like.device)):
            return torch.empty(shape, dtype=torch_dtype, device=like.device)
    import cupy

    with stream:
        return cupy.empty(shape, dtype=np.float32 if dtype == "float32"
                          else cupy_storage_dtype(dtype))


@dataclass(frozen=True)
class DecodeShape:
    """What a wrapper's runs must match: its heads, head_dim, page_size, dtypes and layout."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    kv_dtype: str | None
    kv_layout: str


def kv_views(shape: DecodeShape, k_cache, v_cache) -> tuple[DeviceArray, DeviceArray]:
    """K and V as the NHD views the kernels read (``arrays.split_kv_arrays``; HND swapped)."""
    ka, va = split_kv_arrays(k_cache, v_cache)
    if shape.kv_layout == "HND":          # [pages, heads, page, dim]: read as an NHD view
        ka, va = nhd_view("k_cache", ka), nhd_view("v_cache", va)
    return ka, va


def float32_vector(name: str, value, sizes, expected: str, device) -> DeviceArray:
    """``value`` as a contiguous 1-d float32 device array of one of ``sizes`` values, on
    ``device``; else a ValueError naming ``name`` and saying ``expected``."""
    arr = as_device_array(name, value)
    V.check_float32_vector(name, arr, sizes, expected, device)
    return arr


def fp8_scale(shape: DecodeShape, name: str, scale, device) -> Scale:
    """An fp8 scale as DecodeParams holds it (``params.Scale``)."""
    if scale is None:
        return Scale()
    value = V.check_fp8_scale(name, scale, shape.kv_dtype)
    if value is not None:
        return Scale(0, value, 0)
    arr = float32_vector(name, scale, (1, shape.num_kv_heads),
                         f"a number, or a contiguous float32 device array of 1 value (per "
                         f"tensor) or {shape.num_kv_heads} (one per kv head)", device)
    return Scale(arr.ptr, 1.0, int(arr.shape[0] > 1))


def sinks_pointer(shape: DecodeShape, sinks, device) -> int:
    """The device pointer of ``run()``'s sinks (0: none), checked."""
    if sinks is None:
        return 0
    return float32_vector("sinks", sinks, (shape.num_qo_heads,),
                          f"a contiguous float32 device array of {shape.num_qo_heads} logits "
                          "(one per query head)", device).ptr


@dataclass
class RunInputs:
    """run()'s arrays, checked: the kernels' RunArguments, the outputs to return, the stream."""

    args: RunArguments
    out: object
    lse: object
    stream: object
    rows: int
    k_cache: DeviceArray


def run_inputs(shape: DecodeShape, q, k_cache, v_cache, *, out, lse, want_lse: bool, stream,
               k_scale, v_scale, sinks, rows: tuple[int, int], max_page: int,
               device) -> RunInputs:
    """Check run()'s inputs against the wrapper's ``shape`` and the plan, before any launch.
    ``rows``: (fewest, most) rows q may have (a graph-stable wrapper takes any batch up to its
    capacity; a per-shape plan exactly its own); out and lse then have q's rows."""
    qa = as_device_array("q", q)
    n = V.check_query_row_count("q", qa.shape, *rows)
    ka, va = kv_views(shape, k_cache, v_cache)
    q_stride = V.check_device_decode_arrays(
        qa, ka, va, batch_size=n, num_qo_heads=shape.num_qo_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, page_size=shape.page_size,
        dtype=shape.dtype, max_page=max_page, device=device, kv_dtype=shape.kv_dtype)
    k_scale = fp8_scale(shape, "k_scale", k_scale, device)
    v_scale = fp8_scale(shape, "v_scale", v_scale, device)
    sinks = sinks_pointer(shape, sinks, device)
    s = run_stream(stream, q)
    if out is None:
        out = new_output(q, (n, shape.num_qo_heads, shape.head_dim), shape.dtype, s)
    oa = as_device_array("out", out)
    V.check_device_output("out", oa, (n, shape.num_qo_heads, shape.head_dim), shape.dtype)
    lse_ptr = 0
    if want_lse:
        if lse is None:
            lse = new_output(q, (n, shape.num_qo_heads), "float32", s)
        la = as_device_array("lse", lse)
        V.check_device_output("lse", la, (n, shape.num_qo_heads), "float32")
        lse_ptr = la.ptr
    args = RunArguments(qa.ptr, ka.ptr, va.ptr, ka.strides[0], ka.strides[1], ka.strides[2],
                        oa.ptr, lse_ptr, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                        q_stride=q_stride)
    return RunInputs(args, out, lse, s, n, ka)
