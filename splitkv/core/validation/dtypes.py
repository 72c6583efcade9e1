"""Canonical dtype names (``dtype_name``): every array check asks, on each plan() and run(), so
a NumPy dtype's name is worked out once."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

_ALIASES = {"half": "float16", "bf16": "bfloat16", "fp16": "float16", "<V2": "bfloat16"}


def dtype_name(dtype) -> str:
    """Canonical name of a dtype given as a string, NumPy dtype or scalar type (``np.float16``),
    or framework dtype."""
    if isinstance(dtype, type):
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            pass
    if isinstance(dtype, np.dtype):
        return _numpy_dtype_name(dtype)
    return _canonical(getattr(dtype, "name", None) or str(dtype))


@lru_cache(maxsize=64)
def _numpy_dtype_name(dtype: np.dtype) -> str:
    """``dtype_name`` of a NumPy dtype, kept: ``np.dtype.name`` is a slow Python property.
    (Equal NumPy dtypes have the same name.)"""
    return _canonical(dtype.name or str(dtype))


def _canonical(name: str) -> str:
    name = name.replace("torch.", "").replace("jax.numpy.", "")
    return _ALIASES.get(name, name)
