"""bfloat16 as raw uint16 bits, for NumPy and CuPy alike: neither has a native bfloat16 dtype
(without ml_dtypes), so splitkv moves bfloat16 data as its 16-bit patterns.

Each function takes the array module ``xp`` of its input (``array_namespace``), NumPy unless
given, so the host and the device round the same way. Nothing here imports CuPy."""

from __future__ import annotations

import sys

import numpy as np


def array_namespace(arr):
    """NumPy, or CuPy for a CuPy array: the array's own package, which is already imported when
    such an array exists, so host code never imports CuPy itself."""
    package = type(arr).__module__.partition(".")[0]
    return sys.modules[package] if package == "cupy" else np


def bits_to_float32(bits, xp=np):
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def float32_to_bits(x, xp=np):
    """float32 -> uint16 bfloat16 bits, rounded to nearest even; a NaN is 0x7FFF, as the GPU's
    conversion (cvt.rn.bf16.f32) gives it (the rounding bias added to a NaN's bits could carry
    it into the sign bit: 0x7FFFFFFF, the GPU's own NaN, would become -0)."""
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    bits = x.view(xp.uint32)
    rounded = bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))
    out = (rounded >> xp.uint32(16)).astype(xp.uint16)
    return xp.where(xp.isnan(x), xp.uint16(0x7FFF), out)
