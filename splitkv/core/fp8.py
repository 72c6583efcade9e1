"""fp8 KV caches: the two formats, their exact values, and the scales that turn them into K and V.

A cache entry is one byte, the code of an fp8 number (``float8_e4m3fn``: 1 sign, 4 exponent,
3 mantissa bits, bias 7, no infinities, NaN = S.1111.111, largest 448; ``float8_e5m2``: 1, 5, 2,
bias 15, IEEE-like with infinities and NaNs, largest 57344). The value the attention uses is
``code_value x scale``, with one scale per tensor or one per kv head, K and V scaled separately
(FlashInfer's ``k_scale``/``v_scale``, vLLM's per-tensor and per-head scales).

Every code's value is a float64 computed here from its bits (``decode_table``): the reference and
the CPU executor dequantize exactly, so their fp8 answers are the float64 attention over exactly
the values the GPU kernels see.
"""

from __future__ import annotations

import functools

import numpy as np

FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
# Names users know: torch / ml_dtypes (the canonical ones), vLLM's kv_cache_dtype strings.
_ALIASES = {"float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
            "e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
            "e5m2": "float8_e5m2"}
# (exponent bits, mantissa bits, bias) of each format
_LAYOUT = {"float8_e4m3fn": (4, 3, 7), "float8_e5m2": (5, 2, 15)}


def fp8_format(name: str, kv_dtype) -> str | None:
    """The canonical fp8 format of ``kv_dtype`` (a string such as 'float8_e4m3fn' or vLLM's
    'fp8_e5m2', or a torch / ml_dtypes dtype), or None for None."""
    if kv_dtype is None:
        return None
    if isinstance(kv_dtype, type):            # a scalar type, e.g. ml_dtypes.float8_e4m3fn
        try:
            kv_dtype = np.dtype(kv_dtype)
        except TypeError:
            pass
    if isinstance(kv_dtype, (int, float, complex, list, tuple, dict)):   # not a format at all
        raise TypeError(f"{name}: expected None, a format name or a dtype, got "
                        f"{type(kv_dtype).__name__}")
    key = getattr(kv_dtype, "name", None) or str(kv_dtype)
    key = key.replace("torch.", "")
    fmt = _ALIASES.get(key)
    if fmt is None:
        raise ValueError(f"{name}: expected None or an fp8 format ({', '.join(FP8_FORMATS)}, or "
                         f"{', '.join(sorted(set(_ALIASES) - set(FP8_FORMATS)))}), got {kv_dtype!r}")
    return fmt


@functools.lru_cache(maxsize=None)
def decode_table(fmt: str) -> np.ndarray:
    """[256] float64: the value of every code of ``fmt`` (NaN for its NaN codes, +-inf for
    e5m2's infinities), from the bits."""
    ebits, mbits, bias = _LAYOUT[fmt]
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> mbits) & ((1 << ebits) - 1)
    mantissa = codes & ((1 << mbits) - 1)
    frac = mantissa / float(1 << mbits)
    value = np.where(exponent == 0, frac * 2.0 ** (1 - bias), (1.0 + frac) * 2.0 ** (exponent - bias))
    top = exponent == (1 << ebits) - 1
    if fmt == "float8_e4m3fn":                  # only S.1111.111 is NaN; no infinities
        value = np.where(top & (mantissa == (1 << mbits) - 1), np.nan, value)
    else:                                       # IEEE: all-ones exponent is inf or NaN
        value = np.where(top, np.where(mantissa == 0, np.inf, np.nan), value)
    table = sign * value
    table.setflags(write=False)
    return table


def max_finite(fmt: str) -> float:
    table = decode_table(fmt)
    return float(table[np.isfinite(table)].max())


def codes_of(name: str, arr, fmt: str) -> np.ndarray:
    """The uint8 codes of an fp8 cache given as uint8 codes or as the format's own dtype
    (ml_dtypes on the host, torch or CuPy arrays are copied to the host first)."""
    if hasattr(arr, "get"):
        arr = arr.get()
    elif hasattr(arr, "detach"):                 # a torch tensor: its bytes
        arr = arr.detach().cpu().view(_torch_uint8()).numpy()
    arr = np.asarray(arr)
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype.name == fmt:
        return arr.view(np.uint8)
    raise TypeError(f"{name}: an {fmt} cache is uint8 codes or {fmt} values; got dtype "
                    f"{arr.dtype.name}")


def _torch_uint8():
    import torch

    return torch.uint8


def dequantize(codes: np.ndarray, fmt: str) -> np.ndarray:
    """float64 values of uint8 ``codes`` in ``fmt`` (exact)."""
    return decode_table(fmt)[codes]


def check_scale(name: str, scale, num_kv_heads: int) -> np.ndarray:
    """[num_kv_heads] float64 of a host scale: None (1.0), a number or one value (per tensor),
    or one value per kv head; each finite and > 0."""
    if scale is None:
        return np.ones(num_kv_heads)
    if hasattr(scale, "get"):
        scale = scale.get()
    if isinstance(scale, bool) or isinstance(scale, (str, bytes)):
        raise TypeError(f"{name}: expected a number or an array of numbers, got {scale!r}")
    try:
        values = np.asarray(scale, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number or an array of numbers, got "
                        f"{type(scale).__name__}") from None
    if values.size == 1:
        values = np.full(num_kv_heads, float(values.reshape(-1)[0]))
    elif values.shape != (num_kv_heads,):
        raise ValueError(f"{name}: expected one value (per tensor) or {num_kv_heads} (one per kv "
                         f"head), got shape {list(values.shape)}")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"{name}: expected finite values > 0, got {values.tolist()}")
    return values


def quantize(values, fmt: str, scale=1.0) -> np.ndarray:
    """uint8 codes of ``values / scale`` rounded to the nearest ``fmt`` number (ties to the
    even code), for tests and examples. NaN stays NaN; a value past the format's largest finite
    number raises (nothing is clamped). ``scale``: a positive finite number."""
    if fmt is None:
        raise ValueError(f"fmt: expected an fp8 format ({', '.join(FP8_FORMATS)}), got None")
    fmt = fp8_format("fmt", fmt)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    x = np.asarray(values, dtype=np.float64) / np.float64(scale)
    table = decode_table(fmt)
    finite = np.flatnonzero(np.isfinite(table) & (np.arange(256) < 128))   # codes of values >= 0
    order = finite[np.argsort(table[finite], kind="stable")]
    positive = table[order]
    big = np.abs(x) > positive[-1]
    if np.any(big & ~np.isnan(x)):
        raise ValueError(f"values: {np.abs(x[big & ~np.isnan(x)]).max()} (after the scale) is past "
                         f"{fmt}'s largest finite value {positive[-1]}")
    mag = np.abs(np.nan_to_num(x))
    hi = np.clip(np.searchsorted(positive, mag), 0, len(positive) - 1)
    lo = np.maximum(hi - 1, 0)
    pick_hi = (positive[hi] - mag < mag - positive[lo]) | (
        (positive[hi] - mag == mag - positive[lo]) & (order[hi] % 2 == 0))
    codes = np.where(pick_hi, order[hi], order[lo]).astype(np.uint8)
    codes |= (np.signbit(x) & (codes != 0)).astype(np.uint8) << 7
    nan_code = 0x7F if fmt == "float8_e4m3fn" else 0x7E
    return np.where(np.isnan(x), np.uint8(nan_code), codes).astype(np.uint8)
