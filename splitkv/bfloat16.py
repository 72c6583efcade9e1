"""bfloat16 as raw uint16 bits, for NumPy and CuPy alike: neither has a native bfloat16 dtype
(without ml_dtypes), so splitkv moves bfloat16 data as its 16-bit patterns."""

from __future__ import annotations

import numpy as np


def array_module(arr):
    """numpy or cupy, whichever ``arr`` belongs to (without importing CuPy for NumPy input)."""
    if type(arr).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def bits_to_float32(bits):
    """uint16 bfloat16 bits -> float32 (exact)."""
    xp = array_module(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def float32_to_bits(x):
    """float32 -> uint16 bfloat16 bits, rounded to nearest even."""
    xp = array_module(x)
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))
    return (rounded >> xp.uint32(16)).astype(xp.uint16)
