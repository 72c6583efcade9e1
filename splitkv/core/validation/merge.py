"""The checks of ``merge_states`` and ``merge_states_n``'s inputs (re-exported by
``core.validation``): NumPy or CuPy arrays of one package.

merge_states / merge_states_n take NumPy or CuPy arrays (CuPy is never imported here: an array
is taken as CuPy when its type comes from the cupy package, as bfloat16.array_namespace does).
"""

from __future__ import annotations

import numpy as np

from . import dtype_name

MERGE_O_DTYPES = ("float16", "bfloat16", "float32", "float64")
MERGE_LSE_DTYPES = ("float32", "float64")


def _array_package(arr) -> str | None:
    """'NumPy' or 'CuPy' for an array of that package (a NumPy scalar counts), else None."""
    if isinstance(arr, (np.ndarray, np.generic)):
        return "NumPy"
    if type(arr).__module__.partition(".")[0] == "cupy" and hasattr(arr, "shape") and hasattr(arr, "dtype"):
        return "CuPy"
    return None


def check_merge_array(name: str, arr, dtypes: tuple[str, ...]):
    """A NumPy or CuPy array with a dtype in ``dtypes``. A NumPy scalar is returned as a 0-d
    array."""
    if _array_package(arr) is None:
        raise TypeError(f"{name}: expected a NumPy or CuPy array, got {type(arr).__name__}")
    dtype = dtype_name(arr.dtype)
    if dtype not in dtypes:
        raise TypeError(f"{name}: dtype {dtype!r} is not supported; expected one of {dtypes}")
    return np.asarray(arr) if isinstance(arr, np.generic) else arr


def check_same_kind(name: str, arr, like_name: str, like, *, dtype: bool = True) -> None:
    """``arr`` is an array of the package of ``like`` (and, with ``dtype``, of its dtype)."""
    if _array_package(arr) != _array_package(like):
        raise TypeError(f"{name}: expected a {_array_package(like)} array like {like_name}, "
                        f"got a {_array_package(arr)} array")
    if dtype and dtype_name(arr.dtype) != dtype_name(like.dtype):
        raise TypeError(f"{name}: expected dtype {dtype_name(like.dtype)} (the dtype of "
                        f"{like_name}), got {dtype_name(arr.dtype)}")


def check_merge_pair(name_o: str, o, name_lse: str, lse):
    """One state: o [..., head_dim] (float16, bfloat16, float32 or float64) and lse [...], the
    shape of o without its last axis (float32 or float64), of one package."""
    o = check_merge_array(name_o, o, MERGE_O_DTYPES)
    lse = check_merge_array(name_lse, lse, MERGE_LSE_DTYPES)
    check_same_kind(name_lse, lse, name_o, o, dtype=False)
    if o.ndim < 1:
        raise ValueError(f"{name_o}: expected at least 1 dimension (head_dim last), got a 0-d array")
    if tuple(o.shape[:-1]) != tuple(lse.shape):
        raise ValueError(f"{name_lse}: expected shape {list(o.shape[:-1])} (the shape of {name_o} "
                         f"without its last axis), got {list(lse.shape)}")
    return o, lse


def check_merge_states_n(o, lse):
    """merge_states_n's inputs: o [num_states >= 1, ..., head_dim], lse [num_states, ...]."""
    o, lse = check_merge_pair("o", o, "lse", lse)
    if o.ndim < 2:
        raise ValueError(f"o: expected [num_states, ..., head_dim] (at least 2 dimensions), "
                         f"got shape {list(o.shape)}")
    if o.shape[0] == 0:
        raise ValueError("o: expected at least one state along axis 0, got 0")
    return o, lse


def check_merge_states(o_a, lse_a, o_b, lse_b):
    """merge_states' inputs: two states of one shape; o_b of the package and dtype of o_a,
    lse_b of those of lse_a."""
    o_a, lse_a = check_merge_pair("o_a", o_a, "lse_a", lse_a)
    o_b, lse_b = check_merge_pair("o_b", o_b, "lse_b", lse_b)
    check_same_kind("o_b", o_b, "o_a", o_a)
    check_same_kind("lse_b", lse_b, "lse_a", lse_a)
    if tuple(o_a.shape) != tuple(o_b.shape):
        raise ValueError(f"o_b: expected shape {list(o_a.shape)} (the shape of o_a), got {list(o_b.shape)}")
    return o_a, lse_a, o_b, lse_b
