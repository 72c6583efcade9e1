"""Zero-copy views of device arrays from CuPy, PyTorch, JAX or anything that speaks
``__cuda_array_interface__`` / DLPack. We only need a pointer, a shape, strides and a dtype;
no framework is imported here (PyTorch tensors are recognised by duck typing)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..core import validation as V

_TYPESTR = {"<f2": "float16", "<f4": "float32", "<u2": "uint16", "<i4": "int32", "<u4": "uint32",
            "<V2": "bfloat16", "|u1": "uint8"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "uint16": 2, "float32": 4, "int32": 4, "uint32": 4,
             "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class DeviceArray:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]     # in elements
    dtype: str
    device: int | None
    owner: object                # keeps the memory alive

    @property
    def is_contiguous(self) -> bool:
        if 0 in self.shape:
            return True
        expect, ok = 1, True
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size > 1 and stride != expect:
                ok = False
            expect *= size
        return ok


def _from_cupy(obj) -> DeviceArray:
    item = obj.dtype.itemsize
    name = V.dtype_name(obj.dtype)
    return DeviceArray(int(obj.data.ptr), tuple(obj.shape), tuple(s // item for s in obj.strides),
                       name, int(obj.device.id), obj)


def _from_torch_like(name: str, obj) -> DeviceArray:
    if not getattr(obj, "is_cuda", False):
        raise TypeError(f"{name}: expected a tensor on a CUDA device, got one on {obj.device}")
    return DeviceArray(int(obj.data_ptr()), tuple(int(s) for s in obj.shape),
                       tuple(int(s) for s in obj.stride()), V.dtype_name(obj.dtype),
                       int(obj.device.index), obj)


def _from_cai(name: str, obj) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    dtype = _TYPESTR.get(cai["typestr"])
    if dtype is None:
        raise TypeError(f"{name}: unsupported element type {cai['typestr']!r}")
    shape = tuple(int(s) for s in cai["shape"])
    item = _ITEMSIZE[dtype]
    if cai.get("strides") is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        strides = tuple(reversed(strides))
    else:
        strides = tuple(int(s) // item for s in cai["strides"])
    ptr = int(cai["data"][0]) if cai["data"][0] is not None else 0
    return DeviceArray(ptr, shape, strides, dtype, None, obj)


def itemsize(dtype: str) -> int | None:
    """Bytes of an element of ``dtype`` (a ``DeviceArray``'s), or None for one NumPy and this
    module do not know."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:
            return None
    return size


def as_device_array(name: str, obj) -> DeviceArray:
    """Describe ``obj`` (a device array of any common framework) without copying it."""
    import cupy

    if isinstance(obj, cupy.ndarray):
        return _from_cupy(obj)
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{name}: expected a device array (CuPy, PyTorch CUDA tensor, ...), got a "
                        "NumPy array; move it to the GPU first (cupy.asarray)")
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "stride", None)):
        return _from_torch_like(name, obj)
    if hasattr(obj, "__cuda_array_interface__"):
        try:
            return _from_cai(name, obj)
        except (TypeError, KeyError):
            pass
    if hasattr(obj, "__dlpack__"):
        try:
            return _from_cupy(cupy.from_dlpack(obj))
        except Exception as exc:  # the producer's own error says why
            raise TypeError(f"{name}: could not import it through DLPack: {exc}") from None
    raise TypeError(f"{name}: expected a device array (CuPy, or an object with "
                    f"__cuda_array_interface__ or __dlpack__), got {type(obj).__name__}")


def cupy_storage_dtype(dtype: str):
    """The CuPy dtype used for outputs of ``dtype``: native if CuPy handles it, else uint16 bits."""
    import cupy

    return cupy.float16 if dtype == "float16" else _bfloat16_dtype()


@lru_cache(maxsize=None)
def _bfloat16_dtype():
    import cupy

    try:
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
        cupy.empty(1, dtype=dt)
        return dt
    except Exception:  # no ml_dtypes, or a CuPy without bfloat16 arrays
        return np.dtype(np.uint16)


def as_cupy_stream(stream):
    """The caller's stream as a CuPy stream: None (the current one), a CuPy stream, anything
    with ``.cuda_stream`` (PyTorch), or a raw handle."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream) or isinstance(stream, cupy.cuda.ExternalStream):
        return stream
    handle = getattr(stream, "cuda_stream", stream)     # torch.cuda.Stream, or a raw handle
    if isinstance(handle, (int, np.integer)):
        return _external_stream(int(handle))
    raise TypeError(f"stream: expected a CuPy stream, an object with .cuda_stream, or an int "
                    f"handle, got {type(stream).__name__}")


_EXTERNAL_STREAMS: dict[tuple[int, int], object] = {}


def _external_stream(handle: int):
    """A CuPy view of a raw stream handle, one per (handle, device), kept: a decode loop passes
    the same stream every step. (CuPy 14 deprecates ExternalStream in favour of the stream
    protocol, which a bare handle does not speak, so its warning is silenced here.)"""
    import warnings

    import cupy

    key = (handle, cupy.cuda.runtime.getDevice())
    stream = _EXTERNAL_STREAMS.get(key)
    if stream is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy.cuda.ExternalStream(handle)
        if len(_EXTERNAL_STREAMS) >= 64:
            _EXTERNAL_STREAMS.clear()
        _EXTERNAL_STREAMS[key] = stream
    return stream


def split_kv_arrays(k_cache, v_cache) -> tuple[DeviceArray, DeviceArray]:
    """K and V descriptors from two device arrays, a (k, v) pair, or one combined array
    (``core.layouts``: FlashInfer's [pages, 2, ...] or vLLM's [2, pages, ...]), zero-copy."""
    from ..core.layouts import combined_axis, split_kv

    if v_cache is not None or isinstance(k_cache, (tuple, list)):
        k_cache, v_cache = split_kv(k_cache, v_cache)
        return as_device_array("k_cache", k_cache), as_device_array("v_cache", v_cache)
    kv = as_device_array("k_cache", k_cache)       # one combined array: sliced as descriptors
    axis = combined_axis("k_cache", kv.shape)
    keep = [i for i in range(5) if i != axis]
    shape = tuple(kv.shape[i] for i in keep)
    strides = tuple(kv.strides[i] for i in keep)
    item = _ITEMSIZE.get(kv.dtype)
    if item is None:
        raise TypeError(f"k_cache: unsupported element type {kv.dtype} for a combined K/V cache")
    k = DeviceArray(kv.ptr, shape, strides, kv.dtype, kv.device, kv.owner)
    v = DeviceArray(kv.ptr + kv.strides[axis] * item, shape, strides, kv.dtype, kv.device, kv.owner)
    return k, v


def nhd_view(name: str, arr: DeviceArray) -> DeviceArray:
    """An HND cache ([pages, heads, page_size, dim]) as the NHD view the kernels read: its
    axes 1 and 2 swapped, zero-copy (``core.layouts.as_nhd`` for descriptors)."""
    if len(arr.shape) != 4:
        raise ValueError(f"{name}: an HND cache is [num_pages, num_kv_heads, page_size, "
                         f"head_dim], got shape {list(arr.shape)}")
    shape, strides = list(arr.shape), list(arr.strides)
    shape[1], shape[2], strides[1], strides[2] = shape[2], shape[1], strides[2], strides[1]
    return DeviceArray(arr.ptr, tuple(shape), tuple(strides), arr.dtype, arr.device, arr.owner)

