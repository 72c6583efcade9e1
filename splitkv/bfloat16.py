"""bfloat16 as raw uint16 bits, for NumPy and CuPy alike: neither has a native bfloat16 dtype
(without ml_dtypes), so splitkv moves bfloat16 data as its 16-bit patterns.

Pure NumPy: each function takes the array module ``xp`` of its input, NumPy unless given (a
caller holding CuPy arrays passes ``splitkv.runtime.cupy_arrays.array_module(arr)``), so the
host and the device round the same way."""

from __future__ import annotations

import numpy as np


def bits_to_float32(bits, xp=np):
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def float32_to_bits(x, xp=np):
    """float32 -> uint16 bfloat16 bits, rounded to nearest even."""
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))
    return (rounded >> xp.uint32(16)).astype(xp.uint16)
