"""The host's bfloat16 conversions, which stand for the GPU's in every test and in the
context-parallel merge's NumPy twin."""

import numpy as np

from splitkv.core.bfloat16 import bits_to_float32, float32_to_bits


def test_rounding_is_to_nearest_even():
    # 1 + 2**-8 lies halfway between 1 and 1 + 2**-7: even (1); 1 + 3 * 2**-8 rounds up
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 65504.0], np.float32)
    assert bits_to_float32(float32_to_bits(x)).tolist() == [1.0, 1.0, 1 + 2**-6, -2.5, 65536.0]


def test_a_nan_stays_a_nan_whatever_its_bits():
    """The GPU's NaN is 0x7FFFFFFF: adding the rounding bias to its bits would carry into the
    sign bit and give -0; every NaN becomes 0x7FFF, as cvt.rn.bf16.f32 gives it."""
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFFC00001], np.uint32)
    got = float32_to_bits(nans.view(np.float32))
    assert got.tolist() == [0x7FFF] * 5
    assert np.isnan(bits_to_float32(got)).all()
    inf = np.array([np.inf, -np.inf, 3.4e38], np.float32)
    assert float32_to_bits(inf).tolist() == [0x7F80, 0xFF80, 0x7F80]
